"""Stand-ins for optimized kernel packages (mamba_ssm, causal-conv1d, fla), which do not build without CUDA.

transformers' hub dispatcher binds each kernel name to a closure whose cell
``implementation`` holds the optimized kernel when its package imported (the
pure-torch body otherwise). `compiled_kernels` puts a stand-in in that cell,
as an installed package would, and restores the body on exit. The stand-in
raises what the real CUDA kernels raise on a CPU tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

REFUSAL = "Expected u.is_cuda() to be true"


def _refuse(*args, **kwargs):
    raise RuntimeError(REFUSAL)


@contextmanager
def compiled_kernels(modeling, names: Iterable[str]) -> Iterator[None]:
    """Within the block, ``modeling``'s dispatchers ``names`` dispatch to a compiled stand-in."""
    swapped = []
    try:
        for name in names:
            fn = modeling.__dict__[name]
            cell = fn.__closure__[fn.__code__.co_freevars.index("implementation")]
            swapped.append((cell, cell.cell_contents))
            cell.cell_contents = _refuse
        yield
    finally:
        for cell, original in swapped:
            cell.cell_contents = original


def mixer_kernels(mixer) -> tuple[str, ...]:
    """Every kernel name a mixer component's forward calls (the scan's two and the convolution's two)."""
    return (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS)
