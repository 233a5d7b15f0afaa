"""The ported suite's model lists: 1.x's hub probing (toy collection, loading status) replaced by local families.

``test_config.yaml`` names the families; `checkpoint_path` is the tiny
checkpoint a 1.x test receives as its ``model_name`` (a folder saved with
``save_pretrained``, loaded as a user loads a hub id). 1.x's toy models were
instruction-tuned checkpoints with a chat template, which ``it_repeat_prompt``
needs: the 1.x suite's copy of each tiny checkpoint carries `CHAT_TEMPLATE`;
the tiny checkpoints every other test uses stay without one.
"""

import hashlib
import shutil
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from nnterp.families import absent
from nnterp.testing import tiny_checkpoint
from nnterp.testing.tokenizer import publish_dir

#: ChatML, as Qwen's instruction-tuned checkpoints write it (system, user and assistant turns).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

with open(Path(__file__).parent / "test_config.yaml") as f:
    _TEST_CONFIG = yaml.safe_load(f)

TEST_MODELS = _TEST_CONFIG["core_test_models"]
LLAMA_LIKE_MODELS = _TEST_CONFIG["llama_like_models"]


def checkpoint_path(family: str) -> str:
    """The tiny checkpoint of ``family`` with `CHAT_TEMPLATE`, as the string a 1.x test takes for a model name."""
    base = tiny_checkpoint(family)
    final = base.with_name(f"{base.name}-chat-{hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:12]}")
    if not final.is_dir():

        def write(tmp: Path) -> None:
            shutil.copytree(base, tmp, dirs_exist_ok=True)
            tokenizer = AutoTokenizer.from_pretrained(base)
            tokenizer.chat_template = CHAT_TEMPLATE
            tokenizer.save_pretrained(tmp)

        publish_dir(final, write)
    return str(final)


def unavailable(family: str) -> str | None:
    """Why the installed transformers lacks ``family`` (reported as a skip), or ``None``."""
    return absent(family)
