"""The store `nnterp.collect` writes and `StateStore` reads: values of many prompts on disk, resumable.

Layout. A store is a folder: ``manifest.json`` says what it holds (the
model, its revision, nnterp's version, the values with their shapes and
dtypes, the factorized values' arguments, whether the run ended);
``shard-00000.safetensors``, ... hold one batch of prompts each (tensor
``"{i}/{name}"`` is value ``name`` of prompt ``i``, ``"{i}/input_ids"`` its
token ids); ``prompts.jsonl`` lists the shards written, a line each with its
prompts' lengths, positions and hashes. The index is appended to, so a store
of a million prompts is not rewritten at every batch.

Writing (`StoreWriter`). A shard is written aside and renamed into place,
then its line is appended to the index and synced (`StoreWriter.list_shard`,
the commit point): a run killed at any moment leaves a store that lists only
whole shards (a line cut short is dropped when the store is opened again). A
shard written but not listed is written again by the run that resumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .core import indices
from .core.errors import InvalidArgument
from .fast import SPECS
from .recurrent import replay

MANIFEST = "manifest.json"
#: The shards written, one JSON line each: ``{"shard": name, "prompts": [{"length", "positions", "sha256"}, ...]}``.
INDEX = "prompts.jsonl"
#: The layout versions this nnterp reads: 1, every value stored as read (a factorized one as its kernel's arguments);
#: 2, a factorized value kept as its mixer's inputs (``factorized="inputs"``, whose entry in the manifest says so). A
#: store is written at the lowest version that holds it, so an older nnterp still opens what it can read; a store of
#: a version not listed is refused.
FORMATS = (1, 2)


class StoreWriter:
    """A store being written: opened on ``header`` (resumed where a store made with the same header is there),
    ``listed`` the prompts already in it, ``add`` one batch's shard, ``finish`` at the end."""

    def __init__(self, path: str | os.PathLike, header: dict, resume: bool) -> None:
        self.folder = Path(path)
        target = self.folder / MANIFEST
        if resume and target.is_file():
            manifest = json.loads(target.read_text())
            differs = [key for key in header if key != "nnterp" and manifest.get(key) != header[key]]
            if differs:
                raise InvalidArgument(
                    f"`collect`: the store at {self.folder} was made with other {', '.join(differs)} "
                    f"({', '.join(f'{k}={manifest.get(k)!r}' for k in differs)}): pass resume=False to start it over, or another path"
                )
            self.manifest = manifest | {"complete": False}
            self.listed, good = listed(self.folder)
            index = self.folder / INDEX
            if index.is_file() and index.stat().st_size > good:  # a line a killed run cut short
                with open(index, "r+b") as handle:
                    handle.truncate(good)
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            for old in [*self.folder.glob("shard-*.safetensors"), self.folder / INDEX, target]:
                old.unlink(missing_ok=True)  # only the files a store is made of
            self.manifest, self.listed = header | {"complete": False, "shapes": {}, "arguments": {}}, []
            return  # a new store's manifest is written with its first batch: a run failing before leaves none
        self.write_manifest()

    def describe(self, shapes: dict, arguments: dict) -> None:
        """What every prompt's values look like (from the first batch), into the manifest."""
        if not self.manifest["shapes"]:
            self.manifest["shapes"], self.manifest["arguments"] = shapes, arguments
            self.write_manifest()

    def add(self, shard: int, tensors: dict, records: list) -> None:
        """Write batch ``shard``'s tensors, then list it with its prompts' ``records``."""
        name = f"shard-{shard:05d}.safetensors"
        _replace(self.folder / name, lambda target: save_file(tensors, str(target)))
        self.list_shard(name, records)

    def list_shard(self, name: str, records: list) -> None:
        """The commit point: the written shard ``name``'s line appended to the index and synced."""
        with open(self.folder / INDEX, "a") as handle:
            handle.write(json.dumps({"shard": name, "prompts": records}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.listed.extend(record | {"shard": name} for record in records)

    def finish(self, model: Any = None) -> StateStore:
        self.manifest["complete"] = True
        self.write_manifest()
        return StateStore(self.folder, model)

    def write_manifest(self) -> None:
        _replace(self.folder / MANIFEST, lambda target: target.write_text(json.dumps(self.manifest, indent=1)))


class StateStore:
    """A store `collect` wrote: ``len(store)`` prompts, ``store.value(i, name)`` the value of prompt ``i``.

    ``value(i, name)`` is ``[positions, ...]`` for a value with a token axis (the prompt's selected positions,
    ``store.positions(i)``, in the order selected) and the value's own shape without the batch axis otherwise;
    ``stack(name)`` stacks one value over every prompt (equal shapes: one position per prompt, or whole values).
    Tensors are read lazily, one at a time, from their shard.

    ``model``: the model the store was collected from (its name as the manifest keeps it), needed only to read a
    factorized value kept as its mixer's inputs (``factorized="inputs"``): its layer's mixer recomputes the
    kernel's arguments from them (`nnterp.recurrent.replay.FromInputs`).
    """

    def __init__(self, path: str | os.PathLike, model: Any = None) -> None:
        self.path = Path(path)
        target = self.path / MANIFEST
        if not target.is_file():
            raise FileNotFoundError(f"no store at {self.path}: {MANIFEST} is missing (nnterp.collect writes one)")
        self.manifest = json.loads(target.read_text())
        if self.manifest.get("format") not in FORMATS:
            raise InvalidArgument(
                f"the store at {self.path} has format {self.manifest.get('format')!r}; this nnterp reads formats {list(FORMATS)}: "
                "open it with the nnterp version that wrote it (the manifest's 'nnterp')"
            )
        if model is not None and model_name(model) != self.manifest.get("model"):
            raise InvalidArgument(f"the store at {self.path} was collected from {self.manifest.get('model')!r}, not {model_name(model)!r}: pass that model")
        self.model = model
        self.manifest["prompts"] = listed(self.path)[0]
        # Each factorized value's fast spec, found once by the name the manifest keeps.
        self.specs = {name: SPECS[entry["spec"]] for name, entry in self.manifest.get("factorized", {}).items()}

    def __len__(self) -> int:
        return len(self.manifest["prompts"])

    @property
    def values(self) -> list[str]:
        """The names of the values stored, in the order they were read."""
        return list(self.manifest["values"])

    @property
    def complete(self) -> bool:
        """Whether `collect` ran to the end of its prompts (else: interrupted; call it again to resume)."""
        return bool(self.manifest.get("complete"))

    def positions(self, i: int) -> list[int]:
        """The positions of prompt ``i`` its token-axis values hold (from 0, the prompt's own)."""
        return list(self._record(i)["positions"])

    def ids(self, i: int) -> torch.Tensor:
        """Prompt ``i``'s token ids, ``[length]``."""
        return self._read(i, "input_ids")

    def value(self, i: int, name: str) -> torch.Tensor:
        """Value ``name`` of prompt ``i`` (module docstring: its shape; a factorized ``states``: every token's, replayed)."""
        if name not in self.manifest["values"]:
            raise InvalidArgument(f"the store at {self.path} holds no {name!r}: it holds {self.manifest['values']}")
        if name in self.manifest.get("factorized", {}):
            return self._replayed(i, name, list(range(self._record(i)["length"])))
        return self._read(i, name)

    def state(self, i: int, layer: int, t: int) -> torch.Tensor:
        """The state after token ``t`` of prompt ``i`` in ``layer``'s mixer, ``[...state]``, replayed from the
        nearest checkpoint (a store made with ``factorized=True``)."""
        return self.states(i, layer, [t])[0]

    def states(self, i: int, layer: int, positions: Any) -> torch.Tensor:
        """The states after ``positions`` (ints, negative from the end) of prompt ``i`` in ``layer``'s mixer,
        ``[len(positions), ...state]`` in the format the kind's spec writes (float32): each stretch between checkpoints
        replayed once, from the checkpoint before it, reading only its tokens from the shard."""
        name = f"layers.{layer}.linear_attn.states"
        if name not in self.manifest.get("factorized", {}):
            held = list(self.manifest.get("factorized", {})) or "none"
            raise InvalidArgument(f"the store at {self.path} holds no factorized {name!r} (factorized: {held}); collect it with factorized=True")
        length = self._record(i)["length"]
        chosen = indices.selection(positions, length, "StateStore.states", place=f"prompt {i}'s {length} tokens")
        return self._replayed(i, name, list(range(length)) if chosen is None else chosen)

    def _replayed(self, i: int, name: str, positions: list[int]) -> torch.Tensor:
        entry = self.manifest["factorized"][name] | self.manifest["arguments"][name]
        record = self._record(i)
        mixer = None
        if entry.get("stores") == "inputs":
            if self.model is None:
                raise InvalidArgument(
                    f"the store at {self.path} keeps {name!r} as its mixer's inputs, replayed through the model's weights: "
                    "open it with StateStore(path, model=model)"
                )
            if not getattr(self.model, "dispatched", True):
                self.model.dispatch()  # a mixer traced alone runs on the loaded weights
            mixer = self.model
            for part in name.split(".")[:-1]:
                mixer = mixer[int(part)] if part.isdigit() else getattr(mixer, part)
        with safe_open(str(self.path / record["shard"]), framework="pt") as shard:
            found = replay.loaded(self.specs[name], shard, f"{record['index']}/{name}", entry, record["length"], mixer)
            return found.states(positions)

    def stack(self, name: str) -> torch.Tensor:
        """``value(i, name)`` of every prompt, stacked: ``[len(store), ...]`` (refused where the shapes differ)."""
        found = [self.value(i, name) for i in range(len(self))]
        shapes = {tuple(x.shape) for x in found}
        if len(shapes) > 1:
            raise InvalidArgument(f"`stack({name!r})`: the prompts' values have shapes {sorted(shapes)}; collect one position per prompt (positions=-1) to stack them")
        return torch.stack(found)

    def _record(self, i: int) -> dict:
        found = indices.index(i, len(self), "StateStore", "prompt", f"the store's {len(self)} prompts")
        return self.manifest["prompts"][found] | {"index": found}

    def _read(self, i: int, name: str) -> torch.Tensor:
        record = self._record(i)
        with safe_open(str(self.path / record["shard"]), framework="pt") as shard:
            return shard.get_tensor(f"{record['index']}/{name}")

    def __repr__(self) -> str:
        state = "complete" if self.complete else "interrupted"
        return f"StateStore({str(self.path)!r}: {len(self)} prompts, {len(self.values)} values, {state})"


def model_name(model: Any) -> str:
    """The name a store keeps of ``model``: its checkpoint's path or hub id."""
    return str(getattr(model._module.config, "_name_or_path", "") or getattr(model, "repo_id", ""))


def listed(folder: Path) -> tuple[list[dict], int]:
    """Every prompt the store's index lists, in order, each with its shard, and the bytes of the index that hold
    whole lines (a last line cut short, by a run killed while appending, is not read)."""
    index = folder / INDEX
    found: list = []
    good = 0
    if not index.is_file():
        return found, good
    for line in index.read_bytes().splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        entry = json.loads(line)
        found.extend(record | {"shard": entry["shard"]} for record in entry["prompts"])
        good += len(line)
    return found, good


def _replace(target: Path, write: Callable[[Path], Any]) -> None:
    """Write ``target`` aside, then rename it into place: a reader (or a resumed run) never sees it half written."""
    partial = target.with_name(target.name + ".partial")
    write(partial)
    os.replace(partial, target)
