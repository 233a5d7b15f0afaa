"""``nnterp.collect``: named values over a dataset into a store on disk (`nnterp.store`), in bounded memory.

Mental model. A study over a dataset (a probe, a dictionary, statistics of the
states) needs the same few values of every prompt, more of them than fit in
memory. `collect` runs the prompts in batches of ``batch_size`` (one trace
each, left-padded as the model's tokenizer pads), reads the named values in
each trace, keeps each prompt's selected positions of them, and writes the
batch as one shard (``shard-00000.safetensors``, ...) before the next batch
runs: memory holds one batch's values and the model, whatever the dataset's
size. `nnterp.store` says how the store is laid out on disk.

Names. A value is named by its path from the model, as ``support()`` lists it
per layer: ``"layers.3.layer_output"``, ``"layers.0.linear_attn.state_output"``,
``"layers.0.linear_attn.states"``, ``"layers.2.self_attn.attention_output"``,
``"logits"``, ``"next_token_probs"``. A value whose documented shape has a
token axis (``[batch, seq, ...]``) is stored at the selected positions,
``[positions, ...]`` per prompt; one without (``state_output``, ``[batch,
...state]``) is stored whole, ``[...state]`` per prompt.

Positions. ``None``: every token of the prompt; an int or a list of them
(negative ones count from the prompt's end: ``-1`` is its last token); or a
callable of the prompt's token ids (a 1-d tensor) returning those. Positions
are the prompt's own, never the padded batch's.

Resuming. Called again with ``resume=True`` on the same prompts, `collect`
checks that the store was made by this model with these values and positions
and that the prompts it lists are the ones given (their hashes), then runs
the batches after the last one listed (`nnterp.store` says why a killed run
leaves only whole batches): the store ends as an uninterrupted run leaves
it, value for value. ``resume=False`` starts the store over.

Failure mode worth knowing: the values inside one trace are read in the order
the model computes them (`collect` orders them by layer, and within a layer
the mixer before the MLP before the layer's output); within one component,
list its values in the order the forward makes them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

import nnsight
import torch
from tqdm.auto import tqdm

from . import __version__
from .core import indices
from .core.errors import InvalidArgument, Unavailable, WrongType
from .recurrent import replay
from .store import StateStore, StoreWriter, model_name

#: Where a component's values are read in a layer's forward (`collect` orders reads by it).
COMPONENT_ORDER = {"layer_input": 0, "self_attn": 1, "linear_attn": 1, "mlp": 2, "layer_output": 3}


class Value:
    """One named value to collect: the envoy that serves it, its name there, and its token axis (``None``: none)."""

    def __init__(self, model: Any, name: str, factorized: bool | str = False) -> None:
        if not isinstance(name, str):
            raise WrongType(f"`collect`: a value is named by a string ('layers.0.linear_attn.state_output'), got {type(name).__name__}")
        self.name = name
        parts = name.split(".")
        owner = model
        try:
            for part in parts[:-1]:
                owner = owner[int(part)] if part.lstrip("-").isdigit() else getattr(owner, part)
        except (AttributeError, IndexError, TypeError) as error:
            raise InvalidArgument(f"`collect`: no value {name!r} on this model ({error}); names are paths as support() lists them, e.g. 'layers.0.layer_output'") from None
        if owner is None:
            raise InvalidArgument(f"`collect`: {name!r}: this layer has no {parts[-2]!r} (see model.support())")
        self.owner, self.attribute = owner, parts[-1]
        self.spec, self.inputs, self.lookback = None, False, 0
        declared = type(owner).values() if hasattr(type(owner), "values") else {}
        if factorized and self.attribute == "states" and "effective_attention" in declared:
            # Stored as the kernel's arguments: served wherever the kernel call is (its effective attention's condition).
            self.spec = replay.spec_of(owner, f"`collect(..., factorized={factorized!r})` of {name!r}")
            declared = {"states": declared["effective_attention"]}
            self.inputs = factorized == "inputs"
            refused = replay.unrecomputable(owner.hf_module()) if self.inputs else None
            if refused is not None:
                raise Unavailable(f"`collect(..., factorized='inputs')` of {name!r}", refused)
            self.lookback = replay.lookback(owner.hf_module()) if self.inputs else 0
        descriptor = declared.get(self.attribute, getattr(type(owner), self.attribute, None))
        if descriptor is None or not hasattr(descriptor, "reason"):
            raise InvalidArgument(f"`collect`: {name!r} is not a value nnterp serves (see model.support() for what each layer has)")
        reason = descriptor.reason(owner)
        if reason is not None:
            raise Unavailable(f"`collect` of {name!r}", reason)
        annotation = getattr(descriptor, "annotation", None)
        dims = getattr(annotation, "dim_str", "").split()
        if not dims or dims[0] != "batch":
            raise InvalidArgument(f"`collect`: {name!r} has no documented batch axis, so its rows cannot be stored per prompt")
        self.token_axis = dims.index("seq") if "seq" in dims else None
        layer = next((int(p) for p in parts if p.lstrip("-").isdigit()), None)
        component = parts[2] if len(parts) > 2 else parts[-1]  # "layers.3.layer_output", "layers.0.linear_attn.states"
        self.order = (float("inf"), 0) if layer is None else (layer % len(model.layers), COMPONENT_ORDER.get(component, 1))


def collect(
    model: Any, prompts: Iterable[str], path: str | os.PathLike, values: list[str], positions: Any = None, batch_size: int = 8,
    resume: bool = True, remote: bool = False, progress: bool = True, factorized: bool | str = False, checkpoint_every: int = 64,
    **trace_kwargs: Any,
) -> StateStore:
    """Write ``values`` (names as `nnterp.store` lists them) of every prompt at ``positions`` into a store at ``path``.

    ``prompts``: a list, any iterable of strings, or a ``datasets.Dataset`` column. ``positions``: ``None``
    (every token), an int or a list (negative ones count from each prompt's end), or a callable of a prompt's
    token ids returning those. ``batch_size`` prompts run per trace (``remote=True``: on NDIF, each batch's
    values coming back as it ends). A tqdm bar counts the prompts. ``trace_kwargs`` go to every trace.
    ``factorized=True`` stores each ``...linear_attn.states`` value (any recurrent kind) as what the recurrence
    writes (every token's kernel arguments the states are computed from, and the state after every
    ``checkpoint_every``-th token: `nnterp.recurrent.replay`), read back by ``store.state(i, layer, t)`` /
    ``store.states(i, layer, positions)``, each from the checkpoint before it (``positions`` does not apply to
    it); locally only. ``factorized="inputs"`` keeps the mixer's input instead of the kernel's arguments (``hidden``
    numbers a token in the model's dtype, a fraction of those on a DeltaNet: the reference page's formula), and a
    replay recomputes the arguments by running the layer's mixer on them: the store reads those states only when
    opened with the model (``StateStore(path, model=model)``; the store returned is).
    Returns the store, opened (`StateStore`). The module docstring says how a killed run resumes.
    """
    what = "collect"
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgument(f"`{what}`: batch_size is a positive int, got {batch_size!r}")
    if isinstance(prompts, str):
        raise WrongType(f"`{what}` takes a list (or any iterable) of prompts, got one string: pass [prompt]")
    if isinstance(values, str) or not values:
        raise InvalidArgument(f"`{what}`: values is a non-empty list of names, e.g. ['layers.0.linear_attn.state_output']")
    if positions is not None and not callable(positions):
        indices.selection(positions, 1 << 30, f"`{what}` positions")  # the types only: each prompt checks its range
    if not (factorized is True or factorized is False or factorized == "inputs"):
        raise InvalidArgument(f"`{what}`: factorized is False, True (the kernel's arguments) or 'inputs' (the mixer's inputs), got {factorized!r}")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise InvalidArgument(f"`{what}`: checkpoint_every is a positive int, got {checkpoint_every!r}")
    reads = sorted((Value(model, name, factorized) for name in dict.fromkeys(values)), key=lambda value: value.order)
    if remote and any(value.spec is not None for value in reads):
        raise InvalidArgument(f"`{what}`: factorized=True runs locally (it reads the kernel's arguments as they are): pass remote=False")
    header = {
        "format": 2 if any(value.inputs for value in reads) else 1, "model": model_name(model), "revision": getattr(model._module.config, "_commit_hash", None),
        "nnterp": __version__, "values": [value.name for value in reads], "positions": _describe(positions),
        "batch_size": batch_size, "factorized": {v.name: _factorized(v, checkpoint_every) for v in reads if v.spec},
    }
    writer = StoreWriter(path, header, resume)
    done = writer.listed
    total = len(prompts) if hasattr(prompts, "__len__") else None
    tokenizer = model.tokenizer
    with tqdm(total=total, disable=not progress, desc=what, initial=len(done)) as bar:
        for shard, batch in enumerate(_batches(prompts, batch_size)):
            first = shard * batch_size
            hashes = [_hash(prompt) for prompt in batch]
            listed = done[first : first + len(batch)]
            if listed:
                if [p["sha256"] for p in listed] != hashes or len(listed) != len(batch):
                    raise InvalidArgument(
                        f"`{what}`: prompts {first}..{first + len(batch) - 1} differ from those the store at {path} holds: "
                        "pass the same prompts in the same order to resume, resume=False to start it over, or another path"
                    )
                continue
            records, tensors, parts = _run_batch(model, tokenizer, batch, reads, positions, first, remote, checkpoint_every, trace_kwargs)
            writer.describe({v.name: _trailing(tensors, first, v) for v in reads if v.spec is None}, parts)
            for record, digest in zip(records, hashes):
                record["sha256"] = digest
            writer.add(shard, tensors, records)
            bar.update(len(batch))
    return writer.finish(model)


def _run_batch(model: Any, tokenizer: Any, batch: list, reads: list, positions: Any, first: int, remote: bool, every: int, kwargs: dict) -> tuple:
    """One trace of ``batch``: each prompt's record (length, positions), the shard's tensors, and what the manifest
    says of each factorized value (the names of its arguments)."""
    encoded = tokenizer(batch, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    records, rows = [], []
    reals = [mask[row].nonzero().flatten() for row in range(len(batch))]  # each prompt's tokens in its padded row
    for row, real in enumerate(reals):
        own = ids[row, real]
        chosen = _positions(positions, own, first + row)
        records.append({"length": int(real.numel()), "positions": chosen})
        rows.append(real[chosen].tolist())
    # Plain data and envoys only inside the trace: on NDIF the block runs where nnterp's classes are not.
    plan = [(value.name, value.owner, value.attribute, value.token_axis, value.spec is not None, value.inputs) for value in reads]
    count = len(batch)
    with torch.no_grad(), model.trace(dict(encoded), remote=remote, **kwargs):
        saved = nnsight.save({})
        for name, owner, attribute, axis, arguments, inputs in plan:
            if inputs:
                saved[f"{name}/inputs"] = owner.input.detach().to("cpu").clone()
            if arguments:
                saved[name] = {key: replay.kept(x) for key, x in replay.arguments_of(owner).items()}
                continue
            got = getattr(owner, attribute)
            if axis is None:
                saved[name] = [got[row] for row in range(count)]
            else:
                saved[name] = [got[row].index_select(axis - 1, torch.tensor(rows[row], device=got.device)) for row in range(count)]
    tensors, parts = {}, {}
    for row in range(len(batch)):
        i = first + row
        tensors[f"{i}/input_ids"] = ids[row, reals[row]].clone()
        for value in reads:
            if value.spec is None:
                tensors[f"{i}/{value.name}"] = saved[value.name][row].detach().to("cpu").contiguous().clone()
                continue
            factorized = replay.from_served(value.spec, saved[value.name], row, reals[row], every)
            inputs = saved[f"{value.name}/inputs"][row, reals[row]].clone() if value.inputs else None
            tensors.update(factorized.tensors(f"{i}/{value.name}", inputs))
            parts[value.name] = {
                "tokens": sorted(factorized.tokens), "plain": factorized.plain(),
                "shared": sorted(n for n, x in factorized.shared.items() if isinstance(x, torch.Tensor)),
            }
    return records, tensors, parts


# -- helpers -----------------------------------------------------------------------------


def _batches(prompts: Iterable[str], size: int) -> Iterable[list]:
    batch: list = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise WrongType(f"`collect` takes prompts as strings, got {type(prompt).__name__}")
        batch.append(prompt)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _positions(positions: Any, ids: torch.Tensor, i: int) -> list[int]:
    what = f"`collect` positions of prompt {i}"
    if positions is None:
        return list(range(ids.numel()))
    chosen = positions(ids) if callable(positions) else positions
    found = indices.selection(chosen, ids.numel(), what, place=f"its {ids.numel()} tokens")
    return list(range(ids.numel())) if found is None else found


def _trailing(tensors: dict, first: int, value: Value) -> dict:
    tensor = tensors[f"{first}/{value.name}"]
    shape = list(tensor.shape[1:]) if value.token_axis is not None else list(tensor.shape)
    return {"shape": shape, "dtype": str(tensor.dtype).removeprefix("torch."), "token_axis": value.token_axis is not None}


def _factorized(value: Value, every: int) -> dict:
    """A factorized value's entry in the manifest (a store of its arguments keeps the keys of the first format)."""
    entry = {"spec": value.spec.name, "checkpoint_every": every}
    return entry | {"stores": "inputs", "lookback": value.lookback} if value.inputs else entry


def _hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()


def _describe(positions: Any) -> Any:
    if positions is None or isinstance(positions, int):
        return positions
    if callable(positions):
        return f"callable {getattr(positions, '__module__', '?')}.{getattr(positions, '__qualname__', type(positions).__name__)}"
    return [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]


