"""nnterp 1.x's names and helpers on every registered family, each against plain transformers.

Oracles: a plain HF forward (``output_hidden_states``, ``output_attentions``
under eager attention), torch forward hooks on the plain model's modules at
the family's paths (capturing an output, adding a vector to it, replacing a
block's output by its input), and the plain model's own final norm and
unembedding applied by hand.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nnterp import NnterpError, StandardizedTransformer, Unavailable
from nnterp.families import MODEL_TYPES
from tests.suites.checkpoint import model_type_params

PROMPT = "The Eiffel Tower is in the city of"
FAMILIES = model_type_params(MODEL_TYPES)


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _paths(model, layer: int) -> dict:
    """HF submodule paths (from the causal LM) of layer ``layer``'s parts."""
    root = f"{model.family.LAYERS}.{layer}"
    block = model.layers[layer]
    found = {"layer": root}
    for part in ("self_attn", "linear_attn", "mlp"):
        envoy = getattr(block, part)
        if envoy is not None:
            found[part] = envoy.path.removeprefix("model.")
    return found


def _capture(plain, paths: list[str]):
    outputs: dict = {}
    hooks = [
        plain.get_submodule(path).register_forward_hook(lambda m, a, out, path=path: outputs.__setitem__(path, _first(out)))
        for path in paths
    ]
    return outputs, hooks


def _run_hooked(plain, hooks: list, *args, **kwargs):
    """``plain(*args, **kwargs)`` without gradients, its forward hooks removed afterwards whatever happens."""
    try:
        with torch.no_grad():
            return plain(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()


def _ids(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


@pytest.mark.parametrize("model_type", FAMILIES)
def test_per_layer_names_read_what_hf_computes(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    ids = _ids(model)
    n = model.num_layers
    paths = [path for i in range(n) for path in _paths(model, i).values()]
    outputs, hooks = _capture(plain, paths)
    inputs: dict = {}
    for i in range(n):  # HF's hidden_states convention varies (Mamba's omits the embedding): hooks do not
        hooks.append(plain.get_submodule(_paths(model, i)["layer"]).register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]), with_kwargs=True,
        ))
    ref = _run_hooked(plain, hooks, ids)
    got: list = []
    with torch.no_grad(), model.trace(ids):
        for i in range(n):
            block = model.layers[i]
            got.append(("in", i, model.layers_input[i].save()))
            if block.self_attn is not None or block.linear_attn is not None:
                got.append(("attn", i, model.attentions_output[i].save()))
            if block.mlp is not None:
                got.append(("mlp", i, model.mlps_output[i].save()))
            got.append(("out", i, model.layers_output[i].save()))
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    for kind, i, value in got:
        part = _paths(model, i)
        if kind == "in":
            expected = inputs[i]
        elif kind == "out":
            expected = outputs[part["layer"]]
        elif kind == "attn":
            expected = outputs[part.get("self_attn") or part["linear_attn"]]
        else:
            expected = outputs[part["mlp"]]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-5, msg=f"{kind}[{i}]")
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(probs, torch.softmax(ref.logits[:, -1].float(), -1), rtol=0, atol=1e-6)
    assert model.hidden_size == inputs[0].shape[-1]
    assert model.vocab_size == ref.logits.shape[-1]
    assert model.num_layers == len(plain.get_submodule(model.family.LAYERS))
    assert [model.attentions[i] for i in range(n)] == [b.self_attn or b.linear_attn for b in model.layers]
    assert [model.mlps[i] for i in range(n)] == [b.mlp for b in model.layers]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_are_readable_after_the_model_output(model_type, load):
    model = load(model_type)
    with torch.no_grad(), model.trace(PROMPT):
        output = model.output.save()
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    torch.testing.assert_close(logits, output.logits, rtol=0, atol=0)
    torch.testing.assert_close(probs, torch.softmax(output.logits[:, -1].float(), -1), rtol=0, atol=0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_writing_a_layer_output_and_an_mlp_output_changes_what_follows_as_hf_would(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    ids = _ids(model)
    generator = torch.Generator().manual_seed(0)
    replacement = torch.randn(1, ids.shape[1], model.hidden_size, generator=generator)
    mlp_layer = max((i for i, b in enumerate(model.layers) if b.mlp is not None), default=None)
    handles = [plain.get_submodule(_paths(model, 0)["layer"]).register_forward_hook(
        lambda m, a, out: (replacement, *out[1:]) if isinstance(out, tuple) else replacement
    )]
    if mlp_layer is not None:
        handles.append(plain.get_submodule(_paths(model, mlp_layer)["mlp"]).register_forward_hook(
            lambda m, a, out: (out[0] * 0, *out[1:]) if isinstance(out, tuple) else out * 0
        ))
    expected = _run_hooked(plain, handles, ids).logits
    with torch.no_grad(), model.trace(ids):
        if mlp_layer == 0:
            model.mlps_output[0] = model.mlps_output[0] * 0
        model.layers_output[0] = replacement
        if mlp_layer:
            model.mlps_output[mlp_layer] = model.mlps_output[mlp_layer] * 0
        logits = model.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def _capped(model, logits):
    """``logits`` soft-capped as the family's causal LM caps them (RecurrentGemma), unchanged elsewhere."""
    cap = model.family.logits_softcap(model._module.config)
    return torch.tanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("model_type", FAMILIES)
def test_project_on_vocab_is_the_final_norm_and_unembedding(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    ids = _ids(model)
    last = model.num_layers - 1
    paths = [_paths(model, 0)["layer"], _paths(model, last)["layer"]]
    outputs, hooks = _capture(plain, paths)
    ref = _run_hooked(plain, hooks, ids)
    first = outputs[paths[0]]
    with torch.no_grad(), model.trace(ids):
        middle = model.project_on_vocab(model.layers_output[0]).save()
        final = model.project_on_vocab(model.layers_output[last]).save()
    norm, head = plain.get_submodule(model.family.LN_FINAL), plain.get_submodule(model.family.LM_HEAD)
    with torch.no_grad():
        manual = _capped(model, head(norm(first)) * model.family.logits_scale(plain.config))
        manual_last = _capped(model, head(norm(outputs[paths[1]])) * model.family.logits_scale(plain.config))
    torch.testing.assert_close(final, manual_last, rtol=0, atol=1e-5)
    if not getattr(plain.config, "rescale_every", 0):
        # The model's own logits. Not on RWKV in inference: it halves the hidden state after every rescale_every
        # blocks, the last one's included, before its final norm, which then differs by the norm's eps alone.
        torch.testing.assert_close(final, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(middle, manual, rtol=0, atol=1e-5)
    # outside a trace, on a plain tensor
    torch.testing.assert_close(model.project_on_vocab(first).detach(), manual, rtol=0, atol=1e-5)


def _steer_hook(plain, path, vector, positions=None):
    def hook(module, args, out):
        hidden = _first(out).clone()
        if positions is None:
            hidden += vector
        else:
            hidden[:, positions] += vector
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    return plain.get_submodule(path).register_forward_hook(hook)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_steer_adds_to_the_residual_stream_in_a_trace_and_at_every_generate_step(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    ids = _ids(model)
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    last = model.num_layers - 1
    handles = [_steer_hook(plain, _paths(model, 0)["layer"], 2 * vector, positions=[1, 2]),
               _steer_hook(plain, _paths(model, last)["layer"], 2 * vector, positions=[1, 2])]
    expected = _run_hooked(plain, handles, ids).logits
    with torch.no_grad(), model.trace(ids):
        model.steer(layers=[last, 0], steering_vector=vector, factor=2, positions=[1, 2])
        logits = model.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)

    steps = 3
    handle = _steer_hook(plain, _paths(model, 0)["layer"], 4 * vector)
    try:
        with torch.no_grad():
            expected_tokens = plain.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    finally:
        handle.remove()
    with torch.no_grad(), model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False) as tracer:
        for _ in tracer.iter[0:steps]:
            model.steer(0, vector, factor=4)
        tokens = tracer.result.save()
    assert tokens.tolist() == expected_tokens.tolist()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_skip_layers_gives_a_forward_without_them(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    ids = _ids(model)
    n = model.num_layers
    start, end = (1, n - 2) if n > 2 else (0, 0)
    inputs: dict = {}
    first = plain.get_submodule(_paths(model, start)["layer"])
    handles = [first.register_forward_pre_hook(
        lambda m, args, kwargs: inputs.__setitem__("h", args[0] if args else kwargs["hidden_states"]), with_kwargs=True,
    )]
    for i in range(start, end + 1):
        handles.append(plain.get_submodule(_paths(model, i)["layer"]).register_forward_hook(
            lambda m, a, out: (inputs["h"], *out[1:]) if isinstance(out, tuple) else inputs["h"]
        ))
    expected = _run_hooked(plain, handles, ids).logits
    with torch.no_grad(), model.trace(ids):
        if start == end:
            model.skip_layer(start)
        else:
            model.skip_layers(start, end)
        logits = model.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_attention_probabilities_are_hf_eager_weights_and_writes_change_the_output(model_type, checkpoint, plains):
    model = StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu", enable_attention_probs=True)
    layers = [i for i, block in enumerate(model.layers) if block.self_attn is not None]
    if not layers:
        pytest.skip(f"{model_type} has no softmax attention")
    plain = plains(model_type, attn_implementation="eager")
    ids = _ids(model)
    with torch.no_grad():
        # Attention weights are [batch, heads, seq, seq]: MiniMax also reports its lightning blocks' states there.
        ref = [w for w in plain(ids, output_attentions=True).attentions if w is not None and w.shape[-2:] == (ids.shape[1],) * 2]
    assert len(ref) == len(layers)
    got: list = []
    with torch.no_grad(), model.trace(ids):
        got.extend(model.layers[i].self_attn.attention_probabilities.save() for i in layers)
    with torch.no_grad(), model.trace(ids):
        by_1x = model.attention_probabilities[layers[0]].save()
    for value, expected in zip(got, ref):
        assert value.shape == (1, model.num_heads, ids.shape[1], ids.shape[1])
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(by_1x, ref[0], rtol=0, atol=0)

    # A write: uniform causal weights. Oracle: HF's eager attention with its softmax replaced by that.
    seq = ids.shape[1]
    uniform = torch.tril(torch.ones(seq, seq)) / torch.arange(1, seq + 1)[:, None]
    modeling = model.family.MODELING
    original = modeling.eager_attention_forward
    target = plain.get_submodule(_paths(model, layers[0])["self_attn"])

    def eager(module, *args, **kwargs):
        if module is not target:
            return original(module, *args, **kwargs)
        real_softmax = torch.nn.functional.softmax
        torch.nn.functional.softmax = lambda x, *a, **k: uniform.expand_as(x).to(x.dtype)
        try:
            return original(module, *args, **kwargs)
        finally:
            torch.nn.functional.softmax = real_softmax

    modeling.eager_attention_forward = eager
    try:
        with torch.no_grad():
            expected = plain(ids).logits
    finally:
        modeling.eager_attention_forward = original
    with torch.no_grad(), model.trace(ids):
        probs = model.layers[layers[0]].self_attn.attention_probabilities
        model.layers[layers[0]].self_attn.attention_probabilities = uniform.expand_as(probs).clone()
        logits = model.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_attention_probabilities_name_the_flag_when_unavailable(load):
    model = load("qwen3_5_text")
    attention = next(i for i, block in enumerate(model.layers) if block.self_attn is not None)
    reason = model.support()["self_attn.attention_probabilities"]
    assert "enable_attention_probs=True" in reason[attention]
    with pytest.raises(Unavailable, match="enable_attention_probs=True"), torch.no_grad(), model.trace(PROMPT):
        model.layers[attention].self_attn.attention_probabilities.save()


def test_the_constructor_takes_1x_keywords_and_refuses_unknown_ones(checkpoint):
    path = str(checkpoint("llama"))
    model = StandardizedTransformer(path, dispatch=True, check_renaming=True, enable_attention_probs=True)
    assert model.attn_probs_available
    with pytest.raises(NnterpError, match="not_a_keyword"):
        StandardizedTransformer(path, not_a_keyword=3)
    assert StandardizedTransformer(path, remote=True).remote  # 1.x's keyword: runs default to NDIF (tests/remote)
    with pytest.raises(NnterpError, match="eager"):
        StandardizedTransformer(path, enable_attention_probs=True, attn_implementation="sdpa")
    StandardizedTransformer(path, num_hidden_layers=1, dtype="float32", allow_dispatch=True)  # a config field, from_pretrained's, 1.x's


@pytest.mark.parametrize("model_type", FAMILIES)
def test_check_renaming_passes_on_every_family(model_type, checkpoint):
    StandardizedTransformer(str(checkpoint(model_type)), check_renaming=True, enable_attention_probs=True)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_cache_is_reachable_under_the_standard_names(model_type, load):
    model = load(model_type)
    outputs: list = []
    try:
        with torch.no_grad(), model.trace(PROMPT) as tracer:
            cache = tracer.cache()
            outputs.extend(model.layers_output[i].save() for i in range(model.num_layers))
    except TypeError as error:
        # nnsight's cache copies each module's output; xLSTM's base-model output class requires a field, so the copy fails.
        if "required positional argument" not in str(error):
            raise
        pytest.skip(f"nnsight's tracer.cache() cannot copy {model_type}'s transformers output: {error}")
    for i, expected in enumerate(outputs):
        torch.testing.assert_close(_first(cache.model.layers[i].output), expected, rtol=0, atol=0)
    assert cache.model.lm_head.output.shape[-1] == model.vocab_size
    assert cache.model.ln_final.output.shape[-1] == model.hidden_size


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logit_lens_is_each_layer_output_through_the_final_norm_and_unembedding(model_type, load, plains):
    from nnterp.interventions import logit_lens

    model, plain = load(model_type), plains(model_type)
    if model.family.PADDING_REFUSED is not None:
        pytest.skip(model.family.PADDING_REFUSED)  # these helpers batch prompts of different lengths
    prompts = [PROMPT, "Hello"]
    probs = logit_lens(model, prompts)
    assert probs.shape == (2, model.num_layers, model.vocab_size)
    with torch.no_grad(), model.trace(prompts):
        batch = model.inputs[1].save()  # left-padded, with the positions the project passes (as generate does)
    paths = [_paths(model, i)["layer"] for i in range(model.num_layers)]
    outputs, hooks = _capture(plain, paths)
    ref = _run_hooked(plain, hooks, **batch)
    norm, head = plain.get_submodule(model.family.LN_FINAL), plain.get_submodule(model.family.LM_HEAD)
    scale = model.family.logits_scale(plain.config)
    with torch.no_grad():
        manual = torch.stack([torch.softmax(_capped(model, head(norm(outputs[path][:, -1])) * scale), -1) for path in paths], 1)
    torch.testing.assert_close(probs[:, :-1], manual[:, :-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(probs[:, -1], torch.softmax(ref.logits[:, -1], -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_token_activations_by_value_and_patchscope(model_type, load):
    from nnterp.interventions import (
        collect_token_activations_batched,
        get_token_activations,
        patchscope_lens,
        repeat_prompt,
    )

    model = load(model_type)
    if model.family.PADDING_REFUSED is not None:
        pytest.skip(model.family.PADDING_REFUSED)  # these helpers batch prompts of different lengths
    prompts = [PROMPT, "Hello", "My favourite food is pizza with", "A"]
    default = collect_token_activations_batched(model, prompts, batch_size=3)
    assert default.shape == (model.num_layers, 4, model.hidden_size)
    specs = ["layer_output", "mlp.mlp_output"] + (["linear_attn.state_output"] if model.family.MIXER else [])
    batched = collect_token_activations_batched(model, prompts, batch_size=3, values=specs, tqdm=True)
    lengths = [len(model.tokenizer(prompt).input_ids) for prompt in prompts]
    for index, prompt in enumerate(prompts):  # each prompt alone: left padding changes nothing
        padded = lengths[index] < max(lengths[index // 3 * 3 : index // 3 * 3 + 3])
        if padded and model.family.PADDING_DIFFERS is not None:
            continue  # transformers' own forward mixes the padding into this row (the contract test checks that)
        alone = get_token_activations(model, prompt, values=specs)
        for spec in specs:
            assert set(alone[spec]) == set(batched[spec]) == {i for i, b in enumerate(model.layers) if spec == "layer_output" or getattr(b, spec.split(".")[0]) is not None}
            for layer, value in alone[spec].items():
                torch.testing.assert_close(batched[spec][layer][index], value[0], rtol=0, atol=1e-4)
        for layer in range(model.num_layers):
            torch.testing.assert_close(default[layer, index], alone["layer_output"][layer][0], rtol=0, atol=1e-4)
    # patchscope at every layer: the target's patched position holds the source's hidden state
    probs = patchscope_lens(model, source_prompts=prompts[:2], target_patch_prompts=repeat_prompt(), layers=[0, model.num_layers - 1])
    assert probs.shape == (2, 2, model.vocab_size)
    with torch.no_grad(), model.trace(repeat_prompt().prompt):
        model.layers_output[model.num_layers - 1][:, -1] = default[model.num_layers - 1, 0]
        expected = model.next_token_probs.save()
    torch.testing.assert_close(probs[0, 1], expected[0], rtol=0, atol=1e-5)


def _hf_softmax_attention(plain, ids) -> bool:
    """Whether transformers' own forward forms softmax attention weights: a ``[batch, heads, seq, seq]`` output whose rows sum to 1."""
    try:
        out = plain(ids, output_attentions=True)
    except (TypeError, ValueError):  # a model without output_attentions
        return False
    seq = ids.shape[1]
    return any(
        a is not None and a.dim() == 4 and a.shape[-2:] == (seq, seq) and torch.allclose(a.sum(-1), torch.ones(()), atol=1e-4)
        for a in (getattr(out, "attentions", None) or ())
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_attn_probs_available_is_true_exactly_where_softmax_attention_runs_eager(model_type, checkpoint):
    path = str(checkpoint(model_type))
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    has_softmax = _hf_softmax_attention(AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval(), ids)
    assert StandardizedTransformer(path, enable_attention_probs=True).attn_probs_available is has_softmax
    default = AutoModelForCausalLM.from_pretrained(path).config.get_text_config()._attn_implementation
    assert StandardizedTransformer(path).attn_probs_available is (has_softmax and default == "eager")
