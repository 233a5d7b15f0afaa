"""`nnterp.collect` and `nnterp.StateStore`: values over prompts into a store on disk, resumable after a kill.

Oracles: the same values read live in single traces of each prompt (bit for
bit where the store's batch is one prompt, within float32 rounding across a
left-padded batch); a store resumed after its process was killed equals an
uninterrupted one value for value, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import DynamicCache

import nnterp
from nnterp import InvalidArgument, PositionError, StateStore, Unavailable, WrongType
from nnterp.families import REGISTRY, absent
from nnterp.testing import tiny_checkpoint
from tests.reference.hf_oracles import cache_kwarg
from tests.suites.caches import ModuleState

PROMPTS = ["The cat sat on the mat", "Hello there", "A longer prompt about the Eiffel Tower in Paris", "x y z"]
FAMILIES = sorted(t for t in REGISTRY if absent(t) is None)


def _layer_values(model) -> list[str]:
    last = len(model.layers) - 1
    names = ["layers.0.layer_output", f"layers.{last}.layer_output", "logits"]
    mixer = next((i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None), None)
    if mixer is not None and model.support()["linear_attn.state_output"] is None:
        names.insert(0, f"layers.{mixer}.linear_attn.state_output")
    return names


def _live(model, prompt: str, name: str):
    """``name`` read in a trace of ``prompt`` alone, without its batch axis."""
    parts = name.split(".")
    with torch.no_grad(), model.trace(prompt, use_cache=True):
        owner = model
        for part in parts[:-1]:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        got = getattr(owner, parts[-1]).save()
    return got[0]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_store_of_one_prompt_batches_is_each_prompts_live_values_bit_for_bit(model_type, load, tmp_path):
    model = load(model_type)
    names = _layer_values(model)
    store = nnterp.collect(model, PROMPTS[:3], tmp_path / "store", names, positions=[-1, 0], batch_size=1, progress=False)
    assert len(store) == 3 and store.complete and store.values == names
    for i, prompt in enumerate(PROMPTS[:3]):
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids[0]
        assert torch.equal(store.ids(i), ids)
        assert store.positions(i) == [ids.numel() - 1, 0]
        for name in names:
            live = _live(model, prompt, name)
            expected = live if name.endswith("state_output") else live[[-1, 0]]
            assert torch.equal(store.value(i, name), expected), (model_type, i, name)


def _padded_kinds() -> list[str]:
    """A plain transformer, a gated DeltaNet hybrid and a Mamba-2 model (keyed by component, as the registry names them)."""
    from nnterp.families import families

    by_component = {family.MIXER.__name__: family.NAME for family in reversed(families()) if family.MIXER is not None}
    return [next(f.NAME for f in families() if f.MIXER is None), by_component["LinearAttention"], by_component["StateSpace"]]


@pytest.mark.parametrize("model_type", _padded_kinds())
def test_a_left_padded_batch_stores_each_prompts_own_positions(model_type, load, tmp_path):
    model = load(model_type)
    names = _layer_values(model)
    store = nnterp.collect(model, PROMPTS, tmp_path / "store", names, batch_size=3, progress=False)
    assert len(store) == len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        length = model.tokenizer(prompt, return_tensors="pt").input_ids.shape[1]
        assert store.positions(i) == list(range(length))
        for name in names:
            torch.testing.assert_close(store.value(i, name), _live(model, prompt, name), rtol=1e-5, atol=1e-5)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["model"] and manifest["nnterp"] == nnterp.__version__ and manifest["values"] == names
    index = [json.loads(line) for line in (tmp_path / "store" / "prompts.jsonl").read_text().splitlines()]
    assert [entry["shard"] for entry in index] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert [p["length"] for entry in index for p in entry["prompts"]] == [store.ids(i).numel() for i in range(len(PROMPTS))]
    assert manifest["shapes"]["layers.0.layer_output"] == {"shape": [model._module.config.hidden_size], "dtype": "float32", "token_axis": True}


def test_states_at_positions_chosen_by_a_callable_are_the_live_states(load, tmp_path):
    model = load("qwen3_5_text")
    mixer = next(i for i, layer in enumerate(model.layers) if layer.linear_attn is not None)

    def after_the_second_token(ids):
        return list(range(1, ids.numel()))

    name = f"layers.{mixer}.linear_attn.states"
    with nnterp.fast_states(model):
        store = nnterp.collect(model, PROMPTS[:2], tmp_path / "store", [name], positions=after_the_second_token, batch_size=1, progress=False)
        for i, prompt in enumerate(PROMPTS[:2]):
            live = _live(model, prompt, name)
            assert torch.equal(store.value(i, name), live[1:])
    assert store.manifest["positions"].startswith("callable ")


def test_values_listed_in_any_order_are_read_in_the_order_the_model_computes_them(load, tmp_path):
    model = load("qwen3_5_text")
    mixer = next(i for i, layer in enumerate(model.layers) if layer.linear_attn is not None)
    names = ["logits", f"layers.{mixer + 1}.layer_output", f"layers.{mixer + 1}.layer_input", f"layers.{mixer}.mlp.mlp_output",
             f"layers.{mixer}.linear_attn.state_output", f"layers.{mixer}.layer_input"]
    store = nnterp.collect(model, PROMPTS[:2], tmp_path / "store", names, positions=-1, batch_size=1, progress=False)
    assert store.values == [names[5], names[4], names[3], names[2], names[1], names[0]]
    for name in names:
        live = _live(model, PROMPTS[1], name)
        assert torch.equal(store.value(1, name), live if name.endswith("state_output") else live[[-1]]), name


def test_stack_gives_one_row_per_prompt_for_a_probe(load, tmp_path):
    model = load("mamba2")
    store = nnterp.collect(model, iter(PROMPTS), tmp_path / "store", ["layers.1.layer_output"], positions=-1, batch_size=2, progress=False)
    stacked = store.stack("layers.1.layer_output")
    assert stacked.shape == (len(PROMPTS), 1, model._module.config.hidden_size)
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(stacked[i, 0], _live(model, prompt, "layers.1.layer_output")[-1], rtol=1e-5, atol=1e-5)
    every = nnterp.collect(model, PROMPTS, tmp_path / "every", ["layers.1.layer_output"], batch_size=2, progress=False)
    with pytest.raises(InvalidArgument, match="positions=-1"):
        every.stack("layers.1.layer_output")


def test_bad_input_is_refused_with_the_fix(load, tmp_path):
    model = load("qwen3_5_text")
    with pytest.raises(InvalidArgument, match="support"):
        nnterp.collect(model, PROMPTS, tmp_path / "a", ["layers.0.linear_attn.no_such_value"], progress=False)
    with pytest.raises(InvalidArgument, match="support"):
        nnterp.collect(model, PROMPTS, tmp_path / "a", ["layers.99.layer_output"], progress=False)
    with pytest.raises(Unavailable, match="route_kernels"):  # its states need the per-token path
        nnterp.collect(model, PROMPTS, tmp_path / "a", ["layers.0.linear_attn.states"], progress=False)
    with pytest.raises(InvalidArgument, match="batch_size"):
        nnterp.collect(model, PROMPTS, tmp_path / "a", ["logits"], batch_size=0, progress=False)
    with pytest.raises(InvalidArgument, match="list of names"):
        nnterp.collect(model, PROMPTS, tmp_path / "a", "logits", progress=False)
    with pytest.raises(WrongType, match=r"pass \[prompt\]"):
        nnterp.collect(model, "one prompt", tmp_path / "a", ["logits"], progress=False)
    with pytest.raises(WrongType, match="strings"):
        nnterp.collect(model, [1, 2], tmp_path / "a", ["logits"], progress=False)
    with pytest.raises(PositionError, match="prompt 1"):
        nnterp.collect(model, ["a long enough prompt", "x"], tmp_path / "a", ["logits"], positions=[5], batch_size=1, progress=False)
    with pytest.raises(FileNotFoundError, match="manifest"):
        StateStore(tmp_path / "nothing")
    store = nnterp.collect(model, PROMPTS[:2], tmp_path / "b", ["logits"], positions=-1, progress=False)
    with pytest.raises(InvalidArgument, match="holds"):
        store.value(0, "layers.0.layer_output")
    with pytest.raises(PositionError):
        store.value(2, "logits")
    with pytest.raises(InvalidArgument, match="resume=False"):
        nnterp.collect(model, PROMPTS[:2], tmp_path / "b", ["layers.0.layer_output"], positions=-1, progress=False)
    with pytest.raises(InvalidArgument, match="resume=False"):
        nnterp.collect(model, ["other", "prompts"], tmp_path / "b", ["logits"], positions=-1, progress=False)
    again = nnterp.collect(model, ["other", "prompts"], tmp_path / "b", ["logits"], positions=-1, resume=False, progress=False)
    torch.testing.assert_close(again.value(0, "logits"), _live(model, "other", "logits")[[-1]], rtol=1e-5, atol=1e-5)


#: A run of `collect` in its own process, killed (SIGKILL, no cleanup) once batch ``kill_at`` is written but before the
#: index lists it (the worst moment: a shard on disk the store does not know), with half its line appended.
KILLED = textwrap.dedent("""
    import os, signal, sys
    import nnterp, nnterp.store as store
    from nnterp import StandardizedTransformer
    checkpoint, path, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    listing = store.StoreWriter.list_shard
    def dying(self, name, records):
        if name == f"shard-{kill_at:05d}.safetensors":
            with open(self.folder / store.INDEX, "a") as handle:
                handle.write('{"shard": "' + name + '", "prom')  # cut short
            os.kill(os.getpid(), signal.SIGKILL)
        listing(self, name, records)
    store.StoreWriter.list_shard = dying
    model = StandardizedTransformer(checkpoint)
    prompts = [f"prompt number {i} " + "word " * (i % 5) for i in range(11)]
    nnterp.collect(model, prompts, path, ["layers.0.linear_attn.state_output", "layers.1.layer_output"], batch_size=2, progress=False)
""")


def test_a_store_killed_mid_run_resumes_to_the_uninterrupted_store(load, tmp_path):
    checkpoint = str(tiny_checkpoint("qwen3_5_text"))
    path = tmp_path / "killed"
    done = subprocess.run([sys.executable, "-c", KILLED, checkpoint, str(path), "3"], capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert done.returncode == -9, done.stderr[-2000:]
    assert (path / "prompts.jsonl").read_text().count("\n") == 3  # batches 0-2 listed, then a line cut short
    assert (path / "shard-00003.safetensors").is_file()  # batch 3 written, not listed
    interrupted = StateStore(path)
    assert not interrupted.complete and len(interrupted) == 6
    kept = {p.name: p.stat().st_mtime_ns for p in path.glob("shard-*.safetensors") if p.name != "shard-00003.safetensors"}
    model = load("qwen3_5_text")
    prompts = [f"prompt number {i} " + "word " * (i % 5) for i in range(11)]
    names = ["layers.0.linear_attn.state_output", "layers.1.layer_output"]
    resumed = nnterp.collect(model, prompts, path, names, batch_size=2, progress=False)
    whole = nnterp.collect(model, prompts, tmp_path / "whole", names, batch_size=2, progress=False)
    assert resumed.complete and len(resumed) == len(whole) == 11
    assert resumed.manifest["prompts"] == whole.manifest["prompts"]
    for i in range(11):
        for name in names:
            assert torch.equal(resumed.value(i, name), whole.value(i, name)), (i, name)
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert {name: (path / name).stat().st_mtime_ns for name in kept} == kept  # the listed batches were not run again


def _recurrent_kinds() -> list[str]:
    from tests.recurrent.test_per_token import KINDS

    return KINDS


def _adapter(model_type: str):
    """The kind's cache adapter (`tests.suites.caches`), as the family's suite declares it."""
    module = importlib.import_module(f"tests.families.test_{model_type}")
    return next(c.CACHE for c in vars(module).values() if isinstance(c, type) and getattr(c, "MODEL_TYPE", None) == model_type)


def _batch_of_two(model, model_type: str) -> list[str]:
    """A left-padded batch of two, or two prompts of one length where the family refuses padding (its model ignores the mask)."""
    if REGISTRY[model_type].PADDING_REFUSED is None:
        return [PROMPTS[2], PROMPTS[0]]
    length = lambda p: len(model.tokenizer(p).input_ids)  # noqa: E731
    return [PROMPTS[2], next(p for p in (PROMPTS[2].replace("Paris", w) for w in ("Rome", "Berlin")) if length(p) == length(PROMPTS[2]))]


def _assert_states(got, expected, what):
    """Equal within 1e-5 of the largest entry (per part where the cache keeps several: the mLSTM's C, n, m)."""
    for g, e in zip(got, expected) if isinstance(expected, tuple) else [(got, expected)]:
        scale = e.abs().max()
        torch.testing.assert_close(g / scale, e / scale, rtol=0, atol=1e-5, msg=what)


#: The kinds whose mixer's forward needs more than its input (MiniMax's position embeddings and mask, RecurrentGemma's
#: position ids, which restart its RG-LRU): a store of their inputs alone is refused.
INPUTS_REFUSED = {"minimax", "recurrent_gemma"}


@pytest.mark.parametrize("factorized", [True, "inputs"])
@pytest.mark.parametrize("model_type", _recurrent_kinds())
def test_factorized_states_replay_to_the_hf_cache_after_each_prefix(model_type, factorized, load, plains, tmp_path):
    model, plain, adapter = load(model_type), plains(model_type), _adapter(model_type)
    layer = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    name = f"layers.{layer}.linear_attn.states"
    prompts = _batch_of_two(model, model_type)
    collect = functools.partial(nnterp.collect, model, prompts, tmp_path / "store", [name, "logits"], positions=-1, batch_size=2,
                                factorized=factorized, checkpoint_every=4, progress=False)
    if factorized == "inputs" and model_type in INPUTS_REFUSED:
        with pytest.raises(Unavailable, match="factorized=True"):
            collect()
        return
    store = collect()
    if factorized == "inputs":  # read back as a store opened later is, through the model's weights
        assert store.manifest["format"] == 2 and store.manifest["factorized"][name]["stores"] == "inputs"
        store = StateStore(store.path, model=model)
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        padded_logits = plain(**batch).logits
    for i, prompt in enumerate(prompts):
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids
        pad = batch.input_ids.shape[1] - ids.shape[1]
        got = store.states(i, layer, range(ids.shape[1]))
        with torch.no_grad():
            alone = plain(ids).logits[0]
        if torch.allclose(padded_logits[i, pad:], alone, rtol=1e-4, atol=1e-4):  # transformers runs the row as the prompt alone
            expected = adapter.prefix_states(plain, ids, layer)  # the state after each prefix, one HF forward each
            expected = tuple(x[0] for x in expected) if isinstance(expected, tuple) else expected[0]
            _assert_states(adapter.served(got), expected, f"{model_type} prompt {i}: every state vs the HF cache")
            for t in (3, 4, 5, 8, -1):  # the last token of a segment (a checkpoint), the first after one, between
                at = tuple(x[t] for x in expected) if isinstance(expected, tuple) else expected[t]
                _assert_states(adapter.served(store.state(i, layer, t)), at, f"{model_type} prompt {i}, state({t})")
        else:  # its padding enters the recurrence (RecurrentGemma's convolution): the row as the batch computed it
            assert pad and isinstance(adapter, ModuleState) and REGISTRY[model_type].PADDING_DIFFERS is not None, model_type
            width = batch.input_ids.shape[1]
            with torch.no_grad(), model.trace(prompts):
                live = model.layers[layer].linear_attn.states_of(list(range(pad, width))).save()
            _assert_states(got, live[i], f"{model_type} padded prompt {i} vs the live states of its batch")
            expected, positions = [], (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate and a trace pass them
            for t in range(pad, width):  # the HF state after each prefix of the padded batch (the module keeps it)
                plain._setup_cache(plain.config, 2, "cpu", torch.float32)
                with torch.no_grad():
                    plain(**{key: value[:, : t + 1] for key, value in batch.items()}, position_ids=positions[:, : t + 1],
                          use_cache=True, **{cache_kwarg(plain): DynamicCache(config=plain.config)})
                expected.append(adapter.read((plain, None), layer)[i])
            _assert_states(got, torch.stack(expected), f"{model_type} padded prompt {i} vs the HF state after each prefix of its batch")
        torch.testing.assert_close(store.value(i, name), got)
    with pytest.raises(InvalidArgument, match="factorized=True"):
        store.states(0, layer + 1 if layer + 1 < len(model.layers) else layer - 1, [0])


def test_reading_one_state_replays_at_most_checkpoint_every_tokens_of_its_segment(load, tmp_path):
    model = load("qwen3_5_text")
    layer = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    name = f"layers.{layer}.linear_attn.states"
    store = nnterp.collect(model, ["word " * 40], tmp_path / "store", [name], factorized=True, checkpoint_every=8, progress=False)
    spec, lengths = store.specs[name], []

    def counting(arguments, out):
        lengths.append(arguments["k"].shape[1])
        return spec.compute(arguments, out)

    store.specs[name] = dataclasses.replace(spec, compute=counting)
    whole = store.states(0, layer, [-1, 20, 3])
    assert lengths and max(lengths) <= 8 and sum(lengths) <= 8 + 5 + 4, lengths  # three segments, each up to its position
    lengths.clear()
    store.state(0, layer, -1)
    assert sum(lengths) <= 8, lengths
    store.specs[name] = spec
    torch.testing.assert_close(whole, store.states(0, layer, [-1, 20, 3]))


def test_a_factorized_store_keeps_what_writes_the_states_and_is_smaller_than_them(load, tmp_path):
    from safetensors import safe_open

    from nnterp.recurrent import replay

    model = load("qwen3_5_text")
    layer = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    name = f"layers.{layer}.linear_attn.states"
    prompt = ["word " * 200]
    with nnterp.fast_states(model):
        whole = nnterp.collect(model, prompt, tmp_path / "whole", [name], progress=False)
    small = nnterp.collect(model, prompt, tmp_path / "small", [name], factorized=True, checkpoint_every=64, progress=False)
    config, seq = model._module.config, small.ids(0).numel()
    with safe_open(str(next(small.path.glob("shard-*"))), "pt") as shard:
        kept = {key.rpartition("/")[2]: shard.get_tensor(key) for key in shard.keys() if "/tokens/" in key}
    assert sorted(kept) == ["beta", "g", "k", "v"]  # q only reads the state: not kept
    # Per token, k [key_heads, key_dim], v [value_heads, value_dim], g and β [value_heads], in the dtype the kernel got.
    heads, key_dim, value_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    numbers = config.linear_num_key_heads * key_dim + heads * value_dim + 2 * heads
    assert sum(x.numel() for x in kept.values()) == seq * numbers and all(x.dtype == torch.float32 for x in kept.values())
    size = lambda store: sum(p.stat().st_size for p in store.path.glob("shard-*"))  # noqa: E731
    assert size(small) < 0.2 * size(whole)  # 72 numbers a token against the state's 512, and 3 checkpoints of 512
    torch.testing.assert_close(small.states(0, layer, [-1])[0], whole.value(0, name)[-1], rtol=1e-5, atol=1e-6)
    with pytest.raises(Unavailable, match="factorized=False"):  # a mixer no fast spec replays (none is registered)
        replay.spec_of(object(), "a factorized store of states")
    with pytest.raises(InvalidArgument, match="checkpoint_every"):
        nnterp.collect(model, PROMPTS, tmp_path / "bad", [name], factorized=True, checkpoint_every=0, progress=False)
    with pytest.raises(InvalidArgument, match="remote=False"):
        nnterp.collect(model, PROMPTS, tmp_path / "bad", [name], factorized=True, remote=True, progress=False)
