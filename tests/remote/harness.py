"""A fake NDIF for the tests: nnsight's own RemoteBackend, with the network swapped for a local server process.

``FakeServer`` runs `server.py` in a second interpreter without nnterp (see
there). ``intercept(server)`` replaces only ``RemoteBackend.request``, the
method that opens the websocket and POSTs: everything before it
(``model.trace(..., remote=True)`` -> ``_remote_backend`` -> ``to_model_key``,
``_remoteable_get_env``, the ``RequestModel`` envelope) and after it
(``finalize``: decompress and ``torch.load`` the saves; ``_push`` into the
caller's frame) is nnsight's code, and the payload is built by the backend's
own ``_serialize`` (``pull_env()`` + ``RequestModel.serialize``), exactly the
bytes NDIF would receive.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVER = Path(__file__).with_name("server.py")


def site_packages() -> str:
    """The site-packages holding torch, transformers and nnsight (this environment's)."""
    import nnsight

    return str(Path(nnsight.__file__).resolve().parents[1])


class ServerError(RuntimeError):
    """The fake server failed to run a request; the message is its traceback."""


class FakeServer:
    """One server process; requests are answered in order, models cached by key as a deployment does."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SERVER), site_packages()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
        )
        hello = self._receive()
        if not hello.get("ok"):
            self.close()
            raise ServerError(hello["error"])

    def _send(self, message: dict) -> None:
        data = pickle.dumps(message)
        self.process.stdin.write(struct.pack("<Q", len(data)) + data)
        self.process.stdin.flush()

    def _receive(self) -> dict:
        head = self.process.stdout.read(8)
        if len(head) < 8:
            raise ServerError(f"the fake server exited (code {self.process.poll()})")
        (size,) = struct.unpack("<Q", head)
        return pickle.loads(self.process.stdout.read(size))

    def run(self, request: dict, blob: bytes) -> bytes:
        """Run one request (``RequestModel.model_dump()`` and its payload); the saves as ``torch.save`` bytes."""
        self._send({**request, "blob": blob})
        answer = self._receive()
        if not answer["ok"]:
            raise ServerError(answer["error"])
        return answer["result"]

    def probe(self, expression: str) -> str:
        """``repr(eval(expression))`` in the server process."""
        self._send({"probe": expression})
        return self._receive()["result"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@dataclass
class Sent:
    """What crossed the wire: one entry per request."""

    requests: list[dict] = field(default_factory=list)
    payload_bytes: list[int] = field(default_factory=list)


@contextlib.contextmanager
def intercept(server: FakeServer | None):
    """Route every ``RemoteBackend`` request to ``server`` (or, with ``None``, only record it).

    Yields a `Sent`. With no server the request is built and serialized, then
    the trace ends with ``ServerError("not sent")`` so no result is expected.
    """
    from nnsight.intervention.backends.remote import RemoteBackend

    sent = Sent()
    original = RemoteBackend.request

    def request(self: RemoteBackend, envelope: Any, tracer: Any) -> Any:
        blob = self._serialize(tracer)
        sent.requests.append(envelope.model_dump())
        sent.payload_bytes.append(len(blob))
        if server is None:
            raise ServerError("not sent")
        return self.finalize(server.run(envelope.model_dump(), blob))

    RemoteBackend.request = request
    try:
        yield sent
    finally:
        RemoteBackend.request = original


__all__ = ["FakeServer", "ServerError", "Sent", "intercept", "site_packages"]
