"""`GatedDeltaNetSuite`: the oracle checks every gated-DeltaNet family (and Kimi's delta attention) passes, on any transformers release.

A family's test file mixes it in and names its checkpoint::

    class TestQwen3Next(GatedDeltaNetSuite):
        MODEL_TYPE = "qwen3_next"

Every check compares what nnterp reads or writes on a family's ``linear_attn``
with an oracle that does not use nnterp: transformers' own cache after a plain
forward over each prefix (`hf_oracles.prefix_states`), a plain forward continued
token by token from a replaced cached state (`hf_oracles.continue_from_state`),
a plain greedy loop with a state replaced before a decode step
(`hf_oracles.greedy`), and the recurrence written from the paper
(`recurrences.gated_delta_rule`, `recurrences.kimi_delta_attention`).

The ``assert_*`` functions take the standardized model, the plain transformers
model and the prompt ids, for a family's own tests to call with other arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import StandardizedTransformer
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.testing import tiny_config, tiny_tokenizer
from tests.reference import hf_oracles as hf
from tests.reference.recurrences import gated_delta_rule, kimi_delta_attention
from tests.suites.checkpoint import PROMPT, CheckpointFixtures

NEW = 4
#: Values read inside the token-by-token kernel, served only after ``route_kernels(family, "torch")``.
PER_TOKEN = ("state", "states")


# -- helpers ----------------------------------------------------------------------------


def recurrent_layers(model) -> list[int]:
    """Indices of the blocks with a ``linear_attn``."""
    return [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]


def donor_state(model, layer: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    """A random float32 state of layer ``layer``'s shape, ``[1, mixer_heads, key_dim, value_dim]``."""
    dims = model.layers[layer].linear_attn.dims()
    shape = (1, dims["mixer_heads"], dims["key_dim"], dims["value_dim"])
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def reference_recurrence(model) -> Callable:
    """The paper's recurrence for a family's mixer: a decay per key channel (Kimi) or per head."""
    from nnterp.components.kimi_delta_attention import KimiDeltaAttention

    return kimi_delta_attention if issubclass(model.family.MIXER, KimiDeltaAttention) else gated_delta_rule


def greedy(plain, ids, new, patch=None):
    """The plain greedy loop, never choosing EOS (``generate`` runs with ``min_new_tokens``)."""
    return hf.greedy(plain, ids, new, patch=patch, suppress_tokens=(plain.config.get_text_config().eos_token_id,))


# -- checks --------------------------------------------------------------------------------


def assert_support_serves_every_value(model) -> None:
    """Every value `LinearAttention` serves on Qwen3.5 is declared and served: ``support()`` is ``None`` for each.

    The per-token ones (`PER_TOKEN`) only after ``route_kernels(family, "torch")``,
    and before it they say so.
    """
    mixers = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    assert mixers, "a recurrent family has recurrent blocks"
    names = set(type(mixers[0]).values())
    assert set(LinearAttention.values()) <= names, set(LinearAttention.values()) - names
    support = model.support()
    for name in names:
        entry = support[f"linear_attn.{name}"]
        if name in PER_TOKEN:
            assert entry is not None and all("route_kernels" in reason for reason in entry.values()), name
        else:
            assert entry is None, f"linear_attn.{name}: {entry}"
    with nnterp.route_kernels(model.family, "torch"):
        support = model.support()
        for name in names:
            assert support[f"linear_attn.{name}"] is None, f"routed linear_attn.{name}: {support[f'linear_attn.{name}']}"


def assert_layer_map_follows_the_config(model_type: str, layer_types: list[str]) -> None:
    """A model built from the family's tiny config with ``layer_types`` has its mixers where they say."""
    config = tiny_config(model_type).get_text_config()
    config.layer_types = list(layer_types)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = AutoModelForCausalLM.from_config(config).eval()
    model = StandardizedTransformer(built, tokenizer=tiny_tokenizer())
    expected = {"linear_attention": "linear_attn", "full_attention": "self_attn"}
    for index, (layer, kind) in enumerate(zip(model.layers, layer_types)):
        other = {"linear_attn": "self_attn", "self_attn": "linear_attn"}[expected[kind]]
        assert getattr(layer, expected[kind]) is not None, f"layer {index} ({kind})"
        assert getattr(layer, other) is None, f"layer {index} ({kind}) has no {other}"
    assert [set(parts) for parts in model.family.layer_parts(config)] == [set(layer.parts()) for layer in model.layers]


def assert_states_equal_the_cache_after_each_prefix(model, plain, ids, layer: int) -> None:
    """``states`` (routed) equals the HF cache after a plain forward over each prefix; its last is ``state_output``."""
    mix = model.layers[layer].linear_attn
    with torch.no_grad(), model.trace(ids):
        states = mix.states.save()
        final = mix.state_output.save()
    expected = hf.prefix_states(plain, ids, layer)
    torch.testing.assert_close(states, expected, rtol=1e-5, atol=1e-6, msg=f"layer {layer}: states vs HF cache per prefix")
    assert torch.equal(states[:, -1], final)


def assert_kernel_arguments_reproduce_states(model, layer: int, recurrence: Callable | None = None) -> dict:
    """The kernel's arguments as served (q, k, v, β, g), fed to the paper's recurrence, give ``states`` and the kernel's output.

    Returns the arguments, for a family's own checks on them.
    """
    recurrence = recurrence or reference_recurrence(model)
    mix = model.layers[layer].linear_attn
    with torch.no_grad(), model.trace(PROMPT):
        q, k, v = mix.attention_queries.save(), mix.attention_keys.save(), mix.attention_values.save()
        beta, g = mix.betas.save(), mix.decays.save()
        states = mix.states.save()
        out = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
    outputs, expected = recurrence(q, k, v, g, beta)
    torch.testing.assert_close(states, expected, rtol=1e-4, atol=1e-5, msg=f"layer {layer}: states")
    torch.testing.assert_close(out.float(), outputs, rtol=1e-4, atol=1e-5, msg=f"layer {layer}: kernel output")
    assert (g <= 0).all(), "a log decay"
    return {"q": q, "k": k, "v": v, "beta": beta, "g": g, "states": states}


def assert_set_state_after_continues_like_a_replaced_cache(model, plain, ids, layer: int, T: int) -> None:
    """``set_state_after(T, value)`` (routed) gives the logits of a plain forward whose cached state was replaced after ``T``."""
    value = donor_state(model, layer)
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].linear_attn.set_state_after(T, value)
        probs = model.next_token_probs.save()
    with torch.no_grad():
        expected = torch.softmax(hf.continue_from_state(plain, ids, T % ids.shape[1], layer, value), -1)
        clean = torch.softmax(plain(ids).logits[:, -1], -1)
    torch.testing.assert_close(probs, expected, rtol=1e-4, atol=1e-6)
    # Ten times the tolerance above: the decay forgets an early patch, but not to nothing.
    assert not torch.allclose(probs, clean, rtol=0, atol=1e-5), "the patch changes the prediction"


def assert_state_input_on_a_decode_step_generates_like_hf(model, plain, ids, step: int, new: int = NEW) -> None:
    """Assigning every block's ``state_input`` at decode step ``step`` generates what a plain greedy loop does with that cache."""
    layers = recurrent_layers(model)
    donors = {layer: donor_state(model, layer, scale=20.0, seed=layer) for layer in layers}
    with torch.no_grad(), model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False) as tracer:
        for _ in tracer.iter[step]:
            for layer in layers:
                model.layers[layer].linear_attn.state_input = donors[layer]
        patched = tracer.result.save()

    def patch(at, cache):
        if at == step:
            for layer in layers:
                hf.set_recurrent_state(cache, layer, donors[layer])

    assert torch.equal(patched, greedy(plain, ids, new, patch=patch))
    assert not torch.equal(patched, greedy(plain, ids, new)), "the patch changes the continuation"


def assert_state_output_of_each_step_is_the_cache(model, plain, ids, layer: int, new: int = NEW) -> None:
    """Under ``generate``, ``state_output`` of each step is the HF cache's state before the next one; entering is a copy."""
    mix = model.layers[layer].linear_attn
    outs, ins = [], []
    with torch.no_grad(), model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False) as tracer:
        for _ in tracer.iter[:new]:
            entering = mix.state_input
            ins.append(entering.save() if entering is not None else None)
            outs.append(mix.state_output.save())
        result = tracer.result.save()
    seen = {}
    greedy(plain, ids, new, patch=lambda step, cache: seen.__setitem__(step, hf.recurrent_state(cache, layer).clone()))
    assert ins[0] is None
    for step in range(1, new):
        torch.testing.assert_close(outs[step - 1], seen[step], rtol=1e-5, atol=1e-6, msg=f"state after step {step - 1}")
        assert torch.equal(ins[step], outs[step - 1]), f"step {step} enters from step {step - 1}'s state"
    assert torch.equal(result, greedy(plain, ids, new))


class GatedDeltaNetSuite(CheckpointFixtures):
    """Tests of a gated-DeltaNet mixer (`LinearAttention`, `KimiDeltaAttention`): set ``MODEL_TYPE``."""

    def test_every_linear_attention_value_is_served(self, model):
        assert_support_serves_every_value(model)

    def test_layer_map_follows_the_config_not_a_pattern(self):
        assert_layer_map_follows_the_config(self.MODEL_TYPE, ["full_attention", "linear_attention", "full_attention", "linear_attention"])

    def test_mlp_is_the_whole_feed_forward_block(self, model):
        hf_layers = model._at(model.family.LAYERS)
        for index, layer in enumerate(model.layers):
            assert layer.mlp is not None and layer.mlp._module is hf_layers[index]._module.mlp, f"layer {index}"

    @pytest.mark.parametrize("layer", [0, 2])
    def test_states_equal_the_cache_after_each_prefix(self, routed, plain, ids, layer):
        assert_states_equal_the_cache_after_each_prefix(routed, plain, ids, layer)

    def test_kernel_arguments_reproduce_states_through_the_paper_recurrence(self, routed):
        assert_kernel_arguments_reproduce_states(routed, 1)

    @pytest.mark.parametrize("T", [0, 3, -2])
    def test_set_state_after_continues_like_a_replaced_cache(self, routed, plain, ids, T):
        assert_set_state_after_continues_like_a_replaced_cache(routed, plain, ids, 1, T)

    @pytest.mark.parametrize("step", [1, 2])
    def test_state_input_on_a_decode_step_generates_like_hf(self, model, plain, ids, step):
        assert_state_input_on_a_decode_step_generates_like_hf(model, plain, ids, step)

    def test_state_output_of_each_step_is_the_cache(self, model, plain, ids):
        assert_state_output_of_each_step_is_the_cache(model, plain, ids, 2)
