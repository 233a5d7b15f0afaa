"""Offline fixtures: a tiny tokenizer, tiny saved checkpoints per family, and trained toys.

Mental model: everything a test needs to load a model "like a user would"
(``AutoModelForCausalLM.from_pretrained(path)``) is fabricated locally and
deterministically, then cached on disk, so the test suite never needs the
network and builds each checkpoint once.

    >>> from nnterp.testing import tiny_checkpoint
    >>> path = tiny_checkpoint("qwen3_5_text")          # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP

The tiny checkpoints are random weights (the mechanics); the toys
(`toy_checkpoint`, `toy_task`, :mod:`nnterp.testing.toys`) are shipped models
trained on tasks with a known mechanism (what a method should find).
"""

from nnterp.testing.checkpoints import BUILD_VERSION, MODEL_TYPES, default_cache_dir, tiny_checkpoint, tiny_config
from nnterp.testing.tokenizer import tiny_tokenizer
from nnterp.testing.toys import toy_checkpoint, toy_manifest, toy_names, toy_task

__all__ = [
    "BUILD_VERSION",
    "MODEL_TYPES",
    "default_cache_dir",
    "tiny_checkpoint",
    "tiny_config",
    "tiny_tokenizer",
    "toy_checkpoint",
    "toy_manifest",
    "toy_names",
    "toy_task",
]
