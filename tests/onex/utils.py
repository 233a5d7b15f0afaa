"""The ported suite's model lists: 1.x's hub probing (toy collection, loading status) replaced by local families.

``test_config.yaml`` names the families; `checkpoint_path` is the tiny
checkpoint a 1.x test receives as its ``model_name`` (a folder saved with
``save_pretrained``, loaded as a user loads a hub id).
"""

from pathlib import Path

import yaml

from nnterp.families import absent
from nnterp.testing import tiny_checkpoint

with open(Path(__file__).parent / "test_config.yaml") as f:
    _TEST_CONFIG = yaml.safe_load(f)

TEST_MODELS = _TEST_CONFIG["core_test_models"]
LLAMA_LIKE_MODELS = _TEST_CONFIG["llama_like_models"]


def checkpoint_path(family: str) -> str:
    """The tiny checkpoint of ``family``, as the string a 1.x test takes for a model name."""
    return str(tiny_checkpoint(family))


def unavailable(family: str) -> str | None:
    """Why the installed transformers lacks ``family`` (reported as a skip), or ``None``."""
    return absent(family)
