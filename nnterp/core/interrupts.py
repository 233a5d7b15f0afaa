"""Holding Ctrl-C while nnterp changes the process in several steps, so no step is left half done.

`route_kernels` rebinds names and resets compiled forwards; `fast_states` and
`chunk_per_token` set every mixer of a model. A SIGINT arriving in between
would leave names and mixers disagreeing. Inside `interrupts_held` it is
recorded and raised as ``KeyboardInterrupt`` when the block ends (in the main
thread; elsewhere Python delivers no SIGINT and this is a no-op).
"""

from __future__ import annotations

import signal
import threading


class interrupts_held:  # noqa: N801  (a context manager used as a function)
    """Hold SIGINT until the block ends, then raise it (main thread only; elsewhere a no-op).

    A class rather than a generator: code that travels to a server keeps no decorators (docs/remote.md).
    """

    def __enter__(self) -> interrupts_held:
        self.received: list = []
        self.installed = False
        if threading.current_thread() is threading.main_thread():
            try:
                self.previous = signal.signal(signal.SIGINT, self._hold)
                self.installed = True
            except ValueError:  # not the main interpreter
                pass
        return self

    def _hold(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.default_int_handler)
        if self.received:
            raise KeyboardInterrupt
