"""nnterp 1.3.0's README and documentation code blocks, run as written on tiny gpt2 and llama checkpoints.

``docs_1x/`` holds the 1.3.0 release's README and its ``docs/*.rst`` pages
that carry Python blocks (tag ``v1.3.0`` of ``ndif-team/nnterp``), as
written. Each block runs with one change: every quoted hub model id becomes
a tiny checkpoint of the family (``"gpt2"``, ``"meta-llama/Llama-2-7b-hf"``, ...
-> the same path), on gpt2 and on llama in turn. The checkpoint has the
real model's layer count (the blocks index layers up to 10: gpt2's 12, Llama
2's 32) and the tiny checkpoints' widths (64). A page's blocks run in
order in one namespace, as a reader runs them (the first block loads
``model``, later ones use it); each block is one test. Blocks that cannot run
here by what they are (NDIF's servers, vLLM, a GPU, a placeholder id) are
listed in `NOT_RUNNABLE` with the reason and deselected; the rest must pass,
and `KNOWN_FAILURES` marks, strict ``xfail``, those that fail with the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import torch
from transformers import AutoModelForCausalLM

from nnterp.testing import tiny_config, tiny_tokenizer

HERE = Path(__file__).parent / "docs_1x"
FAMILIES = ("gpt2", "llama")
#: The hub models' layer counts: gpt2 (the docs' model) and Llama-2-7b.
LAYERS = {"gpt2": 12, "llama": 32}
_RST = re.compile(r"^\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", re.M)
_MD = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
#: A quoted hub id as a load call takes it: "gpt2", "owner/name".
_MODEL_ID = re.compile(r"""(?P<q>["'])(?P<id>gpt2|[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)(?P=q)""")


def blocks(name: str) -> list[str]:
    text = (HERE / name).read_text()
    if name.endswith(".md"):
        return [block for block in _MD.findall(text)]
    return [re.sub(r"^   ", "", block, flags=re.M).strip("\n") + "\n" for block in _RST.findall(text)]


PAGES = sorted(path.name for path in HERE.iterdir())
CASES = [(page, index) for page in PAGES for index in range(len(blocks(page)))]

#: (page, block index) -> why it cannot run in this test, whatever nnterp does.
NOT_RUNNABLE: dict[tuple[str, int], str] = {}
#: (page, block index, family or None) -> why it fails today.
KNOWN_FAILURES: dict[tuple[str, int, str | None], str] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``family -> path`` of a tiny checkpoint with the hub model's layer count, built once per run."""
    built: dict = {}

    def get(family: str) -> str:
        if family not in built:
            config = tiny_config(family)
            config.num_hidden_layers = LAYERS[family]  # gpt2's attribute_map points n_layer here
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"{family}_docs")
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
            tiny_tokenizer().save_pretrained(path)
            built[family] = str(path)
        return built[family]

    return get


def swapped(code: str, path: str) -> str:
    """The block with every quoted hub model id replaced by the checkpoint at ``path``."""
    return _MODEL_ID.sub(lambda m: repr(path) if not m.group("id").startswith(("http", "www")) else m.group(0), code)


@pytest.fixture(scope="module")
def namespaces():
    """One namespace per (family, page): a page's blocks share it, in order."""
    return {}


def _params():
    for family in FAMILIES:
        for page, index in CASES:
            marks = []
            if (page, index) in NOT_RUNNABLE:
                marks.append(pytest.mark.skip(reason=NOT_RUNNABLE[(page, index)]))
            reason = KNOWN_FAILURES.get((page, index, family)) or KNOWN_FAILURES.get((page, index, None))
            if reason is not None:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            yield pytest.param(family, page, index, id=f"{family}-{page}-{index}", marks=marks)


@pytest.mark.parametrize(("family", "page", "index"), list(_params()))
def test_1x_doc_block_runs(family, page, index, namespaces, checkpoints, tmp_path_factory):
    namespace = namespaces.setdefault((family, page), {"__name__": f"docs_1x_{page}"})
    code = swapped(blocks(page)[index], checkpoints(family))
    # nnsight reads a trace's `with` block from its file, so each block runs from one.
    path = tmp_path_factory.mktemp("docs_1x") / f"{family}_{page.replace('.', '_')}_{index}.py"
    path.write_text(code)
    exec(compile(code, str(path), "exec"), namespace)
