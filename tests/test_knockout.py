"""`nnterp.knockout`: an attention layer's knockout, ``model.knockout``, ``support()``'s rows, and state steering.

Oracles: for attention, the plain transformers model in eager attention with
its ``eager_attention_forward`` rebound for the test to one written here from
the equation, which edits one layer's weights (``mode="value"``: the softmax
weight of ``(t, s)`` set to 0 after the softmax, nothing renormalized;
``mode="mask"``: its score set to ``-inf`` before it); for a recurrent
mixer's knockout, transformers' own prompt kernel rebound with the sources'
values zeroed (``mode="value"``; with targets, that run's outputs at the
targets spliced into the unedited run's) or the source's update neutralized
(``mode="skip"``: β = 0 and g = 0 on a DeltaNet and Kimi, Δ = 0 on Mamba):
the value knockout on all nine kinds (the gated DeltaNet, Kimi, Mamba-1/2,
RWKV-4, the short convolution's and the RG-LRU's scans, the mLSTM's backend,
lightning attention's values where its forward makes them), the skip on four
(every kind's knockout is also checked against its effective attention and
the plain cache, family by family, in `tests.suites.knockout`);
inside ``model.knockout``, each part's own knockout; for the steering vectors,
states read one prompt at a time.
"""

from __future__ import annotations

import sys

import pytest
import torch

import nnterp
from nnterp import InvalidArgument, StandardizedTransformer, Unavailable

PROMPT = "The Eiffel Tower is in the city of Paris"
ATTENTION_FAMILIES = ["llama", "qwen3_5_text"]  # a plain family and a hybrid; every family below, by its softmax


def _attention_layers(model) -> list[int]:
    return [i for i, block in enumerate(model.layers) if block.self_attn is not None]


def _oracle_eager(layer: int, pairs: list, mode: str, repeat_kv):
    """An eager attention forward that knocks out ``pairs`` ``(t, s)`` on layer ``layer`` only."""

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            mask = attention_mask[:, :, :, : key.shape[-2]]
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
        here = module.layer_idx == layer
        if here and mode == "mask":
            for t, s in pairs:
                scores[:, :, t, s] = float("-inf")
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if here and mode == "value":
            for t, s in pairs:
                weights[:, :, t, s] = 0.0
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return eager


@pytest.mark.parametrize("model_type", ATTENTION_FAMILIES)
@pytest.mark.parametrize("mode, targets", [("value", None), ("value", [4, 6]), ("mask", None), ("mask", [5])])
def test_an_attention_knockout_is_the_eager_forward_with_those_weights_edited(model_type, mode, targets, eager_models, plains, monkeypatch):
    model = eager_models(model_type)
    plain = plains(model_type, attn_implementation="eager")
    layer = _attention_layers(model)[-1]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    seq = ids.shape[1]
    sources = [1, 3]
    rows = range(seq) if targets is None else targets
    pairs = [(t, s) for s in sources for t in rows if t >= s]
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].self_attn.knockout(sources, targets=targets, mode=mode)
        got = model.logits.save()
    modeling = sys.modules[type(plain.model.layers[layer].self_attn).__module__]
    monkeypatch.setattr(modeling, "eager_attention_forward", _oracle_eager(layer, pairs, mode, modeling.repeat_kv))
    with torch.no_grad():
        expected = plain(ids).logits
        monkeypatch.undo()
        clean = plain(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, clean, atol=1e-4), "the knockout changes the logits, so the check bites"
    first = min(t for t, _ in pairs)
    torch.testing.assert_close(got[:, :first], clean[:, :first], rtol=1e-5, atol=1e-6)


def test_a_mask_knockout_refuses_a_target_with_nothing_left_and_bad_modes(eager_models):
    model = eager_models("llama")
    attention = model.layers[_attention_layers(model)[0]].self_attn
    with pytest.raises(InvalidArgument, match="no key to attend"), torch.no_grad(), model.trace(PROMPT):
        attention.knockout(0, targets=0, mode="mask")
    with pytest.raises(InvalidArgument, match="mode must be one of"), torch.no_grad(), model.trace(PROMPT):
        attention.knockout(0, mode="skip")


def test_an_attention_knockout_needs_eager_attention_and_support_says_so(load):
    model = load("llama")
    table = model.support()
    assert "enable_attention_probs=True" in table["self_attn.knockout"][0]
    with pytest.raises(Unavailable, match="enable_attention_probs=True"), torch.no_grad(), model.trace(PROMPT):
        model.layers[0].self_attn.knockout(1)


def test_support_lists_the_interventions_per_layer_with_their_reasons(load, eager_models):
    table = load("mamba2").support()
    assert table["linear_attn.knockout"] is None and table["linear_attn.knockout.skip"] is None
    assert table["linear_attn.steer_state"] is None
    hybrid = load("qwen3_5_text")
    rows = hybrid.support()["self_attn.knockout"]
    attention = _attention_layers(hybrid)
    assert sorted(rows) == attention and all("enable_attention_probs=True" in rows[i] for i in attention)
    assert eager_models("qwen3_5_text").support()["self_attn.knockout"] is None
    with nnterp.route_kernels(hybrid.family, "torch"):
        assert hybrid.support()["linear_attn.knockout"] is None


def test_model_knockout_is_each_layers_own_knockout(eager_models):
    model = eager_models("qwen3_5_text")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids):
        model.knockout(2, targets=[3, 5], layers=[0, -1])
        got = model.logits.save()
    with torch.no_grad(), model.trace(ids):
        for index in (0, len(model.layers) - 1):
            layer = model.layers[index]
            for part in (layer.linear_attn, layer.self_attn):
                if part is not None:
                    part.knockout(2, targets=[3, 5])
        expected = model.logits.save()
    assert torch.equal(got, expected)
    with pytest.raises(InvalidArgument, match="has an attention layer|has a recurrent mixer"), torch.no_grad(), model.trace(ids):
        model.knockout(1, layers=[0], mode="mask")  # layer 0 is a DeltaNet block
    with pytest.raises(InvalidArgument, match="mode must be"), torch.no_grad(), model.trace(ids):
        model.knockout(1, mode="erase")


def test_state_steering_vectors_are_the_difference_of_mean_final_states(load):
    model = load("mamba2")
    positive, negative = ["The cat sat on the mat", "A dog ran in the park"], ["My favourite food is pizza"]
    vectors = nnterp.state_steering_vectors(model, positive, negative, batch_size=1, progress=False)
    layers = [i for i, block in enumerate(model.layers) if block.linear_attn is not None]
    assert sorted(vectors) == layers

    def final(prompt, layer):
        with torch.no_grad(), model.trace(prompt):
            state = model.layers[layer].linear_attn.state_output.save()
        return state[0].float()

    for layer in layers:
        expected = sum(final(p, layer) for p in positive) / 2 - final(negative[0], layer)
        torch.testing.assert_close(vectors[layer], expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad(), model.trace(PROMPT):
        model.steer_states({layers[0]: vectors[layers[0]]}, scale=2.0)
        steered = model.layers[layers[0]].linear_attn.state_output.save()
    clean = final(PROMPT, layers[0])
    torch.testing.assert_close(steered[0].float(), clean + 2.0 * vectors[layers[0]], rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgument, match="no recurrent mixer"):
        nnterp.state_steering_vectors(load("llama"), positive, negative, layers=[0], progress=False)


@pytest.mark.parametrize("model_type", ["mamba2", "rwkv"])
def test_a_knockout_in_generate_acts_on_the_prompt_as_in_a_trace(model_type, load):
    model = load(model_type)
    mix = next(block.linear_attn for block in model.layers if block.linear_attn is not None)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids):
        clean = model.logits.save()
    with torch.no_grad(), model.trace(ids):
        mix.knockout([1, 2])
        expected = model.logits.save()
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False):
        mix.knockout([1, 2])
        got = model.logits.save()  # step 0's: generate keeps the prompt's last position
    torch.testing.assert_close(got[:, -1], expected[:, -1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected[:, -1], clean[:, -1], atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba2"])
@pytest.mark.parametrize("targets", [None, [-1]], ids=["every-target", "last"])
def test_a_knockout_on_a_left_padded_batch_is_each_prompts_at_its_padded_positions(model_type, targets, load):
    model = load(model_type)
    mix = next(block.linear_attn for block in model.layers if block.linear_attn is not None)
    long, short = PROMPT, "The tower is tall"
    batch = model.tokenizer([long, short], return_tensors="pt", padding=True)
    pad = int((batch.attention_mask[1] == 0).sum())
    assert pad > 0 and batch.attention_mask[1, 0] == 0, "the short prompt is left-padded"
    s = pad + 1
    with torch.no_grad(), model.trace([long, short]):
        mix.knockout(s, targets=targets)
        got = model.logits.save()
    for row, prompt, position in ((0, long, s), (1, short, s - pad)):
        with torch.no_grad(), model.trace(prompt):
            mix.knockout(position, targets=targets)
            alone = model.logits.save()
        torch.testing.assert_close(got[row, -alone.shape[1]:], alone[0], rtol=1e-4, atol=1e-4)


def _representatives() -> list[str]:
    from tests.recurrent.test_per_token import KINDS

    return KINDS


@pytest.mark.parametrize("model_type", _representatives())
def test_invokes_sharing_a_targeted_knockouts_rows_each_get_their_own_knockout(model_type, load):
    # Invokes of one prompt share the knocked-out layer's effective-attention rows (`shared_in_run`): each must still
    # be its own single knockout, and an invoke whose rows differ (another prompt of the same length, or an edited
    # kernel argument) must not take another's.
    model = load(model_type)
    mix = next(block.linear_attn for block in model.layers if block.linear_attn is not None)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    other = torch.roll(ids, 1, dims=1)
    values = type(mix).values()
    writable = [n for n in ("attention_keys", "decays") if n in values and values[n].assign is not None]

    def edit(m):
        if writable:
            setattr(m, writable[0], getattr(m, writable[0]) * 0.5)

    runs = [(ids, 1, None), (ids, 3, None), (other, 1, None), (ids, 2, edit)]
    saved = []
    with torch.no_grad(), model.trace(use_cache=False) as tracer:
        for prompt, source, before in runs:
            with tracer.invoke(prompt):
                if before is not None:
                    before(mix)
                mix.knockout(source, targets=-1)
                saved.append(model.logits.save())
    for (prompt, source, before), got in zip(runs, saved):
        with torch.no_grad(), model.trace(prompt, use_cache=False):
            if before is not None:
                before(mix)
            mix.knockout(source, targets=-1)
            alone = model.logits.save()
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba2"])
def test_each_knockout_sweep_cell_is_its_single_knockout(model_type, eager_models, tmp_path):
    model = eager_models(model_type)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    token = int(ids[0, -1])

    def metric(logits):
        return logits[-1].log_softmax(-1)[token]

    result = nnterp.knockout_sweep(model, PROMPT, metric, sources=[0, 2, -2], layers=[0, -1], batch_size=2, progress=False)
    assert result.layers == [0, len(model.layers) - 1] and result.positions == [0, 2, ids.shape[1] - 2]
    assert result.complete and result.done == 6
    with torch.no_grad(), model.trace(ids):
        clean = model.logits.save()
    assert result.clean == pytest.approx(float(metric(clean[0])), abs=1e-6)
    for row, layer in enumerate(result.layers):
        for column, s in enumerate(result.positions):
            with torch.no_grad(), model.trace(ids):
                model.knockout(s, targets=-1, layers=[layer])
                alone = model.logits.save()
            assert result.values[row, column].item() == pytest.approx(float(metric(alone[0])), abs=1e-4)
    assert result.effects.abs().max() > 1e-4
    (layer, source, effect), *_ = result.top(1)
    assert abs(effect) == pytest.approx(result.effects.abs().max().item())
    assert result.effects[result.layers.index(layer), result.positions.index(source)].item() == pytest.approx(effect)
    result.plot().savefig(tmp_path / "sweep.png")
    with pytest.raises(InvalidArgument, match="batch_size"):
        nnterp.knockout_sweep(model, PROMPT, metric, batch_size=0)


def _attention_families() -> list[str]:
    from nnterp.families import REGISTRY, absent

    return sorted(m for m in REGISTRY if absent(m) is None)


def _softmax_edited(nth: int, seq: int, pairs: list, mode: str, original):
    """torch's softmax, with its ``nth`` call over an attention layer's scores (``[batch, heads, seq, keys]``: the
    eager forward's; an attention sink adds one key) edited at ``pairs``: ``mode="mask"`` sets the scores to
    ``-inf`` first, ``mode="value"`` the weights to 0 after. Calls are counted, not ``layer_idx`` read: Zamba2's
    shared attention block is one module called by several layers."""
    calls = []

    def softmax(scores, *args, **kwargs):
        shaped = isinstance(scores, torch.Tensor) and scores.dim() == 4 and scores.shape[2] == seq
        if not (shaped and scores.shape[3] in (seq, seq + 1)):
            return original(scores, *args, **kwargs)
        calls.append(1)
        if len(calls) - 1 != nth:
            return original(scores, *args, **kwargs)
        if mode == "mask":
            scores = scores.clone()
            for t, s in pairs:
                scores[:, :, t, s] = float("-inf")
        weights = original(scores, *args, **kwargs)
        if mode == "value":
            weights = weights.clone()
            for t, s in pairs:
                weights[:, :, t, s] = 0.0
        return weights

    softmax.calls = calls
    return softmax


@pytest.mark.parametrize("model_type", _attention_families())
@pytest.mark.parametrize("mode", ["value", "mask"])
def test_an_attention_knockout_on_every_family_is_its_eager_softmax_edited(model_type, mode, checkpoint, plains, monkeypatch):
    model = StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu", enable_attention_probs=True)
    layers = _attention_layers(model)
    if not layers:
        pytest.skip(f"{model_type} has no softmax attention layer")
    plain = plains(model_type, attn_implementation="eager")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    seq = ids.shape[1]
    layer, sources, targets = layers[-1], [1, 2], [3, seq - 1]
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].self_attn.knockout(sources, targets=targets, mode=mode)
        got = model.logits.save()
    pairs = [(t, s) for s in sources for t in targets]
    softmax = _softmax_edited(layers.index(layer), seq, pairs, mode, torch.nn.functional.softmax)
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    with torch.no_grad():
        expected = plain(ids).logits
    monkeypatch.undo()
    assert len(softmax.calls) == len(layers), "one softmax over scores per attention layer"
    with torch.no_grad():
        clean = plain(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, clean, atol=1e-5), "the knockout changes the logits"


#: ``component: (the modeling module's prompt kernel, the index of its value argument, that argument's token
#: axis, its output's token axis)``, read from transformers' source: the reference recurrence the oracle runs.
KERNELS = {
    "LinearAttention": ("torch_chunk_gated_delta_rule", 2, 1, 1),  # value [b, seq, heads, dv] -> out [b, seq, heads, dv]
    "StateSpace": ("mamba2_chunk_scan", 0, 1, 1),  # x [b, seq, heads, head_dim] -> y [b, seq, heads, head_dim]
    "SelectiveScan": ("mamba_selective_scan", 0, 2, 2),  # x [b, channels, seq] -> y [b, channels, seq]
    "KimiDeltaAttention": ("chunk_kimi_delta_attention", 2, 1, 1),  # value [b, seq, heads, dv] -> out [b, seq, heads, dv]
    "WKV": ("rwkv_linear_attention", 3, 1, 1),  # value [b, seq, channels] -> wkv [b, seq, channels]
    "ShortConvolution": ("causal_conv1d_fn", 0, 2, 2),  # u = B * x [b, channels, seq] (no cache: the call's tokens only) -> same
    # Methods, patched on their class: the RG-LRU's scan, the mLSTM's backend (called with keywords).
    "RGLRU": ("RecurrentGemmaRglru._rnn_scan", "hidden_states", 1, 1),  # [b, seq, lru_width]
    "MLSTM": ("xLSTMBackend.forward", "value", 2, 2),  # value, h [b, heads, seq, dv]
}


def _zeroed_kernel(original, value_at: int, token_axis: int, output_axis: int, sources: list, targets):
    """``original`` (a prompt kernel of the plain model) on its first call with the sources' values zeroed; with
    ``targets``, that run's outputs at the targets and the unedited run's everywhere else (its final state too)."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            return original(*args, **kwargs)
        zeroed, zeroed_kwargs = list(args), dict(kwargs)
        holder = zeroed if isinstance(value_at, int) else zeroed_kwargs
        value = holder[value_at].clone()
        index = [slice(None)] * value.dim()
        index[token_axis] = sources
        value[tuple(index)] = 0
        holder[value_at] = value
        knocked = original(*zeroed, **zeroed_kwargs)
        if targets is None:
            return knocked
        clean = original(*args, **kwargs)
        pick = lambda result: result[0] if isinstance(result, tuple) else result  # noqa: E731
        spliced = pick(clean).clone()
        at = [slice(None)] * spliced.dim()
        at[output_axis] = targets
        spliced[tuple(at)] = pick(knocked)[tuple(at)]
        return (spliced, *clean[1:]) if isinstance(clean, tuple) else spliced

    kernel.calls = calls
    return kernel


def _family_of(component: str) -> str:
    """The first family of the registry whose mixer is ``component`` (the kind's subject)."""
    from nnterp.families import families

    return next(f.MODEL_TYPES[0] for f in families() if f.MIXER is not None and f.MIXER.__name__ == component)


def _kernel_owner(plain, name: str) -> tuple:
    """``(the object holding the kernel, its attribute)``: the modeling module, or a class of it for ``Class.method``."""
    modeling = sys.modules[type(plain).__module__]
    if "." not in name:
        return modeling, name
    cls, method = name.split(".")
    owner = getattr(modeling, cls, None) or next(getattr(m, cls) for m in vars(modeling).values() if isinstance(m, type) and hasattr(m, cls))
    return owner, method


@pytest.mark.parametrize("component", sorted(KERNELS))
@pytest.mark.parametrize("targets", [None, [4, 6]], ids=["every-target", "targets"])
def test_a_value_knockout_is_the_reference_recurrence_with_the_sources_values_zeroed(component, targets, load, plains, monkeypatch):
    model, plain = load(_family_of(component)), plains(_family_of(component))
    first = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    sources = [1, 3]
    with torch.no_grad(), model.trace(ids):
        model.layers[first].linear_attn.knockout(sources, targets=targets)
        got = model.logits.save()
    name, value_at, token_axis, output_axis = KERNELS[component]
    owner, attribute = _kernel_owner(plain, name)
    kernel = _zeroed_kernel(getattr(owner, attribute), value_at, token_axis, output_axis, sources, targets)
    monkeypatch.setattr(owner, attribute, kernel)
    with torch.no_grad():
        expected = plain(ids, use_cache=False).logits  # no cache: LFM2's convolution then takes the call's tokens only
    monkeypatch.undo()
    assert kernel.calls, f"the plain forward ran {name}"
    with torch.no_grad():
        clean = plain(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, clean, atol=1e-4)


#: ``component: {argument (index or keyword): (token axis, the value that skips a token)}``: the source's update
#: neutralized in transformers' own kernel (DeltaNet: β = 0 and log decay g = 0; Mamba: dt = -inf, so Δ = softplus(dt + bias) = 0).
SKIPS = {
    "LinearAttention": {"g": (1, 0.0), "beta": (1, 0.0)},
    "StateSpace": {1: (1, float("-inf"))},
    "SelectiveScan": {1: (2, float("-inf"))},
    "KimiDeltaAttention": {"g": (1, 0.0), "beta": (1, 0.0)},
}


def _skipping_kernel(original, edits: dict, source: int):
    calls = []

    def kernel(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            args, kwargs = list(args), dict(kwargs)
            for where, (axis, filler) in edits.items():
                holder = args if isinstance(where, int) else kwargs
                value = holder[where].clone()
                index = [slice(None)] * value.dim()
                index[axis] = source
                value[tuple(index)] = filler
                holder[where] = value
        return original(*args, **kwargs)

    kernel.calls = calls
    return kernel


@pytest.mark.parametrize("component", sorted(SKIPS))
def test_a_skip_is_the_reference_recurrence_with_the_sources_update_neutralized(component, load, plains, monkeypatch):
    model, plain = load(_family_of(component)), plains(_family_of(component))
    first = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids):
        model.layers[first].linear_attn.knockout(2, mode="skip")
        got = model.logits.save()
    owner, attribute = _kernel_owner(plain, KERNELS[component][0])
    kernel = _skipping_kernel(getattr(owner, attribute), SKIPS[component], 2)
    monkeypatch.setattr(owner, attribute, kernel)
    with torch.no_grad():
        expected = plain(ids).logits
    monkeypatch.undo()
    assert kernel.calls
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(got, plain(ids).logits, atol=1e-4)


def test_a_lightning_value_knockout_is_the_forward_with_the_sources_values_zeroed(load, plains, monkeypatch):
    """Lightning attention has no kernel call: its values are zeroed where the forward makes them (``qkv_states``,
    split per head into q, k, v of ``head_dim`` each after the padding mask is applied)."""
    model, plain = load("minimax"), plains("minimax")
    first = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    sources = [1, 3]
    with torch.no_grad(), model.trace(ids):
        model.layers[first].linear_attn.knockout(sources)
        got = model.logits.save()
    modeling = sys.modules[type(plain).__module__]
    original, calls = modeling.apply_mask_to_padding_states, []
    attention = plain.model.layers[first].self_attn
    width = attention.num_attention_heads * 3 * attention.head_dim

    def masked(states, mask):
        out = original(states, mask)
        if out.shape[-1] == width and not calls:
            calls.append(1)
            out = out.reshape(*out.shape[:2], attention.num_attention_heads, 3 * attention.head_dim).clone()
            out[:, sources, :, 2 * attention.head_dim :] = 0
            out = out.reshape(*out.shape[:2], width)
        return out

    monkeypatch.setattr(modeling, "apply_mask_to_padding_states", masked)
    with torch.no_grad():
        expected = plain(ids).logits
    monkeypatch.undo()
    assert calls
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
