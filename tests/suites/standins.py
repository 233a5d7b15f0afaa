"""Stand-ins for optimized kernel packages (mamba_ssm, causal-conv1d, fla), which do not build without CUDA.

transformers' hub dispatcher binds each kernel name to a closure whose cell
``implementation`` holds the optimized kernel when its package imported (the
pure-torch body otherwise). `compiled_kernels` puts a stand-in in that cell,
as an installed package would, and restores the body on exit. Three kinds:

* `refuse` raises what the real CUDA kernels raise on a CPU tensor (mamba_ssm, causal-conv1d);
* `no_driver` raises what fla's Triton kernels raise on a machine with no GPU (Triton finds no driver);
* `Compiled` runs: a package that works on this device. It computes with transformers' pure-torch body (so its
  numbers are the oracle's) but is an object with no Python source nnsight could drill into, as a compiled
  kernel is; the dispatcher reports its package (`nnterp.recurrent.kernels.compiled_package`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

REFUSAL = "Expected u.is_cuda() to be true"
#: Triton's error when no GPU driver is found (triton 3.x, ``runtime/driver.py``), which fla's kernels raise on a CPU.
NO_DRIVER = "0 active drivers ([]). There should only be one."


def refuse(body: Callable) -> Callable:
    def refusing(*args, **kwargs):
        raise RuntimeError(REFUSAL)

    return refusing


def no_driver(body: Callable) -> Callable:
    def failing(*args, **kwargs):
        raise RuntimeError(NO_DRIVER)

    return failing


class Compiled:
    """A compiled kernel that runs on this device: a callable object (no function, no source), counting its calls."""

    def __init__(self, body: Callable) -> None:
        self.body = body
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.body(*args, **kwargs)


@contextmanager
def compiled_kernels(modeling, names: Iterable[str], stand_in: Callable = refuse) -> Iterator[dict]:
    """Within the block, ``modeling``'s dispatchers ``names`` dispatch to ``stand_in(pure-torch body)``.

    Yields ``{name: the stand-in}``; the bodies are back in their cells on exit, whatever happened inside.
    """
    swapped, bound = [], {}
    try:
        for name in dict.fromkeys(names):
            fn = modeling.__dict__[name]
            cell = fn.__closure__[fn.__code__.co_freevars.index("implementation")]
            swapped.append((cell, cell.cell_contents))
            cell.cell_contents = bound[name] = stand_in(cell.cell_contents)
        yield bound
    finally:
        for cell, original in swapped:
            cell.cell_contents = original


def mixer_kernels(mixer) -> tuple[str, ...]:
    """Every kernel name a mixer component's forward calls (the scan's two and the convolution's two)."""
    return (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS)
