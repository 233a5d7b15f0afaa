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
from nnterp.attribution import state_attribution
from nnterp.sweep import per_token_states
from nnterp.testing import facts, recall, toy_checkpoint, toy_manifest, toy_names, toy_task
from nnterp.testing.tasks import TASKS
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


def test_the_mamba_training_kernel_gives_transformers_logits_and_gradients():
    """The script trains the Mamba-1 toy with its own binding of transformers' prompt kernel (the pure-torch body takes
    seconds a step on a CPU): the training forward's logits and gradients are transformers' own on the same weights,
    so the weights it writes mean the same to transformers; the binding is undone after, also on an error."""
    script = _script()
    modeling = script.mamba_modeling
    bound = modeling.mamba_selective_scan
    model = script.build("mamba").train()  # the weights training starts from, in training mode: the training's branch
    task = TASKS[script.TOYS["mamba"]["task"]]()
    ids, labels = script.batch(task, random.Random(FRESH), 4, 1500, 1500)  # the full range of pairs

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    want, want_grads = run()  # transformers' own forward
    with script.mamba_scan_for_training():
        assert modeling.mamba_selective_scan is script.selective_scan
        got, grads = run()
    assert modeling.mamba_selective_scan is bound
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    with pytest.raises(KeyboardInterrupt), script.mamba_scan_for_training():
        raise KeyboardInterrupt
    assert modeling.mamba_selective_scan is bound


def test_the_script_saves_no_toy_that_missed_its_target(tmp_path, monkeypatch, capsys):
    """A toy below 95% held-out accuracy, or trained past 15 minutes, is reported and not written where toys ship."""
    script = _script()
    model = script.build("deltanet")
    for acc, seconds, saved in ((0.5, 10.0, False), (0.99, 901.0, False), (0.99, 10.0, True)):
        monkeypatch.setattr(script, "train", lambda name, steps, s=seconds: (model, [5.0], s))
        monkeypatch.setattr(script, "accuracy", lambda model, task, a=acc: a)
        assert script.main(["deltanet", "--out", str(tmp_path / str(acc) / str(seconds))]) == (0 if saved else 1)
        assert (tmp_path / str(acc) / str(seconds) / "deltanet" / "manifest.json").is_file() == saved
        assert ("not saved" in capsys.readouterr().err) != saved


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


#: Where the knockout sweep's top cell sits, as ``toy: (accepts(layer, offset from the queried key, is the query), share)``:
#: the short convolution lets the writing layer write the binding at the next pair's key (key + 2); on Mamba-2 at
#: the value or the next key (key + 1, key + 2) of layer 1, or else layer 0's term of the query on itself (the
#: query's key, which the read needs); on Mamba-1 at the next pair's key in layer 0. Measured on these 200 samples:
#: 199, 198, 181 (57 + 36 + 88) and 200.
KNOCKOUT_CELL = {
    "mamba": (lambda layer, offset, query: (layer, offset) == (0, 2), 0.95),
    "deltanet": (lambda layer, offset, query: (layer, offset) == (1, 2), 0.95),
    "hybrid": (lambda layer, offset, query: (layer, offset) == (0, 2), 0.95),
    "mamba2": (lambda layer, offset, query: (layer == 1 and offset in (1, 2)) or (layer == 0 and query), 0.85),
}


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
        places.append((layer, source - sample.key_positions[sample.queried], source == len(sample.words) - 1))
    assert sum(drops) / N >= 0.5, f"knocking out the top cell drops p(answer) by {sum(drops) / N:.0%} on average"
    accepts, share = KNOCKOUT_CELL[name]
    assert sum(accepts(*place) for place in places) >= share * N, places


def test_the_facts_toy_reads_the_fact_in_its_last_mlp_at_the_relation_token(models):
    """Patching one value from a prompt with another subject (same filler, another attribute: `PlantedFacts.donor`)
    makes the model answer the donor's attribute only where that value carries what decides the fact: layer 1's MLP
    output at ``is`` does (the fact is read there), layer 0's MLP at ``is`` and every value at the subject's tokens
    do not (the subject reaches ``is`` through the mixers: layer 0's at ``is`` moves it in 68%)."""
    model = models("facts")
    task = toy_task("facts")
    samples = list(task.samples(N, seed=FRESH))
    rng = random.Random(FRESH + 1)
    donors = [task.donor(rng, s) for s in samples]
    assert all(d.answer != s.answer and len(d.words) == len(s.words) for s, d in zip(samples, donors))
    donor_attributes = recall.answer_ids(model, donors)  # the task's ground truth

    def moved(site, layer, position):
        return float((facts.patch_from_donor(model, samples, donors, site, layer, position) == donor_attributes).float().mean())

    rates = {("mlp_output", 1, -1): moved("mlp_output", 1, -1), ("mlp_output", 0, -1): moved("mlp_output", 0, -1)}
    rates.update({("layer_output", 0, p): moved("layer_output", 0, p) for p in (-3, -2)})
    print(rates)
    assert rates["mlp_output", 1, -1] >= 0.90  # 93.5% measured
    assert rates["mlp_output", 0, -1] <= 0.10  # 0.5%
    assert max(rates["layer_output", 0, p] for p in (-3, -2)) <= 0.10  # 6% and 4.5%


#: How many of the samples `state_attribution`'s finding checks against the patch itself (4 traces each).
ORACLE = 100
#: The layer that writes the binding (the knockout sweep's and the swap's finding): ``toy: layer``.
WRITING_LAYER = {"deltanet": 1, "hybrid": 0, "mamba2": 1, "mamba": 0}


def _patched_answer_prob(model, prompt, layer, position, state, answer):
    probs = []
    with torch.no_grad(), model.trace(prompt, use_cache=False):
        model.layers[layer].linear_attn.set_state_after(position, state)
        probs.append(model.next_token_probs[0, answer].save())
    return float(probs[0])


def _switches_on_within_a_token(model, sample, corrupt, layer, onset, answer):
    """Whether writing the corrupt run's state of ``layer`` after one token halves p(answer) first within a token of
    ``onset``: once on, it stays on (the binding is in every later state), so: on at ``onset + 1``, off at ``onset - 2``."""
    states, probs = [], []
    with per_token_states(model):
        with torch.no_grad(), model.trace(corrupt, use_cache=False):
            states.append(model.layers[layer].linear_attn.states.save())
        with torch.no_grad(), model.trace(sample.prompt, use_cache=False):
            probs.append(model.next_token_probs[0, answer].save())
        last = len(sample.words) - 2  # the state after the query itself is read by no later token
        halved = []
        for t in (min(onset + 1, last), onset - 2):
            patched = _patched_answer_prob(model, sample.prompt, layer, t, states[0][:, t], answer) if t >= 0 else float(probs[0])
            halved.append(patched <= 0.5 * float(probs[0]))
    return halved[0] and not halved[1]


@pytest.mark.parametrize("name", sorted(WRITING_LAYER))
def test_state_attribution_with_the_queried_value_corrupted_points_at_the_write(models, name):
    """`state_attribution` of the answer's logit over the corrupt value's, the queried pair's value corrupted: its top
    cell is in the writing layer; the write is where that layer's row of estimates reaches half its largest (a
    plateau from the write to the query follows: `recall.onset`), within the pair or the two tokens after it, and
    within a token of where the actual patch (``set_state_after``) switches on: where the corrupt state first takes
    p(answer) down by half or more (checked on the first `ORACLE` samples). The top cell itself sits anywhere on the
    plateau (measured, stated in the tutorial)."""
    model = models(name)
    writer = WRITING_LAYER[name]
    rng = random.Random(FRESH + 2)
    in_layer, near_onset, near_top, within_one = 0, 0, 0, 0
    for index, sample in enumerate(toy_task(name).samples(N, seed=FRESH)):
        corrupt, other = recall.corrupt_value(sample, rng)
        answer, wrong = model.tokenizer.convert_tokens_to_ids([sample.answer, other])
        result = state_attribution(model, sample.prompt, corrupt, lambda m, a=answer, w=wrong: m.logits[0, -1, a] - m.logits[0, -1, w])
        layer, position, _ = result.top(1)[0]
        key = sample.key_positions[sample.queried]
        in_layer += layer == writer
        near_top += 0 <= position - key <= 3
        start = result.positions[recall.onset(result.estimate[result.layers.index(writer)])]
        near_onset += 0 <= start - key <= 3
        if index < ORACLE:
            within_one += _switches_on_within_a_token(model, sample, corrupt, writer, start, answer)
    rates = {"in the writing layer": in_layer / N, "onset near the pair": near_onset / N, "top near the pair": near_top / N,
             f"the patch switches on within a token of the onset (of {ORACLE})": within_one / ORACLE}
    print(name, rates)
    assert in_layer >= 0.9 * N
    assert near_onset >= 0.6 * N
    assert within_one >= 0.85 * ORACLE  # 93%, 93%, 90% and 93% (mamba) measured
