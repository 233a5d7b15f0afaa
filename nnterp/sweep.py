"""A patching sweep: the donor prompt's state written into the clean prompt, at every layer × position.

Mental model: for each recurrent layer ``l`` and token position ``t`` of the
clean prompt, one trace of the clean prompt runs with
``model.layers[l].linear_attn.set_state_after(t, donor)`` (the tokens after
``t`` continue from the donor's memory at that layer, every other layer
untouched), and the cell is the probability of ``target_token`` as the next
token. ``SweepResult.effect`` is that minus the clean run's probability:
which layer's memory, at which point of the prompt, carries what the target
depends on.

The donor state of cell ``(l, t)`` is the donor prompt's own state after its
token ``t`` at layer ``l`` (``state_after(t)``, read from one routed trace of
the donor): the same amount of text read, the same position, as in activation
patching between aligned prompts. Positions therefore run up to the shorter
prompt's length. (The alternative, the donor's final ``state_output`` at every
position, measures something else: where the whole donor memory is
transplanted; use `set_state_after` by hand for that.)

Per-token states need the token-by-token kernel, so the sweep routes the
family with ``with nnterp.route_kernels(model.family, "torch"):`` for its
duration (and, on Mamba-2, makes every token a chunk boundary with
``nnterp.chunk_per_token``: `per_token_states`), and restores both on the way
out, interrupted or not.
A tqdm bar counts the cells; Ctrl-C (``KeyboardInterrupt``) stops the sweep
and returns what was gathered, with ``complete=False`` and the cells not run
as NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .core.errors import InvalidArgument, OutOfVocabulary, PositionError, WrongType
from .core.indices import layer_indices
from .recurrent.no_cache import run_kwargs
from .recurrent.routing import route_kernels

__all__ = ["SweepResult", "patch_sweep", "per_token_states"]


@dataclass
class SweepResult:
    """What `patch_sweep` gathered.

    Attributes:
        layers: the patched layer indices (rows of the grids).
        positions: the patched token positions (columns).
        tokens: the clean prompt's tokens (``convert_ids_to_tokens``).
        target: the target token's id.
        clean: the target's probability on the clean prompt, unpatched.
        probs: ``[len(layers), len(positions)]``, the target's probability with
            that cell patched; NaN where the cell was not run.
        complete: ``False`` when the sweep was interrupted.
    """

    layers: list
    positions: list
    tokens: list
    target: int
    clean: float
    probs: torch.Tensor
    complete: bool

    @property
    def effect(self) -> torch.Tensor:
        """``probs - clean``: how much each cell's patch raised (> 0) or lowered the target's probability."""
        return self.probs - self.clean

    @property
    def done(self) -> int:
        """How many cells were run."""
        return int(torch.isfinite(self.probs).sum())


@contextmanager
def per_token_states(model: Any) -> Iterator[None]:
    """While open, every recurrent mixer of ``model`` serves the state after every token; undone on exit.

    Routes the family through transformers' token-by-token kernel
    (``route_kernels(model.family, "torch")``, process-wide) and, where a
    Mamba-2 mixer still scans in chunks, makes every token a boundary
    (``chunk_per_token(model)``, this model only). A setting the caller made
    is left as it is, and restored on exit.
    """
    from .components.state_space import StateSpace
    from .recurrent.settings import chunk_per_token, per_token_setting

    with ExitStack() as stack:
        stack.enter_context(route_kernels(model.family, "torch"))
        mixers = [getattr(layer, "linear_attn", None) for layer in model.layers]
        if any(isinstance(m, StateSpace) and per_token_setting(m) != "chunks" for m in mixers):
            stack.enter_context(chunk_per_token(model))
        yield


def _vocabulary_size(model: Any) -> int:
    """How many entries ``next_token_probs`` has: the unembedding's outputs (the logits' last dimension)."""
    return int(model.lm_head._module.weight.shape[0])


def target_id(model: Any, target: int | str) -> int:
    if isinstance(target, torch.Tensor) and target.numel() == 1 and not target.is_floating_point():
        target = int(target)  # `probs.argmax()`
    if isinstance(target, int) and not isinstance(target, bool):
        size = _vocabulary_size(model)
        if not 0 <= target < size:
            raise OutOfVocabulary(
                f"target_token {target} is not a token id of this model: ids run 0..{size - 1} (a vocabulary of "
                f"{size}); a negative id is not counted from the end. Pass the id, or the token as a string"
            )
        return target
    if isinstance(target, str):
        ids = model.tokenizer(target, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise InvalidArgument(f"target_token {target!r} is {len(ids)} tokens here ({ids}); pass one token or its id")
        return ids[0]
    raise WrongType(f"target_token takes a token id (an int) or a one-token string, got {type(target).__name__}")


def recurrent_layers(model: Any, layers: Sequence[int] | None) -> list:
    recurrent = [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]
    if layers is None:
        if not recurrent:
            raise InvalidArgument("this model has no recurrent mixer (no layer has a linear_attn) to patch")
        return recurrent
    layers = layer_indices(layers, len(model.layers), "layers=...")
    missing = [i for i in layers if i not in recurrent]
    if missing:
        raise InvalidArgument(f"layers {missing} have no recurrent mixer; the recurrent layers are {recurrent}")
    return list(layers)


def sweep_positions(positions: Sequence[int] | None, n_clean: int, n_donor: int) -> list:
    limit = min(n_clean, n_donor)
    if positions is None:
        return list(range(limit))
    out = [p + n_clean if p < 0 else p for p in positions]
    bad = [p for p in out if not 0 <= p < limit]
    if bad:
        raise PositionError(
            f"positions {bad} are outside the tokens both prompts have (clean {n_clean}, donor {n_donor}): "
            f"the donor state of position t is the donor's state after its token t"
        )
    return out


def prompt_states(model: Any, prompt: Any, layers: list, run: dict) -> dict:
    """Every token's state of each layer on ``prompt`` (a donor, a corrupt run): ``{layer: [batch, seq, ...]}``."""
    saved: list = []  # bound outside the trace: it must outlive it
    with torch.no_grad(), model.trace(prompt, **run):
        for index in layers:  # forward order: a layer's reads before later layers'
            saved.append(model.layers[index].linear_attn.states.save())
    return dict(zip(layers, saved))


def _patched_prob(model: Any, prompt: str, layer: int, position: int, donor: torch.Tensor, target: int, run: dict) -> float:
    with torch.no_grad(), model.trace(prompt, **run):
        model.layers[layer].linear_attn.set_state_after(position, donor)
        prob = model.next_token_probs[0, target].save()
    return float(prob)


def patch_sweep(
    model: Any,
    clean_prompt: str,
    donor_prompt: str,
    target_token: int | str,
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    *,
    progress: bool = True,
    on_cell: Callable[[int, int, float], None] | None = None,
) -> SweepResult:
    """Patch the donor's state into the clean prompt at every layer × position; collect p(target).

    Args:
        model: a `StandardizedTransformer` with recurrent mixers that serve
            ``set_state_after`` once routed (a gated DeltaNet family).
        clean_prompt: the prompt that is run, patched one cell at a time.
        donor_prompt: the prompt whose state after token ``t`` is written
            after the clean prompt's token ``t``.
        target_token: the next token whose probability is collected: an id
            (``0 .. vocabulary size - 1``; a negative or larger id raises
            `OutOfVocabulary`, it does not count from the end), or a string
            that is one token.
        layers: layer indices to patch (default: every layer with a
            ``linear_attn``).
        positions: token positions to patch (default: every position both
            prompts have); negative counts from the clean prompt's end.
        progress: show a tqdm progress bar over the cells.
        on_cell: called as ``on_cell(layer, position, prob)`` after each cell
            (a hook for logging; raising ``KeyboardInterrupt`` there stops the
            sweep like Ctrl-C).

    Returns:
        a `SweepResult`; ``complete`` is ``False`` if the sweep was
        interrupted, with the cells not run left NaN.
    """
    from tqdm.auto import tqdm

    target = target_id(model, target_token)
    layers = recurrent_layers(model, layers)
    clean_ids = model.tokenizer(clean_prompt).input_ids
    n_donor = len(model.tokenizer(donor_prompt).input_ids)
    positions = sweep_positions(positions, len(clean_ids), n_donor)
    tokens = model.tokenizer.convert_ids_to_tokens(clean_ids)
    probs = torch.full((len(layers), len(positions)), float("nan"))
    complete = False
    run = run_kwargs(model)  # without a cache where transformers refuses one: nothing here needs what only it keeps
    with per_token_states(model):
        with torch.no_grad(), model.trace(clean_prompt, **run):
            clean = model.next_token_probs[0, target].save()
        donors = prompt_states(model, donor_prompt, layers, run)
        bar = tqdm(total=probs.numel(), desc="patch sweep", unit="cell", disable=not progress, leave=False)
        try:
            for row, layer in enumerate(layers):
                for column, position in enumerate(positions):
                    prob = _patched_prob(model, clean_prompt, layer, position, donors[layer][:, position], target, run)
                    probs[row, column] = prob  # stored before the hook, so an interrupt there keeps it
                    bar.update(1)
                    if on_cell is not None:
                        on_cell(layer, position, prob)
            complete = True
        except KeyboardInterrupt:
            # Keep what was gathered: the caller gets a partial grid and complete=False.
            pass
        finally:
            bar.close()
    return SweepResult(layers, positions, tokens, target, float(clean), probs, complete)
