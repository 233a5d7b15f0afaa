"""Self-consistency of the oracles in ``hf_oracles.py`` on tiny random-init models."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

from tests.reference.hf_oracles import (
    cache_kwarg,
    continue_from_state,
    conv_state,
    greedy,
    output_cache,
    prefix_states,
    recurrent_state,
    set_conv_state,
    set_recurrent_state,
)

VOCAB = 96
ATOL, RTOL = 1e-5, 1e-4


def close(actual, expected, name, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def _qwen3_5():
    return Qwen3_5ForCausalLM(
        Qwen3_5TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "full_attention"],
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    )


def _kimi():
    return KimiLinearForCausalLM(
        KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=8, num_experts_per_tok=2, num_local_experts=4, linear_head_dim=8, linear_num_heads=2,
            layer_types=["linear_attention", "linear_attention", "full_attention"], max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    )


def _mamba():
    return MambaForCausalLM(
        MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    )


def _mamba2():
    return Mamba2ForCausalLM(
        Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, num_heads=4,
            head_dim=16, n_groups=2, conv_kernel=4, chunk_size=4,
        )
    )


# family -> (builder, a linear-attention layer to read, expected state shape for batch 2)
FAMILIES = {
    "qwen3_5": (_qwen3_5, 1, (2, 4, 8, 8)),
    "kimi_linear": (_kimi, 1, (2, 2, 8, 8)),
    "mamba": (_mamba, 1, (2, 64, 8)),
    "mamba2": (_mamba2, 1, (2, 4, 16, 8)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    build, layer, shape = FAMILIES[request.param]
    torch.manual_seed(0)
    model = build().eval().float()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    return request.param, model, layer, shape, ids


def full_run(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True)


def stepwise_logits(model, ids):
    """Last logits from feeding every token one at a time through one cache."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :1], use_cache=True)
        cache = output_cache(out)
        for i in range(1, ids.shape[1]):
            out = model(input_ids=ids[:, i : i + 1], use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[:, -1]


def test_cache_kwarg_and_output_cache(family):
    name, model, layer, shape, ids = family
    kw = cache_kwarg(model)
    assert kw in ("cache", "past_key_values", "cache_params")
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.24.0"):
        assert kw == "cache", f"{name}: {kw}"
    else:
        assert kw == ("cache_params" if name.startswith("mamba") else "past_key_values"), f"{name}: {kw}"
    cache = output_cache(full_run(model, ids))
    assert type(cache).__name__ == "DynamicCache", f"{name}: {type(cache)}"


def test_state_accessors_read_and_write_in_place(family):
    name, model, layer, shape, ids = family
    cache = output_cache(full_run(model, ids))
    state = recurrent_state(cache, layer)
    assert tuple(state.shape) == shape, f"{name}: recurrent state shape {tuple(state.shape)}"
    assert state.dtype == torch.float32, f"{name}: {state.dtype}"
    assert state is cache.layers[layer].recurrent_states[0]
    if hasattr(cache, "get_recurrent_state"):  # 5.21+
        assert state is cache.get_recurrent_state(layer)
        assert conv_state(cache, layer) is cache.get_conv_state(layer)
    assert conv_state(cache, layer).shape[-1] == 4, f"{name}: conv kernel dim"

    ptr, conv_ptr = state.data_ptr(), conv_state(cache, layer).data_ptr()
    new = torch.randn_like(state)
    set_recurrent_state(cache, layer, new)
    assert recurrent_state(cache, layer).data_ptr() == ptr, f"{name}: set_recurrent_state moved the tensor"
    assert torch.equal(recurrent_state(cache, layer), new), f"{name}: set_recurrent_state"
    new_conv = torch.randn_like(conv_state(cache, layer))
    set_conv_state(cache, layer, new_conv)
    assert conv_state(cache, layer).data_ptr() == conv_ptr and torch.equal(conv_state(cache, layer), new_conv)

    # A decode step updates the same tensor object (Mamba kernels write it in place,
    # GDN copies into it through update_recurrent_state).
    with torch.no_grad():
        model(input_ids=ids[:, :1], use_cache=True, **{cache_kwarg(model): cache})
    assert recurrent_state(cache, layer).data_ptr() == ptr, f"{name}: decode moved the state"
    assert not torch.equal(recurrent_state(cache, layer), new), f"{name}: decode did not update the state"

    with pytest.raises(ValueError):
        set_recurrent_state(cache, layer, new[:1])
    if name in ("qwen3_5", "kimi_linear"):
        with pytest.raises(ValueError, match="no recurrent_states"):
            recurrent_state(cache, 2)  # the full-attention layer


def test_prefix_states_last_equals_full_run(family):
    name, model, layer, shape, ids = family
    states = prefix_states(model, ids, layer)
    assert tuple(states.shape) == (shape[0], ids.shape[1], *shape[1:]), f"{name}: {tuple(states.shape)}"
    cached = recurrent_state(output_cache(full_run(model, ids)), layer)
    close(states[:, -1], cached, f"{name}: prefix_states[:, -1] vs the cache after one full run")
    # Clones, not aliases: consecutive prefixes hold different values.
    assert not torch.equal(states[:, 0], states[:, 1]), f"{name}: prefix states look aliased"
    # An all-ones attention mask changes nothing.
    close(prefix_states(model, ids, layer, attention_mask=torch.ones_like(ids)), states, f"{name}: mask of ones")


def test_prefix_states_match_stepwise_decode(family):
    """The states a one-token-at-a-time run leaves in its cache after each token."""
    name, model, layer, shape, ids = family
    states = prefix_states(model, ids, layer)
    with torch.no_grad():
        out = model(input_ids=ids[:, :1], use_cache=True)
        cache = output_cache(out)
        close(recurrent_state(cache, layer), states[:, 0], f"{name}: state after token 0")
        for i in range(1, ids.shape[1]):
            model(input_ids=ids[:, i : i + 1], use_cache=True, **{cache_kwarg(model): cache})
            close(recurrent_state(cache, layer), states[:, i], f"{name}: decode state after token {i}")


def test_greedy_matches_generate(family):
    name, model, layer, shape, ids = family
    n = 6
    ours = greedy(model, ids, n, suppress_tokens=(model.config.eos_token_id,))  # as min_new_tokens does
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    assert ours.shape == (2, ids.shape[1] + n)
    assert torch.equal(ours, ref), f"{name}: greedy {ours.tolist()} vs generate {ref.tolist()}"
    assert torch.equal(greedy(model, ids, 0), ids)


def test_greedy_patch_is_called_before_each_decode_step(family):
    name, model, layer, shape, ids = family
    seen = []

    def identity(step, cache):
        seen.append(step)
        set_recurrent_state(cache, layer, recurrent_state(cache, layer).clone())

    assert torch.equal(greedy(model, ids, 4, patch=identity), greedy(model, ids, 4)), name
    assert seen == [1, 2, 3], seen


@pytest.mark.parametrize("T", [0, 3, 6])
def test_continue_from_own_state_equals_full_run(family, T):
    name, model, layer, shape, ids = family
    states = prefix_states(model, ids, layer)
    logits = continue_from_state(model, ids, T, layer, states[:, T])
    full = full_run(model, ids).logits[:, -1]
    stepwise = stepwise_logits(model, ids)
    # Mamba-1's warm multi-token call restarts from zero; one-token steps do not,
    # so the one-token-at-a-time run is the reference that holds for every family.
    close(logits, stepwise, f"{name}: continue_from_state(T={T}, own state) vs one-token-at-a-time run")
    close(logits, full, f"{name}: continue_from_state(T={T}, own state) vs full run")


def test_continue_from_state_with_conv_state(family):
    name, model, layer, shape, ids = family
    T = 2
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, : T + 1], use_cache=True))
    own_conv = conv_state(cache, layer).clone()
    own = recurrent_state(cache, layer).clone()
    ref = stepwise_logits(model, ids)
    close(continue_from_state(model, ids, T, layer, own, conv_state=own_conv), ref, f"{name}: own conv state")
    zeroed = continue_from_state(model, ids, T, layer, own, conv_state=torch.zeros_like(own_conv))
    assert not torch.allclose(zeroed, ref), f"{name}: replacing the conv state had no effect"


def test_continue_from_state_patch_takes_effect(family):
    name, model, layer, shape, ids = family
    states = prefix_states(model, ids, layer)
    T = 3
    ref = continue_from_state(model, ids, T, layer, states[:, T])
    patched = continue_from_state(model, ids, T, layer, torch.zeros_like(states[:, T]))
    assert not torch.allclose(patched, ref), f"{name}: zeroing the state had no effect"
    # At the last position nothing runs after the replacement.
    last = ids.shape[1] - 1
    close(continue_from_state(model, ids, last, layer, torch.zeros_like(states[:, last])),
          full_run(model, ids).logits[:, -1], f"{name}: T = last position returns the prefix logits")
    with pytest.raises(IndexError):
        continue_from_state(model, ids, ids.shape[1], layer, states[:, -1])


def test_greedy_patch_agrees_with_continue_from_state(family):
    """Replacing the state before decode step 1 is replacing the state after the prompt's last token."""
    name, model, layer, shape, ids = family
    T = ids.shape[1]
    other = prefix_states(model, ids.flip(0), layer)[:, -1]  # the other row's final state

    def swap(step, cache):
        if step == 1:
            set_recurrent_state(cache, layer, other)

    out = greedy(model, ids, 3, patch=swap)
    logits = continue_from_state(model, out[:, : T + 1], T - 1, layer, other)
    assert torch.equal(logits.argmax(-1), out[:, T + 1]), f"{name}: {logits.argmax(-1)} vs {out[:, T + 1]}"
    own = continue_from_state(model, out[:, : T + 1], T - 1, layer, prefix_states(model, ids, layer)[:, -1])
    assert not torch.allclose(logits, own), f"{name}: swapping the rows' states had no effect"


def test_multi_token_continuation_through_the_cache(family):
    """Why the oracles never feed several tokens to a warm cache: Mamba-1 restarts from zero."""
    name, model, layer, shape, ids = family
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :4], use_cache=True))
        chunked = model(input_ids=ids[:, 4:], use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]
    full = full_run(model, ids).logits[:, -1]
    if name == "mamba":
        assert not torch.allclose(chunked, full, atol=1e-5), "mamba: warm multi-token call used the cached state"
    else:
        close(chunked, full, f"{name}: warm multi-token continuation vs full run")
