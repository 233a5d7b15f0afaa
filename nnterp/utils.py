"""nnterp 1.x's ``nnterp.utils``: small helpers the 1.x modules share, at their 1.x names.

``TraceTensor`` is `torch.Tensor`: under nnsight 0.8 a value read inside a
trace is the real tensor (1.x's ``Union[Tensor, Object]`` named the proxy
type of older nnsight, which 0.8 no longer has). The architecture names
(``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) are transformers' classes,
imported on first use, or `ArchitectureNotFound` where the installed
transformers lacks one.
"""

from __future__ import annotations

import sys
from typing import Any

import nnsight
import torch
import transformers

from .logging import logger

TraceTensor = torch.Tensor
NNSIGHT_VERSION = nnsight.__version__
TRANSFORMERS_VERSION = transformers.__version__

#: 1.x's architecture names, each a transformers class resolved on first access.
_ARCHITECTURES = (
    "OPTForCausalLM", "MixtralForCausalLM", "BloomForCausalLM", "GPT2LMHeadModel", "Qwen2MoeForCausalLM",
    "DbrxForCausalLM", "GPTJForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM",
)


class ArchitectureNotFound:
    """Stands for an architecture the installed transformers does not have (``isinstance`` is then always False)."""


def __getattr__(name: str) -> Any:
    if name in _ARCHITECTURES:
        try:
            found = getattr(transformers, name)
        except (ImportError, AttributeError):
            found = ArchitectureNotFound
        globals()[name] = found
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's ``IPKernelApp``)."""
    try:
        return "IPKernelApp" in sys.modules["IPython"].get_ipython().config
    except Exception:
        return False


def display_markdown(text: str) -> None:
    """Show ``text`` as Markdown in a notebook (needs IPython)."""
    from IPython.display import Markdown, display

    display(Markdown(text))


def display_source(source: str) -> None:
    """Show ``source`` as a Python code block in a notebook."""
    display_markdown(f"```py\n{source}\n```")


class DummyCache:
    """A stand-in for a layer's cache in a tuple output (1.x's ``skip_layers`` rebuilt tuples with it)."""

    def to_legacy_cache(self) -> None:
        return None


def dummy_inputs() -> dict:
    """A three-token batch, ``{"input_ids": [[0, 1, 1]]}``, for a check that only needs the model to run."""
    return {"input_ids": torch.tensor([[0, 1, 1]])}


def try_with_scan(
    model: Any,
    function: Any,
    error_to_throw: Exception,
    allow_dispatch: bool,
    warn_if_scan_fails: bool = True,
    errors_to_raise: tuple[type[Exception], ...] | type[Exception] | None = None,
) -> bool:
    """Run ``function()`` inside ``model.scan(dummy_inputs())``, falling back to ``model.trace`` (which loads the weights).

    ``True`` if the scan sufficed, ``False`` if the trace was needed.
    ``error_to_throw`` is raised (from the cause) when both fail, or when the
    scan fails, ``allow_dispatch`` is False and the weights are not loaded;
    an error of ``errors_to_raise`` is re-raised at once.
    """
    try:
        with model.scan(dummy_inputs(), use_cache=False) as tracer:
            function()
            tracer.stop()
        return True
    except Exception as error:
        if errors_to_raise is not None and isinstance(error, errors_to_raise):
            raise
        if not allow_dispatch and not model.dispatched:
            logger.error("Scan failed and trace() fallback is disabled")
            raise error_to_throw from error
        if warn_if_scan_fails:
            logger.warning("Error when trying to scan the model - using .trace() instead (which will dispatch the model)...")
        try:
            with model.trace(dummy_inputs()) as tracer:
                function()
                tracer.stop()
        except Exception as second:
            if errors_to_raise is not None and isinstance(second, errors_to_raise):
                raise
            raise error_to_throw from second
        logger.warning(f"Using trace() succeed! Error when trying to scan the model:\n{error}")
        return False


def unpack_tuple(tensor_or_tuple: Any) -> Any:
    """The first element of a tuple (a module's main output), or the value itself."""
    if isinstance(tensor_or_tuple, tuple):
        return tensor_or_tuple[0]
    return tensor_or_tuple
