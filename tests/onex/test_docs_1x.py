"""nnterp 1.3.0's README code blocks, run as written on tiny gpt2 and llama checkpoints.

``docs_1x/README.md`` is the README of the 1.3.0 sdist on PyPI, unchanged.
Each of its Python blocks runs with one change: every quoted hub model id
becomes a tiny checkpoint of the family (``"gpt2"`` -> the checkpoint's path),
on gpt2 and on llama in turn. The checkpoint has the hub model's layer count
(the blocks index layers up to 10: gpt2's 12, Llama 2's 32) and the tiny
checkpoints' widths (64). The blocks run in order in one namespace, as a
reader runs them (the first block loads ``model``, later ones use it); each
block is one test.

A block that cannot run whatever nnterp does is in `NOT_RUNNABLE` with the
reason and the error it raises; its test asserts it raises exactly that, so
the table cannot go stale. It runs in the shared namespace like the others:
what Python bound before the error stays bound, as in a reader's session.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import torch
from transformers import AutoModelForCausalLM

from nnterp.testing import tiny_config, tiny_tokenizer

README = Path(__file__).parent / "docs_1x" / "README.md"
FAMILIES = ("gpt2", "llama")
#: The hub models' layer counts: gpt2 (the README's model) and Llama-2-7b.
LAYERS = {"gpt2": 12, "llama": 32}
_MD = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
#: A quoted hub id as a load call takes it: "gpt2", "owner/name".
_MODEL_ID = re.compile(r"""(?P<q>["'])(?P<id>gpt2|[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)(?P=q)""")

BLOCKS = _MD.findall(README.read_text())

#: block index -> (the exception it raises, a regex its message matches, why).
NOT_RUNNABLE: dict[int, tuple[type[BaseException], str, str]] = {
    2: (
        ImportError,
        r"^cannot import name 'steer' from 'nnterp\.interventions'",
        "1.3.0's own README bug: 1.3.0's nnterp/interventions.py has no `steer` (steering is the method "
        "`model.steer`), so the block fails at its first line under 1.3.0 as well. Python binds `logit_lens` "
        "and `patchscope_lens` before it fails on `steer`, so the next block finds `logit_lens`.",
    ),
}


def test_readme_blocks_found():
    # The README as shipped has four Python blocks; a changed file or regex shows here, not as fewer tests.
    assert len(BLOCKS) == 4


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
    return _MODEL_ID.sub(lambda m: repr(path), code)


def run_block(family: str, index: int, namespace: dict, path: str, folder: Path) -> None:
    """Block ``index`` run in ``namespace``; a `NOT_RUNNABLE` block must raise its error."""
    code = swapped(BLOCKS[index], path)
    # nnsight reads a trace's `with` block from its file, so each block runs from one.
    source = folder / f"{family}_readme_{index}.py"
    source.write_text(code)
    compiled = compile(code, str(source), "exec")
    if index not in NOT_RUNNABLE:
        exec(compiled, namespace)
        return
    error, message, _why = NOT_RUNNABLE[index]
    with pytest.raises(error, match=message):
        exec(compiled, namespace)


@pytest.fixture(scope="module")
def namespaces():
    """``family -> [namespace, blocks run]``: the README's blocks share one namespace per family, in order."""
    return {}


@pytest.mark.parametrize("index", range(len(BLOCKS)))
@pytest.mark.parametrize("family", FAMILIES)
def test_1x_readme_block_runs(family, index, namespaces, checkpoints, tmp_path_factory):
    state = namespaces.setdefault(family, [{"__name__": "docs_1x_readme"}, 0])
    folder = tmp_path_factory.mktemp("docs_1x")
    # A block selected alone (-k) still finds what the blocks before it bound.
    while state[1] < index:
        run_block(family, state[1], state[0], checkpoints(family), folder)
        state[1] += 1
    run_block(family, index, state[0], checkpoints(family), folder)
    state[1] = index + 1
