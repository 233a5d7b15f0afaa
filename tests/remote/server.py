"""A stand-in for an NDIF model server, run in a separate interpreter that has no nnterp.

Started by `tests/remote/harness.py` as ``python -I -S server.py SITE_PACKAGES``:
isolated (no ``PYTHONPATH``, no user site, not even the script's folder on the
path) and without ``site`` (so no ``.pth`` file runs, and an editable install's
import hook for nnterp never gets installed); the one path entry it adds is the
environment's site-packages, which holds torch, transformers and nnsight. It
checks at start that ``import nnterp`` fails.

It speaks one frame at a time over stdin/stdout (8-byte length, then a stdlib
pickle of plain data), and does what a model server does with each request:

1. build the model named by the request's ``model_key`` with nnsight's own
   ``from_model_key`` (cached by key, so later requests reuse it, like a
   deployment does), with weights;
2. apply the request's ``env`` (``_remoteable_set_env``);
3. deserialize the payload against the model's persistent objects
   (``RequestModel.deserialize``: modules, interleaver, tokenizer, pipeline are
   the server's own; everything else is rebuilt from the payload);
4. run the block at trace depth 1, as the outermost trace, and collect the
   values it saved;
5. answer ``torch.save`` bytes of the saves (what ``RemoteBackend.finalize``
   loads), compressed if the request was, or the error's traceback.

Only the standard library, torch and nnsight are imported here.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import traceback


def _read(stream) -> bytes | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return stream.read(size)


def _write(stream, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


class _Pushed(dict):
    """A frame's locals that remember what the trace pushed back into them (its saves)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: dict = {}

    def update(self, other=(), **kwargs) -> None:
        other = dict(other, **kwargs)
        self.pushed.update(other)
        super().update(other)


_MODELS: dict = {}


def _model(model_key: str):
    from nnsight.modeling.mixins.remotable import Remotable

    if model_key not in _MODELS:
        _MODELS[model_key] = Remotable.from_model_key(model_key, dispatch=True)
    return _MODELS[model_key]


def _run(request: dict) -> bytes:
    import torch
    from nnsight.schema.request import RequestModel
    from nnsight.tracing.tracer import dec, inc

    model = _model(request["model_key"])
    model._remoteable_set_env(request.get("env") or {})
    compress = request.get("compress", False)
    tracer = RequestModel.deserialize(request["blob"], model._remoteable_persistent_objects(), compress=compress)
    frame = tracer.info.frame
    frame.f_locals = _Pushed(frame.f_locals)
    inc()
    try:
        tracer.execute(tracer.info.code)
    finally:
        dec()
    buffer = io.BytesIO()
    torch.save(dict(frame.f_locals.pushed), buffer, pickle_protocol=4)
    data = buffer.getvalue()
    if compress:
        import zstandard

        data = zstandard.ZstdCompressor(level=6).compress(data)
    return data


def main() -> None:
    sys.path.append(sys.argv[1])
    # Frames go out on a private copy of stdout; anything the model prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        import nnterp  # noqa: F401
    except ImportError:
        pass
    else:
        _write(out, pickle.dumps({"ok": False, "error": f"nnterp is importable on the server: {nnterp.__file__}"}))
        return
    import torch

    torch.set_num_threads(1)
    import nnsight  # noqa: F401  (the server's environment: loaded before the first request, as on a deployment)

    _write(out, pickle.dumps({"ok": True, "ready": True}))
    stdin = sys.stdin.buffer
    while True:
        frame = _read(stdin)
        if frame is None:
            return
        request = pickle.loads(frame)
        if request.get("probe"):
            answer = {"ok": True, "result": repr(eval(request["probe"]))}  # a diagnostic from the harness
        else:
            try:
                answer = {"ok": True, "result": _run(request)}
            except BaseException:  # noqa: BLE001 - every failure goes back to the client, as NDIF's ERROR status does
                answer = {"ok": False, "error": traceback.format_exc()}
        _write(out, pickle.dumps(answer))


if __name__ == "__main__":
    main()
