"""nnterp 1.3.0's public names at their 1.x paths, with 1.x's signatures, and what each does against plain transformers.

`ONEX` is 1.3.0's public names per module, as its source defines them (a
signature's text; ``VALUE`` for a constant or type; a class's ``__init__``
and methods), written here from the 1.3.0 release so CI needs no copy of it.
Oracles: a plain HF forward with forward hooks at the family's paths, HF's
``output_attentions`` under eager attention, HF's greedy ``generate``, and the
tokenizer itself.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest
import torch

from nnterp import StandardizedTransformer
from tests.onex.utils import TEST_MODELS
from tests.suites.checkpoint import OTHER, PROMPT, model_type_params

VALUE = None
ONEX = {
    'standardized_transformer': {
        'StandardizedTransformer': ('model, trust_remote_code=False, check_renaming=True, remote=False, allow_dispatch=True, enable_attention_probs=False, check_attn_probs_with_trace=True, allow_multimodal=False, rename_config=None, **kwargs', {}),
    },
    'nnsight_utils': {
        'GetModuleOutput': VALUE,
        'get_embed_tokens': 'model',
        'get_layers': 'model',
        'get_num_layers': 'nn_model',
        'get_layer': 'nn_model, layer',
        'get_layer_input': 'nn_model, layer',
        'get_layer_output': 'nn_model, layer',
        'get_attention': 'nn_model, layer',
        'get_attention_output': 'nn_model, layer',
        'get_mlp': 'nn_model, layer',
        'get_mlp_output': 'nn_model, layer',
        'get_logits': 'nn_model',
        'get_unembed_norm': 'nn_model',
        'get_unembed': 'nn_model',
        'project_on_vocab': 'nn_model, h',
        'get_next_token_probs': 'nn_model',
        'set_layer_output': 'nn_model, layer, tensor',
        'ModuleAccessor': ('model, rename_config=None, rename=None', {'get_embed_tokens': '', 'get_layers': '', 'get_mlp': 'layer', 'get_attention': 'layer', 'get_unembed_norm': '', 'get_unembed': ''}),
        'get_token_activations': 'nn_model, prompts=None, layers=None, get_activations=None, remote=False, idx=None, tracer=None',
        'collect_last_token_activations_session': 'nn_model, prompts, batch_size, layers=None, get_activations=None, remote=False, idx=None',
        'collect_token_activations_batched': 'nn_model, prompts, batch_size, layers=None, get_activations=None, remote=False, idx=None, tqdm=None, use_session=True',
        'compute_next_token_probs': 'nn_model, prompt, remote=False',
    },
    'prompt_utils': {
        'TokenizationError': (None, {}),
        'get_first_tokens': 'words, llm_or_tokenizer, use_hacky_implementation=False',
        'Prompt': ('prompt, target_tokens, target_strings=None', {'from_strings': 'prompt, target_strings, tokenizer', 'has_no_collisions': 'ignore_targets=None', 'get_target_probs': 'probs, layer=None', 'run': 'nn_model, get_probs'}),
        'next_token_probs_unsqueeze': 'nn_model, prompt, remote=False, **_kwargs',
        'run_prompts': 'nn_model, prompts, batch_size=32, get_probs_func=None, func_kwargs=None, remote=False, tqdm=tqdm',
    },
    'display': {
        'plot_topk_tokens': 'next_token_probs, tokenizer, k=4, title=None, use_token_ids=False, file=None, save_html=True, height=300, width=400',
        'prompts_to_df': 'prompts, tokenizer=None',
    },
    'utils': {
        'TraceTensor': VALUE,
        'NNSIGHT_VERSION': VALUE,
        'TRANSFORMERS_VERSION': VALUE,
        'ArchitectureNotFound': (None, {}),
        'OPTForCausalLM': VALUE,
        'MixtralForCausalLM': VALUE,
        'BloomForCausalLM': VALUE,
        'GPT2LMHeadModel': VALUE,
        'Qwen2MoeForCausalLM': VALUE,
        'DbrxForCausalLM': VALUE,
        'GPTJForCausalLM': VALUE,
        'LlamaForCausalLM': VALUE,
        'Qwen3ForCausalLM': VALUE,
        'Qwen2ForCausalLM': VALUE,
        'is_notebook': '',
        'display_markdown': 'text',
        'display_source': 'source',
        'DummyCache': (None, {'to_legacy_cache': ''}),
        'dummy_inputs': '',
        'try_with_scan': 'model, function, error_to_throw, allow_dispatch, warn_if_scan_fails=True, errors_to_raise=None',
        'unpack_tuple': 'tensor_or_tuple',
    },
    'rename_utils': {
        'IgnoreType': VALUE,
        'RenamingError': (None, {}),
        'AttnProbFunction': (None, {'get_attention_prob_source': 'attention_module, return_module_source=False', '__call__': 'attention_module, return_module_source=False'}),
        'RenameConfig': ('attn_name=None, mlp_name=None, ln_final_name=None, lm_head_name=None, model_name=None, layers_name=None, attn_prob_source=None, ignore_mlp=None, ignore_attn=None, attn_head_config_key=None, hidden_size_config_key=None, vocab_size_config_key=None', {}),
        'MODEL_NAMES': VALUE,
        'expand_path_with_model': 'paths',
        'default_attn_head_config_keys': '',
        'default_hidden_size_config_keys': '',
        'default_vocab_size_config_keys': '',
        'IGNORE_MLP_MODELS': VALUE,
        'ATTENTION_NAMES': VALUE,
        'LAYER_NAMES': VALUE,
        'LN_NAMES': VALUE,
        'LM_HEAD_NAMES': VALUE,
        'MLP_NAMES': VALUE,
        'EMBED_TOKENS_NAMES': VALUE,
        'get_rename_dict': 'rename_config=None',
        'text_config': 'model',
        'get_num_attention_heads': 'model, raise_error=True, rename_config=None',
        'get_hidden_size': 'model, raise_error=True, rename_config=None',
        'get_vocab_size': 'model, raise_error=True, rename_config=None',
        'IOType': (None, {}),
        'LayerAccessor': ('model, attr_name, io_type', {'get_module': 'layer', '__getitem__': 'layer', '__setitem__': 'layer, value', '__call__': 'layer', 'returns_tuple': 'property'}),
        'bloom_attention_prob_source': 'attention_module, return_module_source=False',
        'default_attention_prob_source': 'attention_module, return_module_source=False',
        'gpt2_attention_prob_source': 'attention_module, return_module_source=False',
        'gptj_attention_prob_source': 'attention_module, return_module_source=False',
        'AttentionProbabilitiesAccessor': ('model, rename_config=None, initialized_with_enable=False', {'disable': '', '__getitem__': 'layer', '__setitem__': 'layer, value', 'check_source': 'layer=0, allow_dispatch=True, use_trace=True', 'print_source': 'layer=0, allow_dispatch=True'}),
        'get_ignores': 'model, rename_config=None',
        'check_io': 'std_model, model_name, ignores',
        'check_model_renaming': 'std_model, model_name, ignores, allow_dispatch, allow_multimodal=False',
    },
    'interventions': {
        'logit_lens': 'nn_model, prompts, remote=False, return_inv_logits=False',
        'TargetPrompt': ('prompt, index_to_patch', {}),
        'repeat_prompt': "words=None, rel=' ', sep='\\n', placeholder='?', index_to_patch=-1",
        'it_repeat_prompt': "tokenizer, words=None, rel=' ', sep='\\n', placeholder='?', complete_prompt=True, add_user_instr=True, use_system_prompt=True",
        'TargetPromptBatch': ('prompts, index_to_patch', {'from_target_prompts': 'prompts_', 'from_target_prompt': 'prompt, batch_size', 'from_prompts': 'prompts, index_to_patch', '__len__': '', '__getitem__': 'idx', '__iter__': '', 'auto': 'target_prompt, batch_size'}),
        'patchscope_lens': 'nn_model, source_prompts=None, target_patch_prompts=None, layers=None, latents=None, remote=False',
        'patchscope_generate': 'nn_model, prompts, target_patch_prompt, max_length=50, layers=None, remote=False, max_batch_size=32',
        'patch_object_attn_lens': 'nn_model, source_prompts, target_prompts, attn_idx_patch, num_patches=5',
    },
    'logging': {
        'logger': VALUE,
    },
}

#: 1.x signatures nnterp 2 changes on purpose (docs/coming-from-1x.md): the constructor is keyword-only after
#: ``model`` (1.x's keywords pass through ``**kwargs``; ``check_renaming`` is off by default).
DELIBERATE = {("standardized_transformer", "StandardizedTransformer")}


def _expected(text: str) -> list:
    """``[(name, default source or None)]`` of a signature's text (``*args`` / ``**kwargs`` keep their stars)."""
    args = ast.parse(f"def f({text}): pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    found = [(a.arg, None if d is None else ast.unparse(d)) for a, d in zip(positional, defaults)]
    found += [("*" + args.vararg.arg, None)] if args.vararg else []
    found += [(a.arg, None if d is None else ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return found + ([("**" + args.kwarg.arg, None)] if args.kwarg else [])


def _same_default(live, source: str, namespace: dict) -> bool:
    try:
        return live == ast.literal_eval(source)
    except ValueError:  # a name (``tqdm``): the object it names in the module
        return live is namespace.get(source)


def _problems(signature: inspect.Signature, text: str, namespace: dict) -> list:
    """How ``signature`` fails to take every call 1.x's ``text`` took: same names in the same order, same defaults."""
    live = list(signature.parameters.values())
    problems = []
    for i, (name, default) in enumerate(_expected(text)):
        if name.startswith("**"):
            if not any(p.kind is p.VAR_KEYWORD for p in live):
                problems.append(f"no {name}")
            continue
        if i >= len(live) or live[i].name != name.lstrip("*"):
            problems.append(f"parameter {i} is {live[i].name if i < len(live) else 'missing'}, 1.x's is {name}")
            continue
        if default is not None and not _same_default(live[i].default, default, namespace):
            problems.append(f"{name}'s default is {live[i].default!r}, 1.x's {default}")
    extra = [p for p in live[len(_expected(text)):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return problems + [f"new required parameter {p.name}" for p in extra]


def _method_signature(cls: type, name: str) -> inspect.Signature:
    static = inspect.getattr_static(cls, name)
    if isinstance(static, (staticmethod, classmethod)):
        return inspect.signature(getattr(cls, name))
    signature = inspect.signature(static)
    return signature.replace(parameters=list(signature.parameters.values())[1:])  # drop self


NAMES = [(module, name) for module, names in ONEX.items() for name in names]


@pytest.mark.parametrize(("module", "name"), NAMES, ids=[f"{m}.{n}" for m, n in NAMES])
def test_every_1x_name_imports_from_its_1x_module_with_a_compatible_signature(module, name):
    namespace = vars(importlib.import_module(f"nnterp.{module}"))
    found = namespace[name] if name in namespace else getattr(importlib.import_module(f"nnterp.{module}"), name)
    spec = ONEX[module][name]
    if spec is VALUE:
        return
    if isinstance(spec, str):
        problems = _problems(inspect.signature(found), spec, namespace)
        assert not problems, problems
        return
    init, methods = spec
    assert isinstance(found, type)
    if (module, name) in DELIBERATE:
        parameters = list(inspect.signature(found).parameters.values())
        assert parameters[0].name == "model" and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD
        return
    if init is not None:
        problems = _problems(inspect.signature(found), init, namespace)
        assert not problems, problems
    for method, text in methods.items():
        if text == "property":
            assert isinstance(inspect.getattr_static(found, method), property), method
        else:
            problems = _problems(_method_signature(found, method), text, namespace)
            assert not problems, (method, problems)


def test_the_1x_top_level_names_and_modules_import_lazily():
    import nnterp
    from nnterp.nnsight_utils import ModuleAccessor
    from nnterp.rename_utils import get_rename_dict

    assert nnterp.get_rename_dict is get_rename_dict and nnterp.ModuleAccessor is ModuleAccessor
    assert {"get_rename_dict", "ModuleAccessor"} <= set(nnterp.__all__)
    from nnterp.standardized_transformer import StandardizedTransformer as Old

    assert Old is StandardizedTransformer
    code = "import sys, nnterp; print(sorted(m for m in sys.modules if m in {names}))".format(
        names=sorted(f"nnterp.{m}" for m in set(ONEX) - {"interventions"})
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# -- nnsight_utils, on a StandardizedTransformer of each family and on a plain nnsight LanguageModel


ONEX_FAMILIES = model_type_params(TEST_MODELS)  # the families the ported 1.x suite runs on


def _hooked(plain, paths: dict, *args, pre: dict | None = None, **kwargs):
    """``(plain(*args, **kwargs), {key: module output (its first element), "input": the input of paths["layer"]})``.

    ``pre``: ``{path: fn(hidden) -> hidden}`` replacing a module's input.
    """
    outputs, hooks = {}, []
    for key, path in paths.items():
        hooks.append(plain.get_submodule(path).register_forward_hook(
            lambda m, a, out, key=key: outputs.__setitem__(key, (out[0] if isinstance(out, tuple) else out).clone())))

    def swap(fn):
        def hook(module, args, kw):
            if args:
                return (fn(args[0]), *args[1:]), kw
            return args, {**kw, "hidden_states": fn(kw["hidden_states"])}
        return hook

    def record(module, args, kw):
        outputs["input"] = (args[0] if args else kw["hidden_states"]).clone()

    hooks.append(plain.get_submodule(paths["layer"]).register_forward_pre_hook(record, with_kwargs=True))
    for path, fn in (pre or {}).items():
        hooks.append(plain.get_submodule(path).register_forward_pre_hook(swap(fn), with_kwargs=True))
    try:
        with torch.no_grad():
            return plain(*args, **kwargs), outputs
    finally:
        for hook in hooks:
            hook.remove()


def _part_paths(model, layer: int) -> dict:
    paths = {"layer": f"{model.family.LAYERS}.{layer}"}
    if model.attentions[layer] is not None:
        paths["mixer"] = model.attentions[layer].path.removeprefix("model.")
    if model.mlps[layer] is not None:
        paths["mlp"] = model.mlps[layer].path.removeprefix("model.")
    return paths


@pytest.mark.parametrize("model_type", ONEX_FAMILIES)
def test_nnsight_utils_read_and_write_what_hf_computes(model_type, load, plains):
    from nnterp import nnsight_utils as nu

    model, plain = load(model_type), plains(model_type)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    last = nu.get_num_layers(model) - 1
    assert nu.get_num_layers(model) == len(plain.get_submodule(model.family.LAYERS))
    assert nu.get_layer(model, 1) is nu.get_layers(model)[1] is model.layers[1]
    assert type(nu.get_unembed_norm(model)._module) is type(plain.get_submodule(model.family.LN_FINAL))
    assert type(nu.get_unembed(model)._module) is type(plain.get_submodule(model.family.LM_HEAD))
    assert nu.get_attention(model, 0) is model.attentions[0] and nu.get_mlp(model, 0) is model.mlps[0]
    paths = _part_paths(model, 0)
    read: dict = {}
    with torch.no_grad(), model.trace(ids):
        read["embed"] = nu.get_embed_tokens(model).output.save()
        read["input"] = nu.get_layer_input(model, 0).save()
        if "mixer" in paths:
            read["mixer"] = nu.get_attention_output(model, 0).save()
        if "mlp" in paths:
            read["mlp"] = nu.get_mlp_output(model, 0).save()
        read["layer"] = nu.get_layer_output(model, 0).save()
        read["last"] = nu.get_layer_output(model, last).save()
        read["projected"] = nu.project_on_vocab(model, read["last"]).save()
        read["logits"] = nu.get_logits(model).save()
        read["probs"] = nu.get_next_token_probs(model).save()
    out, hooked = _hooked(plain, paths, ids)
    torch.testing.assert_close(read["input"], hooked["input"])
    torch.testing.assert_close(read["embed"], plain.get_submodule(model.family.EMBED_TOKENS)(ids))
    for key in paths:
        torch.testing.assert_close(read[key], hooked[key])
    torch.testing.assert_close(read["logits"], out.logits)
    torch.testing.assert_close(read["projected"], out.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(read["probs"], out.logits[:, -1].softmax(-1))

    replacement = torch.randn_like(read["layer"])
    with torch.no_grad(), model.trace(ids):
        nu.set_layer_output(model, 0, replacement)
        written = nu.get_logits(model).save()
    oracle = plain.get_submodule(paths["layer"]).register_forward_hook(
        lambda m, a, o: (replacement, *o[1:]) if isinstance(o, tuple) else replacement)
    try:
        with torch.no_grad():
            expected = plain(ids).logits
    finally:
        oracle.remove()
    torch.testing.assert_close(written, expected)


def _last_token_outputs(model, plain, prompts, layers) -> torch.Tensor:
    """``[layers, prompts, hidden]``: HF's block outputs at the last token (prompts of one length: no padding)."""
    batch = model.tokenizer(prompts, return_tensors="pt")
    paths = {layer: f"{model.family.LAYERS}.{layer}" for layer in layers}
    _, hooked = _hooked(plain, {**paths, "layer": paths[layers[0]]}, **batch)
    return torch.stack([hooked[layer][:, -1] for layer in layers])


@pytest.mark.parametrize("model_type", ONEX_FAMILIES)
def test_token_activations_are_1x_layers_by_prompts_tensors(model_type, load, plains):
    from nnterp import nnsight_utils as nu

    model, plain = load(model_type), plains(model_type)
    prompts, layers = [PROMPT, OTHER, "Hello"], list(range(model.num_layers))
    acts = nu.get_token_activations(model, prompts)
    assert acts.shape == (model.num_layers, 3, model.hidden_size) and acts.device.type == "cpu"
    alone = torch.cat([_last_token_outputs(model, plain, [p], layers) for p in prompts], dim=1)
    torch.testing.assert_close(acts, alone, atol=1e-4, rtol=1e-4)  # left-padded together: each as if alone
    torch.testing.assert_close(nu.get_token_activations(nn_model=model, prompts=prompts, layers=[-1, 0]), acts[[-1, 0]])
    with torch.no_grad(), model.trace(prompts) as tracer:
        inside = nu.get_token_activations(model, tracer=tracer).save()
    torch.testing.assert_close(inside, acts)
    torch.testing.assert_close(nu.collect_token_activations_batched(model, prompts, 1), alone)
    torch.testing.assert_close(nu.collect_last_token_activations_session(model, prompts, 1), alone)
    with pytest.raises(ValueError, match="right padding"):
        nu.get_token_activations(model, prompts, idx=1)
    with pytest.raises(ValueError, match="prompts must be provided"):
        nu.get_token_activations(model)
    probs = nu.compute_next_token_probs(model, prompts)
    with torch.no_grad():
        expected = torch.cat([plain(**model.tokenizer([p], return_tensors="pt")).logits[:, -1].softmax(-1) for p in prompts])
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore::nnsight.NNsightDeprecationWarning")  # nnsight 0.8 deprecates LanguageModel; 1.x code builds one
def test_nnsight_utils_on_a_plain_language_model_read_the_1x_paths(checkpoint, plains):
    from nnsight import LanguageModel

    from nnterp import nnsight_utils as nu

    raw, plain = LanguageModel(str(checkpoint("llama")), dispatch=True), plains("llama")
    ids = raw.tokenizer(PROMPT, return_tensors="pt").input_ids
    assert nu.get_num_layers(raw) == len(plain.model.layers) and nu.get_layer(raw, 1) is raw.model.layers[1]
    read: dict = {}
    with torch.no_grad(), raw.trace(ids):
        read["input"] = nu.get_layer_input(raw, 0).save()
        read["mixer"] = nu.get_attention_output(raw, 0).save()
        read["mlp"] = nu.get_mlp_output(raw, 0).save()
        read["layer"] = nu.get_layer_output(raw, 0).save()
        read["projected"] = nu.project_on_vocab(raw, nu.get_layer_output(raw, 1)).save()
        read["probs"] = nu.get_next_token_probs(raw).save()
    out, hooked = _hooked(plain, {"layer": "model.layers.0", "mixer": "model.layers.0.self_attn", "mlp": "model.layers.0.mlp"}, ids)
    for key in ("input", "mixer", "mlp", "layer"):
        torch.testing.assert_close(read[key], hooked[key])
    torch.testing.assert_close(read["projected"], out.logits)
    torch.testing.assert_close(read["probs"], out.logits[:, -1].softmax(-1))
    prompts = [PROMPT, OTHER]
    standard = StandardizedTransformer(str(checkpoint("llama")), dispatch=True, device="cpu")
    torch.testing.assert_close(nu.get_token_activations(raw, prompts), nu.get_token_activations(standard, prompts))


@pytest.mark.parametrize("model_type", ONEX_FAMILIES)
def test_module_accessor_gives_the_hf_modules_under_the_standard_names(model_type, load, plains):
    from nnterp import ModuleAccessor

    model, plain = load(model_type), plains(model_type)
    family = model.family
    access = ModuleAccessor(plain)
    assert access.get_layers() is access.layers is plain.get_submodule(family.LAYERS)
    assert access.get_embed_tokens() is plain.get_submodule(family.EMBED_TOKENS)
    assert access.get_unembed_norm() is access.ln_final is plain.get_submodule(family.LN_FINAL)
    assert access.get_unembed() is plain.get_submodule(family.LM_HEAD)
    for layer in range(model.num_layers):
        for part, get in (("self_attn", access.get_attention), ("mlp", access.get_mlp)):
            envoy = getattr(model.layers[layer], part)
            if envoy is not None and envoy.path.rpartition(".")[2] in (part, "attn", "mlp"):
                assert get(layer) is plain.get_submodule(envoy.path.removeprefix("model."))
    with pytest.raises(AttributeError):
        access.config  # not a module


# -- rename_utils, utils


def test_rename_dict_and_config_lookups_follow_1x_definitions(plains):
    from nnterp.rename_utils import (
        MODEL_NAMES,
        RenameConfig,
        RenamingError,
        expand_path_with_model,
        get_hidden_size,
        get_num_attention_heads,
        get_rename_dict,
        get_vocab_size,
        text_config,
    )

    assert expand_path_with_model(["h", "model.x"]) == ["h", "model.x"] + [f"model.{name}.x" for name in MODEL_NAMES]
    renamed = get_rename_dict(RenameConfig(attn_name=["a", "b"], layers_name="blocks_here", lm_head_name="out"))
    assert {k: renamed[k] for k in ("a", "b", "blocks_here", "out")} == {"a": "self_attn", "b": "self_attn", "blocks_here": "layers", "out": "lm_head"}
    assert renamed["model.layers"] == "layers" and renamed["model.transformer.ln_final"] == "ln_final" and renamed["wte"] == "embed_tokens"
    plain = plains("llama")
    config = plain.config
    assert text_config(plain) is config
    assert get_num_attention_heads(plain) == config.num_attention_heads and get_hidden_size(plain) == config.hidden_size
    assert get_vocab_size(plain) == config.vocab_size
    assert get_hidden_size(plain, rename_config=RenameConfig(hidden_size_config_key=7)) == 7
    assert get_num_attention_heads(plain, rename_config=RenameConfig(attn_head_config_key="intermediate_size")) == config.num_attention_heads
    mamba = plains("mamba")
    assert get_num_attention_heads(mamba, raise_error=False) is None
    with pytest.raises(RenamingError) and pytest.raises(ValueError):
        get_num_attention_heads(mamba)


@pytest.mark.parametrize("model_type", model_type_params(["gpt2", "llama"]))
def test_1x_layer_accessor_and_renaming_check_on_a_standardized_transformer(model_type, load, plains):
    from nnterp.rename_utils import IOType, LayerAccessor, check_model_renaming, get_ignores

    model, plain = load(model_type), plains(model_type)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    mlp_out, attn_out = LayerAccessor(model, "mlp", IOType.OUTPUT), LayerAccessor(model, "self_attn", IOType.OUTPUT)
    layer_out = LayerAccessor(model, None, IOType.OUTPUT)
    replacement = torch.randn(ids.shape[1], model.hidden_size)
    read: dict = {}
    with torch.no_grad(), model.trace(ids):
        read["mixer"] = attn_out[0].save()
        read["mlp"] = mlp_out[0].save()
        layer_out[0] = replacement[None]
        read["logits"] = model.logits.save()
    assert attn_out.returns_tuple is True and layer_out.returns_tuple is None  # detected on a read, as in 1.x
    assert LayerAccessor(model, "mlp", None)[0] is model.layers[0].mlp
    paths = _part_paths(model, 0)
    _, hooked = _hooked(plain, paths, ids)
    torch.testing.assert_close(read["mixer"], hooked["mixer"])
    torch.testing.assert_close(read["mlp"], hooked["mlp"])
    hook = plain.get_submodule(paths["layer"]).register_forward_hook(lambda m, a, o: (replacement[None], *o[1:]) if isinstance(o, tuple) else replacement[None])
    try:
        with torch.no_grad():
            expected = plain(ids).logits
    finally:
        hook.remove()
    torch.testing.assert_close(read["logits"], expected)
    assert get_ignores(plain) == []
    check_model_renaming(model, model_type, [], allow_dispatch=True)


@pytest.mark.parametrize("model_type", model_type_params(["gpt2", "llama"]))
def test_1x_attention_probabilities_accessor_reads_hf_eager_weights(model_type, checkpoint, plains):
    import nnsight

    from nnterp.rename_utils import AttentionProbabilitiesAccessor, RenamingError, get_rename_dict

    plain = plains(model_type, attn_implementation="eager")
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        expected = plain(ids, output_attentions=True).attentions
    standard = StandardizedTransformer(str(checkpoint(model_type)), dispatch=True, device="cpu", enable_attention_probs=True)
    raw = nnsight.TransformersModel(  # renamed as 1.x's StandardizedTransformer renamed
        str(checkpoint(model_type)), task="text-generation", dispatch=True, attn_implementation="eager", rename=get_rename_dict()
    )
    for model in (standard, raw):
        probs = AttentionProbabilitiesAccessor(model)
        with torch.no_grad(), model.trace(ids):
            got = probs[1].save()
        torch.testing.assert_close(got, expected[1])
    AttentionProbabilitiesAccessor(standard).check_source()
    disabled = AttentionProbabilitiesAccessor(standard)
    disabled.disable()
    with pytest.raises(RenamingError, match="enable_attention_probs=True"), torch.no_grad(), standard.trace(ids):
        disabled[0]


def test_1x_utils(load):
    import transformers

    from nnterp import utils

    assert utils.LlamaForCausalLM is transformers.LlamaForCausalLM and utils.TraceTensor is torch.Tensor
    assert utils.NNSIGHT_VERSION and utils.TRANSFORMERS_VERSION == transformers.__version__
    assert utils.unpack_tuple((1, 2)) == 1 and utils.unpack_tuple(3) == 3 and utils.DummyCache().to_legacy_cache() is None
    assert utils.dummy_inputs()["input_ids"].tolist() == [[0, 1, 1]] and utils.is_notebook() is False
    model = load("llama")
    seen = []
    assert utils.try_with_scan(model, lambda: seen.append(tuple(model.layers_output[0].shape)), ValueError("no"), True) is True
    assert seen == [(1, 3, model.hidden_size)]

    def broken():
        raise KeyError("x")

    with pytest.raises(ValueError, match="no"):
        utils.try_with_scan(model, broken, ValueError("no"), True, warn_if_scan_fails=False)
    from nnterp.logging import logger

    assert logger.name == "nnterp" and logger.handlers


# -- prompt_utils, display


def test_first_tokens_prompts_and_run_prompts(load, plains):
    from transformers import AutoTokenizer

    from nnterp.prompt_utils import Prompt, get_first_tokens, next_token_probs_unsqueeze, run_prompts

    model, plain = load("llama"), plains("llama")
    bare = AutoTokenizer.from_pretrained(model.tokenizer.name_or_path, add_prefix_space=False)
    first = lambda text: bare(text, add_special_tokens=False).input_ids[0]  # noqa: E731
    expected = list(dict.fromkeys([first("Paris"), first(" Paris"), first("city"), first(" city")]))
    assert get_first_tokens(["Paris", "city"], model) == expected == get_first_tokens(["Paris", "city"], bare)
    prompts = [Prompt.from_strings(PROMPT, {"city": "Paris", "other": ["London", "Rome"]}, model), Prompt.from_strings(OTHER, "cheese", model)]
    assert prompts[0].target_tokens["city"] == get_first_tokens("Paris", model) and prompts[1].target_strings == {"target": "cheese"}
    assert Prompt("x", {"a": [1, 2], "b": [2]}).has_no_collisions() is False and Prompt("x", {"a": [1, 2], "b": [2]}).has_no_collisions("b")
    same = [Prompt.from_strings(p, {"city": "Paris", "food": "cheese"}, model) for p in (PROMPT, OTHER)]
    found = run_prompts(model, same, batch_size=1, tqdm=None)
    with torch.no_grad():
        probs = torch.stack([plain(**model.tokenizer(p.prompt, return_tensors="pt")).logits[0, -1].softmax(-1) for p in same])
    for target in ("city", "food"):
        oracle = torch.stack([probs[i, p.target_tokens[target]].sum() for i, p in enumerate(same)])[:, None]
        torch.testing.assert_close(found[target], oracle, atol=1e-6, rtol=1e-4)
    assert next_token_probs_unsqueeze(model, [PROMPT]).shape == (1, 1, model.vocab_size)
    per_layer = torch.rand(1, 3, model.vocab_size)
    torch.testing.assert_close(same[0].get_target_probs(per_layer)["city"], per_layer[:, :, same[0].target_tokens["city"]].sum(-1))
    with pytest.raises(ValueError, match="same target keys"):
        run_prompts(model, [same[0], prompts[1]], tqdm=None)


def test_display_plots_the_top_tokens_and_tabulates_prompts(load, tmp_path, monkeypatch):  # plotly, pandas: in the test extra
    import plotly.basedatatypes

    from nnterp.display import plot_topk_tokens, prompts_to_df
    from nnterp.prompt_utils import Prompt

    shown = []
    monkeypatch.setattr(plotly.basedatatypes.BaseFigure, "show", lambda self, *a, **k: shown.append(self))
    model = load("llama")
    probs = torch.rand(4, 2, model.vocab_size).softmax(-1)
    fig = plot_topk_tokens(probs, model.tokenizer, k=3, file=tmp_path / "top.html")
    assert shown == [fig] and len(fig.data) == 4 and (tmp_path / "top.html").is_file()
    top = torch.topk(probs[1], k=3, dim=-1)
    assert [list(row) for row in fig.data[1].z] == top.values.tolist()
    assert fig.data[1].text[0][0] == "'" + model.tokenizer.convert_ids_to_tokens(int(top.indices[0, 0])) + "'"
    prompt = Prompt.from_strings(PROMPT, {"city": "Paris"}, model)
    table = prompts_to_df([prompt], model.tokenizer)
    assert table[0]["prompt"] == PROMPT and table[0]["city_string"] == "Paris"
    assert table[0]["city_tokens"] == model.tokenizer.convert_ids_to_tokens(prompt.target_tokens["city"])


def test_display_without_its_extra_names_the_install(monkeypatch):
    from nnterp.display import plot_topk_tokens, prompts_to_df

    monkeypatch.setitem(sys.modules, "plotly", None)
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"nnterp\[display\]"):
        plot_topk_tokens(torch.rand(5), None)
    with pytest.raises(ImportError, match=r"nnterp\[display\]"):
        prompts_to_df([])


# -- interventions: 1.x's three helpers nnterp 2 lacked, and 1.x's keyword


CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if not loop.last %}</{{ m['role'] }}>{% endif %}{% endfor %}"


def test_it_repeat_prompt_puts_the_repeat_prompt_in_the_chat_template(load):
    from nnterp.interventions import it_repeat_prompt, repeat_prompt

    tokenizer = load("llama").tokenizer
    tokenizer.chat_template = CHAT
    try:
        plain = repeat_prompt().prompt
        target = it_repeat_prompt(tokenizer)
        assert target.index_to_patch == -1 and target.prompt.startswith("<system>You are a helpful assistant.</system><user>I will")
        assert target.prompt.endswith(f"<user>{plain}</user><assistant>{plain}")
        assert it_repeat_prompt(tokenizer, complete_prompt=False).prompt.endswith(f"<user>{plain}</user><assistant>")
        bare = it_repeat_prompt(tokenizer, words=["a"], add_user_instr=False, use_system_prompt=False).prompt
        assert bare == "<user>Guess the next word in the following sentence (answer only the next word): a a\n?</user><assistant>a a\n?"
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize("model_type", ONEX_FAMILIES)
def test_patchscope_generate_is_hf_greedy_with_the_source_hidden_state_patched_in(model_type, load, plains):
    from nnterp.interventions import TargetPrompt, patchscope_generate

    model, plain = load(model_type), plains(model_type)
    target = TargetPrompt("king king\n1135 1135\nhello hello\n?", index_to_patch=-1)
    sources = [PROMPT, OTHER]
    got = patchscope_generate(model, sources, target, max_length=3, layers=[1, 0], max_batch_size=2)
    assert sorted(got) == [0, 1]
    ids = model.tokenizer(target.prompt, return_tensors="pt").input_ids
    for layer in (0, 1):
        path = f"{model.family.LAYERS}.{layer}"
        for row, source in enumerate(sources):
            _, hooked = _hooked(plain, {"layer": path}, **model.tokenizer(source, return_tensors="pt"))
            latent = hooked["layer"][0, -1]

            def patch(module, args, out, latent=latent):
                hidden = out[0] if isinstance(out, tuple) else out
                if hidden.shape[1] > 1:  # the prompt's forward, not a decode step
                    hidden = hidden.clone()
                    hidden[:, -1] = latent
                return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

            hook = plain.get_submodule(path).register_forward_hook(patch)
            try:
                with torch.no_grad():
                    expected = plain.generate(ids, max_new_tokens=3, do_sample=False)
            finally:
                hook.remove()
            assert got[layer][row].tolist() == expected[0].tolist(), (layer, row)


@pytest.mark.parametrize("model_type", model_type_params(["gpt2", "llama"]))
def test_patch_object_attn_lens_patches_the_attention_inputs_as_hf_would(model_type, load, plains):
    from nnterp.interventions import patch_object_attn_lens

    model, plain = load(model_type), plains(model_type)
    got = patch_object_attn_lens(model, PROMPT, OTHER, attn_idx_patch=2, num_patches=1)
    assert got.shape == (1, model.num_layers, model.vocab_size)
    attention = {layer: model.attentions[layer].path.removeprefix("model.") for layer in range(model.num_layers)}
    inputs = {}
    hooks = [plain.get_submodule(path).register_forward_pre_hook(
        lambda m, a, kw, layer=layer: inputs.__setitem__(layer, (a[0] if a else kw["hidden_states"])[:, -1].clone()), with_kwargs=True)
        for layer, path in attention.items()]
    try:
        with torch.no_grad():
            plain(**model.tokenizer(PROMPT, return_tensors="pt"))
    finally:
        for hook in hooks:
            hook.remove()
    for layer in range(model.num_layers):

        def swap(hidden, layer=layer):
            hidden = hidden.clone()
            hidden[:, 2] = inputs[layer]
            return hidden

        out, _ = _hooked(plain, {"layer": f"{model.family.LAYERS}.0"}, **model.tokenizer(OTHER, return_tensors="pt"), pre={attention[layer]: swap})
        torch.testing.assert_close(got[0, layer], out.logits[0, -1].softmax(-1), atol=1e-6, rtol=1e-4)


def test_logit_lens_and_patchscope_lens_take_1x_nn_model_keyword(load):
    from nnterp.interventions import logit_lens, patchscope_lens

    model = load("llama")
    torch.testing.assert_close(logit_lens(nn_model=model, prompts=[PROMPT]), logit_lens(model, [PROMPT]))
    torch.testing.assert_close(patchscope_lens(nn_model=model, source_prompts=[PROMPT], layers=1), patchscope_lens(model, [PROMPT], layers=1))
