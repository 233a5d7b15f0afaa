"""The trained toys: what ships matches what the script made, they learned their task, and findings that must hold.

Oracles, independent of nnterp's reading code: each task's own ground truth (the
answer a sample was built with), the file bytes (sha256), the training script
itself (a rerun's first losses), and a plain transformers forward (the donor
prompt's logits, which a full memory swap must reproduce).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import StandardizedTransformer
from nnterp.sweep import per_token_states
from nnterp.testing import recall, toy_checkpoint, toy_manifest, toy_names, toy_task
from nnterp.testing.toys import TOYS_DIR

ROOT = Path(__file__).resolve().parents[1]
N = 200  # fresh samples per rate
FRESH = 31_337  # neither the training's nor the eval's seed


def _script():
    spec = importlib.util.spec_from_file_location("train_toys", ROOT / "scripts" / "train_toys.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_toys", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models():
    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = StandardizedTransformer(str(toy_checkpoint(name)), dispatch=True, device="cpu")
        return cache[name]

    return load


def _recall_toys():
    return [name for name in toy_names() if toy_manifest(name)["task"] == "associative_recall"]


def test_the_core_toys_ship():
    assert {"deltanet", "hybrid"} <= set(toy_names())


def test_an_unknown_toy_names_the_known_ones():
    with pytest.raises(nnterp.InvalidArgument) as caught:
        toy_checkpoint("gpt5")
    assert isinstance(caught.value, ValueError)
    assert "'gpt5'" in str(caught.value) and all(name in str(caught.value) for name in toy_names())
    with pytest.raises(ValueError):
        toy_task("gpt5")


@pytest.mark.parametrize("name", toy_names())
def test_the_manifest_matches_the_files(name):
    folder = toy_checkpoint(name)
    manifest = json.loads((folder / "manifest.json").read_text())
    for filename, digest in manifest["sha256"].items():
        assert hashlib.sha256((folder / filename).read_bytes()).hexdigest() == digest, filename
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == manifest["model_type"] == manifest["config"]["model_type"]
    assert manifest["eval"]["accuracy"] >= 0.95 and manifest["steps"] <= manifest["max_steps"]
    assert manifest["train_seconds"] <= 15 * 60 and manifest["threads"] <= 2


def test_the_package_data_is_small_and_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    total = sum(path.stat().st_size for path in TOYS_DIR.rglob("*") if path.is_file())
    assert total <= 10 * 2**20
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nnterp"]
    shipped = {path.relative_to(ROOT / "nnterp") for path in TOYS_DIR.rglob("*") if path.is_file()}
    for path in shipped:  # every shipped file matches a declared pattern, so `pip install` carries it
        assert any(path.match(pattern) for pattern in declared), path


@pytest.mark.parametrize("name", toy_names())
def test_accuracy_on_fresh_samples_through_the_library(models, name):
    model = models(name)
    samples = list(toy_task(name).samples(N, seed=FRESH))
    got = recall.answers(model, samples)
    want = torch.tensor(model.tokenizer.convert_tokens_to_ids([s.answer for s in samples]))  # the task's ground truth
    assert float((got == want).float().mean()) >= 0.95


@pytest.mark.parametrize("name", toy_names())
def test_retraining_reproduces_the_first_losses(name):
    script = _script()
    _, losses, _ = script.train(name, steps=3, quiet=True)
    assert losses == pytest.approx(toy_manifest(name)["first_losses"][:3], rel=1e-4)


def test_a_sample_names_its_positions():
    task = toy_task("deltanet")
    for sample in task.samples(20, seed=3):
        words = sample.words
        assert len(words) == 2 * len(sample.pairs) + 1 and words[-1] == sample.pairs[sample.queried][0]
        for (key, value), k, v in zip(sample.pairs, sample.key_positions, sample.value_positions):
            assert (words[k], words[v]) == (key, value)
        assert sample.answer == sample.pairs[sample.queried][1]


# -- findings that must hold ----------------------------------------------------------


def _donors(task, samples):
    rng = random.Random(FRESH + 1)
    return [task.donor(rng, s) for s in samples]


@pytest.mark.parametrize("name", [n for n in _recall_toys() if n != "hybrid"])
def test_swapping_the_whole_recurrent_memory_answers_the_donors_value(models, name):
    model = models(name)
    task = toy_task(name)
    samples = list(task.samples(N, seed=FRESH))
    donors = _donors(task, samples)
    donor_values = torch.tensor(model.tokenizer.convert_tokens_to_ids([d.answer for d in donors]))
    rates = {}
    for label, state, window in (("both", True, True), ("state", True, False), ("window", False, True)):
        got = recall.swap_memory(model, samples, donors, state=state, window=window)
        rates[label] = float((got == donor_values).float().mean())
    print(name, rates)
    assert rates["both"] >= 0.90
    assert rates["both"] >= max(rates["state"], rates["window"])


@pytest.mark.parametrize("name", [n for n in _recall_toys() if n != "hybrid"])
def test_the_full_swap_is_the_donor_prompt_by_a_plain_forward(models, name):
    """Everything the query sees is the donor's, so its logits are a plain transformers forward of the donor prompt."""
    model = models(name)
    plain = AutoModelForCausalLM.from_pretrained(toy_checkpoint(name)).eval()
    task = toy_task(name)
    samples = list(task.samples(8, seed=FRESH, n_pairs=9))
    donors = _donors(task, samples)
    ids = model.tokenizer([s.prompt for s in samples], return_tensors="pt").input_ids
    donor_ids = model.tokenizer([d.prompt for d in donors], return_tensors="pt").input_ids
    T = ids.shape[1] - 2
    logits = recall._swap_in_prompt(model, ids, donor_ids, T, True, True)
    with torch.no_grad():
        expected = plain(input_ids=donor_ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_on_the_hybrid_toy_the_recurrent_state_carries_the_recall(models):
    """The finding on this hybrid (stated in docs/recipes/what-a-recurrent-state-stores.md): its DeltaNet layer
    recalls, the attention layer after it does not (Michalak & Abreu, arXiv 2510.19861, found the opposite in
    larger trained hybrids)."""
    model = models("hybrid")
    task = toy_task("hybrid")
    samples = list(task.samples(N, seed=FRESH))
    donors = _donors(task, samples)
    clean = torch.tensor(model.tokenizer.convert_tokens_to_ids([s.answer for s in samples]))
    donor_values = torch.tensor(model.tokenizer.convert_tokens_to_ids([d.answer for d in donors]))
    attention = next(i for i, layer in enumerate(model.layers) if layer.self_attn is not None)
    swapped = recall.swap_memory(model, samples, donors)
    zeroed = recall.knock_out_attention(model, samples, attention)
    moved = recall.knock_out_attention(model, samples, attention, donors)
    rates = {
        "swap answers the donor": float((swapped == donor_values).float().mean()),
        "attention zeroed still right": float((zeroed == clean).float().mean()),
        "donor's attention output answers the donor": float((moved == donor_values).float().mean()),
    }
    print(rates)
    assert rates["swap answers the donor"] >= 0.90  # the state and window carry the recall
    assert rates["attention zeroed still right"] >= 0.90  # the attention layer is not needed at the query
    assert rates["donor's attention output answers the donor"] <= 0.5
    # The knockout does write: the query's logits move, the argmax does not.
    prompt = samples[0].prompt
    logits = []
    for zero in (False, True):
        with torch.no_grad(), model.trace(prompt, use_cache=False):
            if zero:
                model.layers[attention].self_attn.attention_output[:, -1] = 0.0
            logits.append(model.logits[0, -1].save())
    assert float((logits[0] - logits[1]).abs().max()) > 1e-2


def test_the_all_linear_deltanet_toy_runs_without_a_cache(models):
    """transformers (5.23, 5.24) cannot run a Qwen3.5 text model whose every layer is linear attention with a cache
    (`get_seq_length` raises); a trace with ``use_cache=False`` is what works, and serves the states."""
    model = models("deltanet")
    sample = next(toy_task("deltanet").samples(1, seed=FRESH))
    plain = AutoModelForCausalLM.from_pretrained(toy_checkpoint("deltanet")).eval()
    ids = model.tokenizer(sample.prompt, return_tensors="pt").input_ids
    try:
        with torch.no_grad():
            plain(input_ids=ids, use_cache=True)
    except ValueError as error:
        assert "can only be called on Attention layers" in str(error)
    states = []
    with per_token_states(model), torch.no_grad(), model.trace(sample.prompt, use_cache=False):
        states.append(model.layers[0].linear_attn.states.save())
        top = model.logits[0, -1].argmax().save()
    assert model.tokenizer.decode(int(top)) == sample.answer
    assert states[0].shape[1] == len(sample.words)


#: ``toy: (layer, offset from the queried key)`` where the knockout sweep's top cell sits in >= 95% of samples
#: (the short convolution lets layer 0 or 1 write the binding two tokens after the key: at the next pair's key);
#: ``None``: no one place (Mamba-2 spreads it: docs/recipes/knockout-on-a-hybrid.md gives the counts).
KNOCKOUT_CELL = {"deltanet": (1, 2), "hybrid": (0, 2), "mamba2": None}


@pytest.mark.parametrize("name", sorted(KNOCKOUT_CELL))
def test_the_knockout_sweeps_top_cell_is_where_the_binding_is_written(name):
    model = StandardizedTransformer(str(toy_checkpoint(name)), dispatch=True, device="cpu", enable_attention_probs=name == "hybrid")
    task = toy_task(name)
    rng = random.Random(FRESH)
    drops, places = [], []
    for _ in range(N):
        sample = task.sample(rng)
        answer = model.tokenizer(sample.answer, add_special_tokens=False).input_ids[0]
        result = nnterp.knockout_sweep(
            model, sample.prompt, lambda logits, a=answer: logits[-1].softmax(-1)[a], progress=False, use_cache=False
        )
        (layer, source, effect), = result.top(1)
        drops.append(-effect / result.clean)
        places.append((layer, source - sample.key_positions[sample.queried]))
    assert sum(drops) / N >= 0.5, f"knocking out the top cell drops p(answer) by {sum(drops) / N:.0%} on average"
    if KNOCKOUT_CELL[name] is not None:
        assert places.count(KNOCKOUT_CELL[name]) >= 0.95 * N, places
