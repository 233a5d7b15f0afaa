"""Trained toy checkpoints, shipped inside the package: models that learned something.

Mental model: the tiny checkpoints (`nnterp.testing.tiny_checkpoint`) are
random weights, right for testing mechanics and wrong for testing whether a
method finds a mechanism. The toys are tiny models of transformers' own
classes trained by ``scripts/train_toys.py`` (the script is their source of
truth, these folders its output) on the tasks of `nnterp.testing.tasks`,
where the right answer is known:

====================  ==========================================  ==================
name                  model                                       task
====================  ==========================================  ==================
``deltanet``          Qwen3.5 text, 2 gated DeltaNet layers        associative recall
``hybrid``            Qwen3.5 text, gated DeltaNet + attention     associative recall
``mamba2``            Mamba-2, 2 layers                            associative recall
``mamba``             Mamba-1, 2 layers                            associative recall
``facts``             Qwen3.5 text, 2 gated DeltaNet layers        planted facts
====================  ==========================================  ==================

Each folder holds ``config.json``, ``model.safetensors``, the word-level
tokenizer and ``manifest.json`` (the training's config, seed, steps,
held-out accuracy, first losses and the weights' sha256). A toy not trained
yet in this checkout is not listed by `toy_names`.

    >>> from nnterp.testing import toy_checkpoint, toy_task
    >>> model = StandardizedTransformer(toy_checkpoint("deltanet"), dispatch=True)  # doctest: +SKIP
    >>> sample = next(toy_task("deltanet").samples(1, seed=0))                     # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

from nnterp.core.errors import InvalidArgument
from nnterp.testing.tasks import TASKS, AssociativeRecall, PlantedFacts

__all__ = ["TOYS_DIR", "toy_checkpoint", "toy_manifest", "toy_names", "toy_task"]

TOYS_DIR = Path(__file__).resolve().parent / "toys"


def toy_names() -> list[str]:
    """The toys shipped in this installation (each a folder with a manifest), sorted."""
    if not TOYS_DIR.is_dir():
        return []
    return sorted(p.name for p in TOYS_DIR.iterdir() if (p / "manifest.json").is_file())


def toy_checkpoint(name: str) -> Path:
    """The local folder of the trained toy ``name``, loadable as any checkpoint (``StandardizedTransformer(path)``).

    Raises `InvalidArgument` (a ``ValueError``) naming the known toys for any other name.
    """
    known = toy_names()
    if name not in known:
        raise InvalidArgument(f"unknown toy {name!r}: the shipped toys are {', '.join(known) or '(none)'}")
    return TOYS_DIR / name


def toy_manifest(name: str) -> dict:
    """The toy's ``manifest.json``: how ``scripts/train_toys.py`` made it and what it reached."""
    return json.loads((toy_checkpoint(name) / "manifest.json").read_text())


def toy_task(name: str) -> AssociativeRecall | PlantedFacts:
    """The task the toy ``name`` was trained on; ``.samples(n, seed)`` yields `Sample`s (prompt, answer, positions)."""
    return TASKS[toy_manifest(name)["task"]]()
