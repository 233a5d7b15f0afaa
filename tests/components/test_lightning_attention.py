"""Lightning attention (`LightningAttention`, MiniMax): its suite and its own cases.

`LightningAttentionSuite` is the state contract (tests/suites/contract.py,
against the model's own ``cache.linear_cache``) plus what the kind adds,
against oracles that do not use nnterp: a plain forward continued from two
replaced states, a plain model whose decay buffers are rebuilt from other
rates, the recurrence written from the paper (`tests.reference.lightning`),
and how many ``torch.matmul`` calls the HF mixer's own forward made (`products`:
whether its block loop ran). A family's test file subclasses it and names
``MODEL_TYPE``; the one pass every fast kind shares is in
tests/recurrent/test_one_pass.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer, Unavailable
from nnterp.core.errors import OrderError
from tests.reference.calls import counting_builtin
from tests.reference.lightning import lightning_recurrence
from tests.suites.caches import LinearCache
from tests.suites.checkpoint import PROMPT
from tests.suites.contract import StateContract, recurrent_layers

ATOL = 2e-5
KW = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
CACHE = LinearCache()
lightning_layers = recurrent_layers


def products(plain):
    """Counts the ``torch.matmul`` calls made under a frame of the HF lightning mixer's ``forward``: ``len(calls)``."""
    mixer = type(plain.model.layers[0].self_attn)
    return counting_builtin(torch.matmul, lambda frame: frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("self"), mixer))


def blocks(model, ids) -> int:
    """The blocks of the forward's loop over ``ids``; each makes 4 ``products`` per layer."""
    return -(-ids.shape[1] // model._module.config.block_size)


def donor_state(model, layer: int, seed: int = 0) -> torch.Tensor:
    dims = model.layers[layer].linear_attn.dims()
    shape = (1, dims["mixer_heads"], dims["key_dim"], dims["value_dim"])
    return 3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def continue_from(plain, ids, writes: dict, layer) -> torch.Tensor:
    """Last logits after replacing ``layer``'s cached state after each token in ``writes``, the rest fed one token at a time."""
    first = min(writes)
    _, cache = CACHE.prefill(plain, ids[:, : first + 1])
    CACHE.write(cache, layer, writes[first])
    for i in range(first + 1, ids.shape[1]):
        logits, cache = CACHE.step(plain, ids[:, i : i + 1], i, cache)
        if i in writes:
            CACHE.write(cache, layer, writes[i])
    return logits[:, -1]


class LightningAttentionSuite(StateContract):
    """Lightning attention (`LightningAttention`): set ``MODEL_TYPE``."""

    CACHE = CACHE
    STATE_TOL = LOGIT_TOL = dict(rtol=1e-4, atol=ATOL)
    STATE_LAYERS = (0, 1, 2)
    WRITE_AT = (1, 3, 6, -1)
    CHANGE_ATOL = 1e-3
    DECODE_LAYERS = (-1,)
    DECODE_WRITES = (("state_input", 1), ("set_state_after", 1))
    DECODE_SCALE = 3.0

    def test_every_value_is_served_or_says_why(self, model):
        support = model.support()
        for name in ("attention_queries", "attention_keys", "attention_values", "decays", "state_input", "states",
                     "state_output", "effective_attention", "state_input_readout", "attention_output"):
            assert support[f"linear_attn.{name}"] is None, name
        for name in ("state", "betas", "conv_state_input", "conv_state_output"):
            reasons = support[f"linear_attn.{name}"]
            assert set(reasons) == set(lightning_layers(model)) and all(reasons.values()), name
            with pytest.raises(Unavailable) as raised, model.trace(PROMPT):
                getattr(model.layers[0].linear_attn, name)
            assert raised.value.reason == reasons[0]

    def test_layer_map_follows_the_config(self, model):
        kinds = model._module.config.layer_types
        assert lightning_layers(model) == [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
        assert any(kind == "full_attention" for kind in kinds) and all(
            model.layers[i].self_attn is not None for i, kind in enumerate(kinds) if kind == "full_attention"
        )

    def test_served_arguments_reproduce_the_states_by_the_papers_recurrence(self, model, ids):
        layer = lightning_layers(model)[1]
        mix = model.layers[layer].linear_attn
        assert ids.shape[1] > 2 * model._module.config.block_size  # several blocks, so the block ends are crossed
        with torch.no_grad(), model.trace(ids):
            q, k, v, g = (x.save() for x in (mix.attention_queries, mix.attention_keys, mix.attention_values, mix.decays))
            states = mix.states.save()
            state_9 = mix.state_after(9).save()
            final = mix.state_output.save()
        assert torch.equal(g, g[:1, :1].expand_as(g)), "one decay per head"
        outputs, expected = lightning_recurrence(q, k, v, -g[0, 0])
        torch.testing.assert_close(states, expected, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(state_9, expected[:, 9], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(final, expected[:, -1], atol=ATOL, rtol=1e-4)

    def test_two_writes_in_one_call_and_token_t_keeps_its_output(self, model, plain, ids):
        layer = lightning_layers(model)[0]
        mix = model.layers[layer].linear_attn
        writes = {2: donor_state(model, layer, 1), 7: donor_state(model, layer, 2)}
        with torch.no_grad(), model.trace(ids):
            for t, value in writes.items():
                mix.set_state_after(t, value)
            logits = model.logits.save()
        expected = continue_from(plain, ids, writes, layer)
        torch.testing.assert_close(logits[:, -1], expected, atol=ATOL, rtol=1e-4)
        clean = plain(ids).logits
        torch.testing.assert_close(logits[:, :3], clean[:, :3], atol=0, rtol=0)  # tokens up to the first write, as computed
        with pytest.raises(OrderError), model.trace(ids):
            mix.state_output
            mix.set_state_after(1, writes[2])

    def test_written_decays_equal_a_model_with_other_rates(self, model, plain, ids):
        layer = lightning_layers(model)[1]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            mix.decays = 2 * mix.decays
            logits = model.logits.save()
        other = copy.deepcopy(plain)
        hf_mixer = other.model.layers[layer].self_attn
        rates = 2 * hf_mixer.slope_rate
        for name, value in zip(("slope_rate", "query_decay", "key_decay", "diagonal_decay"), (rates, *hf_mixer.decay_factors(rates))):
            getattr(hf_mixer, name).copy_(value)
        with torch.no_grad():
            expected = other(ids).logits
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
        assert not torch.allclose(expected, plain(ids).logits, atol=1e-4)

    def test_written_keys_reach_the_forward(self, model, ids):
        layer = lightning_layers(model)[0]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            q, v, g = mix.attention_queries.save(), mix.attention_values.save(), mix.decays.save()
            keys = mix.attention_keys.flip(1).save()
            mix.attention_keys = keys
            states = mix.states.save()
            raw = mix.source.torch_cat_0.output.save()  # the forward's own output before the norm
        outputs, expected = lightning_recurrence(q, keys, v, -g[0, 0])
        torch.testing.assert_close(states, expected, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(raw.transpose(1, 2), outputs, atol=ATOL, rtol=1e-4)

    def test_effective_attention_reproduces_the_output_before_the_norm(self, model, ids):
        mix = model.layers[lightning_layers(model)[2]].linear_attn
        readout = []  # a None bound inside the trace would not survive it
        with torch.no_grad(), model.trace(ids):
            A, v = mix.effective_attention.save(), mix.attention_values.save()
            readout.append(mix.state_input_readout)
            raw = mix.source.torch_cat_0.output.save()
        assert readout == [None]
        torch.testing.assert_close(torch.einsum("bhts,bshd->bthd", A, v), raw.transpose(1, 2), atol=1e-5, rtol=1e-5)
        assert torch.all(A.triu(1) == 0)
        with torch.no_grad(), model.generate(ids, **KW) as tracer:
            for _ in tracer.iter[1]:
                A1, v1, r1 = mix.effective_attention.save(), mix.attention_values.save(), mix.state_input_readout.save()
                raw1 = mix.source.torch_cat_0.output.save()
        torch.testing.assert_close(torch.einsum("bhts,bshd->bthd", A1, v1) + r1, raw1.transpose(1, 2), atol=1e-5, rtol=1e-5)

    def test_traces_leave_the_model_as_it_was(self, model, ids):
        buffers = {name: b.clone() for name, b in model._module.named_buffers()}
        params = {name: p.clone() for name, p in model._module.named_parameters()}
        layer = lightning_layers(model)[0]
        with torch.no_grad(), model.trace(ids):
            model.layers[layer].linear_attn.decays = 3 * model.layers[layer].linear_attn.decays
            model.layers[layer].linear_attn.set_state_after(4, donor_state(model, layer))
        for name, b in model._module.named_buffers():
            assert torch.equal(b, buffers[name]), name
        for name, p in model._module.named_parameters():
            assert torch.equal(p, params[name]), name

    def test_state_input_written_on_a_prompt_equals_a_forward_over_a_cache_holding_it(self, model, plain, ids):
        layer = lightning_layers(model)[0]
        mix, donor = model.layers[layer].linear_attn, donor_state(model, layer)
        with torch.no_grad(), model.trace(ids):
            mix.state_input = donor  # the forward then takes its token loop from donor
            states = mix.states.save()
            logits = model.logits[:, -1].save()
        cache = type(CACHE.prefill(plain, ids[:, :1])[1])()
        cache.set_linear_cache(layer, donor.clone())
        with torch.no_grad():
            expected = CACHE.step(plain, ids, 0, cache)[0][:, -1]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(states[:, -1], cache.linear_cache[layer], atol=ATOL, rtol=1e-4)
        with torch.no_grad(), model.trace(ids):
            A = mix.effective_attention_of(positions=[-1, 2], heads=1).save()
            full = mix.effective_attention.save()
        assert torch.equal(A, full[:, [1]][:, :, [ids.shape[1] - 1, 2]])

    def test_without_a_cache_the_forward_still_returns_its_final_state(self, model, ids):
        mix = model.layers[lightning_layers(model)[0]].linear_attn
        with torch.no_grad(), model.trace(ids, use_cache=False):
            uncached = mix.state_output.save()
        with torch.no_grad(), model.trace(ids):
            cached = mix.state_output.save()
        assert torch.equal(uncached, cached)
        with pytest.raises(Unavailable, match="use_cache=True"), torch.no_grad(), model.trace(ids, use_cache=False):
            mix.state_input = cached

    def test_a_write_in_one_invoke_of_two_leaves_the_other(self, model, ids):
        layer = lightning_layers(model)[1]
        mix, donor = model.layers[layer].linear_attn, donor_state(model, layer)
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(ids):
                mix.set_state_after(3, donor)
                patched = model.logits.save()
            with tracer.invoke(ids):
                untouched = model.logits.save()
        with torch.no_grad(), model.trace(ids):
            mix.set_state_after(3, donor)
            alone = model.logits.save()
        torch.testing.assert_close(patched, alone, atol=ATOL, rtol=1e-4)
        with torch.no_grad():
            torch.testing.assert_close(untouched, model._module(ids).logits, atol=ATOL, rtol=1e-4)

    # -- the one pass: what lightning adds --------------------------------------------

    def test_the_one_pass_outputs_before_the_norm_are_the_papers(self, model, plain, ids):
        mix = model.layers[lightning_layers(model)[1]].linear_attn
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            q, k, v, g = (x.save() for x in (mix.attention_queries, mix.attention_keys, mix.attention_values, mix.decays))
            mix.states.save()
            output = mix.kernel_output().save()
        assert len(calls) == 4 * blocks(model, ids) * (len(lightning_layers(model)) - 1), "only this layer's loop is skipped"
        expected, _ = lightning_recurrence(q, k, v, -g[0, 0])
        torch.testing.assert_close(output, expected.to(output.dtype), atol=ATOL, rtol=1e-4)

    def test_decay_buffers_a_cast_left_apart_from_slope_rate_keep_the_loop(self, checkpoint, ids):
        # load(bfloat16).to(float32) rounds the loop's decay buffers apart from what slope_rate gives (about 2e-3):
        # the one pass would compute the outputs from slope_rate, not from the buffers the forward reads.
        path = str(checkpoint(self.MODEL_TYPE))
        model = StandardizedTransformer(path, dispatch=True, device="cpu", dtype=torch.bfloat16)
        model._module.to(torch.float32)
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().to(torch.float32)
        mixer = plain.model.layers[lightning_layers(model)[0]].self_attn
        assert not torch.allclose(mixer.query_decay, mixer.decay_factors(mixer.slope_rate)[0], rtol=1e-4, atol=0)
        with products(plain) as calls, torch.no_grad(), model.trace(ids):
            for i in lightning_layers(model):
                model.layers[i].linear_attn.states.save()
            logits = model.logits.save()
        with torch.no_grad():
            torch.testing.assert_close(logits, plain(ids).logits, rtol=0, atol=1e-6)
        assert len(calls) == 4 * blocks(model, ids) * len(lightning_layers(model)), "the block loop ran"
