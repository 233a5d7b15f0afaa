"""`collect(..., factorized="inputs")`: per-token states stored as the mixer's inputs, replayed through its weights.

Oracles: the bytes the shard holds, against the full states a plain store of
``states`` holds and the formula of the recipe (docs/recipes/states-over-a-dataset.md);
the states a store of the kernel's arguments replays and the live ``states``
(the HF cache after each prefix, for every kind, is in tests/test_store.py);
the tokens the mixer's projection and the replay are run over, counted by
hooks on the model's own modules.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

import nnterp
from nnterp import InvalidArgument, StandardizedTransformer, StateStore
from nnterp.testing import tiny_checkpoint


def _layer(model) -> int:
    return next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)


def _stored(store: StateStore, key: str) -> int:
    """Bytes of the tensors of prompt 0 whose name starts with ``0/{key}``, as the shard holds them."""
    with safe_open(str(next(store.path.glob("shard-*"))), "pt") as shard:
        return sum(shard.get_tensor(name).nbytes for name in shard.keys() if name.startswith(f"0/{key}"))


def test_a_store_of_the_mixers_inputs_is_at_most_one_key_dim_of_the_states_plus_its_checkpoints(tmp_path):
    # Issue 26's bound, in bytes. The recipe's formula: per token and layer the store keeps the input, hidden_size
    # numbers in the model's dtype (b bytes), against the float32 state's 4 · value_heads · key_dim · value_dim, so
    # the bound holds where hidden_size · b ≤ 4 · value_heads · value_dim: on the tiny Qwen3.5 (hidden 64, 4 value
    # heads of 8) in bfloat16, with equality (128 bytes a token against 2 KiB / 16); in float32 it would not.
    model = StandardizedTransformer(str(tiny_checkpoint("qwen3_5_text")), dispatch=True, device="cpu", dtype=torch.bfloat16)
    config, layer, every = model._module.config, _layer(model), 64
    name = f"layers.{layer}.linear_attn.states"
    prompt = ["word " * 200]
    with nnterp.fast_states(model):
        whole = nnterp.collect(model, prompt, tmp_path / "whole", [name], progress=False)
    inputs = nnterp.collect(model, prompt, tmp_path / "inputs", [name], factorized="inputs", checkpoint_every=every, progress=False)
    arguments = nnterp.collect(model, prompt, tmp_path / "arguments", [name], factorized=True, checkpoint_every=every, progress=False)
    seq, key_dim = inputs.ids(0).numel(), config.linear_key_head_dim
    states = _stored(whole, name)
    assert states == seq * 4 * config.linear_num_value_heads * key_dim * config.linear_value_head_dim
    checkpoints = _stored(inputs, f"{name}/checkpoints")
    assert checkpoints == (seq // every) * states // seq  # one float32 state per checkpoint_every tokens
    kept = _stored(inputs, name) - checkpoints
    assert kept == seq * config.hidden_size * 2  # the input, hidden_size numbers a token in bfloat16, and nothing else
    assert kept <= states / key_dim
    # The kernel's arguments (k, v, β in bfloat16, g in float32) are over the bound on these sizes: 152 bytes a token.
    assert _stored(arguments, name) - _stored(arguments, f"{name}/checkpoints") > states / key_dim
    # The same states, within bfloat16 rounding: the projections of a shorter run may round differently from the
    # collecting trace's (tests/test_store.py compares every kind with the HF cache in float32, within 1e-5).
    replayed, live = inputs.states(0, layer, range(seq)), whole.value(0, name)
    torch.testing.assert_close(replayed / live.abs().max(), live / live.abs().max(), rtol=0, atol=1e-2)


def test_reading_one_state_runs_the_mixers_projections_and_the_replay_over_one_segment(load, tmp_path):
    model = load("qwen3_5_text")
    layer, every = _layer(model), 8
    name = f"layers.{layer}.linear_attn.states"
    store = nnterp.collect(model, ["word " * 40], tmp_path / "store", [name], factorized="inputs", checkpoint_every=every, progress=False)
    window = model._module.config.linear_conv_kernel_dim - 1  # the tokens before a segment its convolution reads
    assert store.manifest["factorized"][name]["lookback"] == window
    module = model.layers[layer].linear_attn.hf_module()
    projected, kernels, replayed = [], [], []
    hooks = [
        module.in_proj_qkv.register_forward_hook(lambda _, args, out: projected.append(args[0].shape[1])),
        module.out_proj.register_forward_hook(lambda *_: kernels.append(1)),
    ]
    spec = store.specs[name]

    def counting(arguments, out):
        replayed.append(arguments["k"].shape[1])
        return spec.compute(arguments, out)

    store.specs[name] = dataclasses.replace(spec, compute=counting)
    try:
        whole = store.states(0, layer, [-1, 20, 3])
        assert replayed and max(replayed) <= every and sum(replayed) <= every + 5 + 4, replayed  # three segments
        assert len(projected) == 3 and sum(projected) <= sum(replayed) + 2 * window, projected  # + the window, but at 0
        assert not kernels  # the trace stops at the kernel call: no kernel, no output projection
        projected.clear(), replayed.clear()
        store.state(0, layer, -1)
        assert sum(replayed) <= every and sum(projected) <= every + window, (replayed, projected)
    finally:
        for hook in hooks:
            hook.remove()
        store.specs[name] = spec
    torch.testing.assert_close(whole, store.states(0, layer, [-1, 20, 3]))


def test_a_store_of_inputs_opens_with_its_model_and_old_stores_keep_their_format(load, tmp_path):
    model = load("qwen3_5_text")
    layer = _layer(model)
    name = f"layers.{layer}.linear_attn.states"
    prompts = ["A longer prompt about the Eiffel Tower in Paris", "The cat sat on the mat"]  # a left-padded batch
    old = nnterp.collect(model, prompts, tmp_path / "old", [name], factorized=True, checkpoint_every=4, progress=False)
    assert old.manifest["format"] == 1 and "stores" not in old.manifest["factorized"][name]  # as before: older nnterp reads it
    new = nnterp.collect(model, prompts, tmp_path / "new", [name], factorized="inputs", checkpoint_every=4, progress=False)
    assert new.manifest["format"] == 2
    torch.testing.assert_close(StateStore(old.path).states(1, layer, [0, 3, 4]), new.states(1, layer, [0, 3, 4]))
    with pytest.raises(InvalidArgument, match=r"StateStore\(path, model=model\)"):
        StateStore(new.path).state(0, layer, 0)
    assert StateStore(new.path).ids(0).numel() > 0  # everything else reads without the model
    lazy = StandardizedTransformer(str(tiny_checkpoint("qwen3_5_text")))  # its weights load when a read needs them
    reopened = StateStore(new.path, model=lazy)
    assert not lazy.dispatched
    torch.testing.assert_close(reopened.states(0, layer, [0, 5, -1]), new.states(0, layer, [0, 5, -1]))
    with pytest.raises(InvalidArgument, match="collected from"):
        StateStore(new.path, model=load("lfm2"))
    again = nnterp.collect(model, prompts, tmp_path / "new", [name], factorized="inputs", checkpoint_every=4, progress=False)
    torch.testing.assert_close(again.states(0, layer, [2]), new.states(0, layer, [2]))  # resumed: nothing to run
    with pytest.raises(InvalidArgument, match="'inputs'"):
        nnterp.collect(model, prompts, tmp_path / "bad", [name], factorized="input", progress=False)
    manifest = json.loads((new.path / "manifest.json").read_text())
    (new.path / "manifest.json").write_text(json.dumps(manifest | {"format": 3}))
    with pytest.raises(InvalidArgument, match="reads formats"):
        StateStore(new.path, model=model)
