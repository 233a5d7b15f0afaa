"""`LightningSuite`: the oracle checks a lightning-attention family (MiniMax) passes.

A family's test file mixes it in and names its checkpoint::

    class TestMiniMax(LightningSuite):
        MODEL_TYPE = "minimax"

Every check compares what nnterp reads or writes on a family's ``linear_attn``
with an oracle that does not use nnterp: the model's own cache
(``cache.linear_cache``) after a plain forward over each prefix, a plain
forward continued one token at a time from a replaced cached state, a plain
greedy loop with a state replaced before a decode step, a plain model whose
decay buffers are rebuilt from other rates, and the recurrence written from the
paper (`tests.reference.lightning`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from nnterp import Unavailable
from nnterp.core.errors import OrderError
from tests.reference import hf_oracles as hf
from tests.reference.lightning import lightning_recurrence
from tests.suites.checkpoint import PROMPT, CheckpointFixtures

ATOL = 2e-5
KW = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)


def lightning_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]


def donor_state(model, layer: int, seed: int = 0) -> torch.Tensor:
    dims = model.layers[layer].linear_attn.dims()
    shape = (1, dims["mixer_heads"], dims["key_dim"], dims["value_dim"])
    return 3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def forward(plain, ids, cache=None, start=0):
    """One plain call from position ``start``, positions passed as generate passes them."""
    kwargs = {"use_cache": True, "position_ids": torch.arange(start, start + ids.shape[1])[None]}
    if cache is not None:
        kwargs[hf.cache_kwarg(plain)] = cache
    return plain(input_ids=ids, **kwargs)


@torch.no_grad()
def prefix_states(plain, ids, layer) -> torch.Tensor:
    """The cached state of ``layer`` after each prefix, from independent plain forwards: ``[1, T, H, Dk, Dv]``."""
    return torch.stack([hf.output_cache(forward(plain, ids[:, : t + 1])).linear_cache[layer].clone() for t in range(ids.shape[1])], 1)


@torch.no_grad()
def continue_from(plain, ids, writes: dict, layer) -> tuple:
    """Last logits and final cached state after replacing ``layer``'s cached state after each token in ``writes``,
    the rest fed one token at a time."""
    first = min(writes)
    out = forward(plain, ids[:, : first + 1])
    cache = hf.output_cache(out)
    cache.set_linear_cache(layer, writes[first].clone())
    for i in range(first + 1, ids.shape[1]):
        out = forward(plain, ids[:, i : i + 1], cache, start=i)
        if i in writes:
            cache.set_linear_cache(layer, writes[i].clone())
    return out.logits[:, -1], cache.linear_cache[layer]


def greedy(plain, ids, patch=None, record=None):
    """The plain greedy loop (EOS never chosen, as generate's min_new_tokens); ``record(step, cache)`` after each call."""
    def patched(step, cache):
        if record is not None:
            record(step, cache)
        if patch is not None:
            patch(step, cache)

    return hf.greedy(plain, ids, KW["max_new_tokens"], patch=patched, suppress_tokens=(plain.config.eos_token_id,))


class LightningSuite(CheckpointFixtures):
    """Lightning attention against the model's own cache, plain forwards and the paper's recurrence."""

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

    def test_states_equal_the_cache_after_each_prefix(self, model, plain, ids):
        layers = lightning_layers(model)
        got = []
        with torch.no_grad(), model.trace(ids):
            for i in layers:
                got.append(model.layers[i].linear_attn.states.save())
        assert ids.shape[1] > 2 * model._module.config.block_size  # several blocks, so the block ends are crossed
        for i, states in zip(layers, got):
            torch.testing.assert_close(states, prefix_states(plain, ids, i), atol=ATOL, rtol=1e-4, msg=f"layer {i}")

    def test_served_arguments_reproduce_the_states_by_the_papers_recurrence(self, model, ids):
        layer = lightning_layers(model)[1]
        mix = model.layers[layer].linear_attn
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

    @pytest.mark.parametrize("T", [1, 3, 6, -1])
    def test_set_state_after_equals_a_forward_continued_from_a_replaced_cache(self, model, plain, ids, T):
        layer = lightning_layers(model)[1]
        mix, donor = model.layers[layer].linear_attn, donor_state(model, layer)
        position = T % ids.shape[1]
        with torch.no_grad(), model.trace(ids):
            before = mix.state_after(position - 1).save() if position else None
            mix.set_state_after(T, donor)
            after = mix.state_after(T).save()
            final = mix.state_output.save()
            logits = model.logits[:, -1].save()
        expected, cached = continue_from(plain, ids, {position: donor}, layer)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(final, cached, atol=ATOL, rtol=1e-4)
        assert torch.equal(after, donor)
        if before is not None:
            torch.testing.assert_close(before, prefix_states(plain, ids, layer)[:, position - 1], atol=ATOL, rtol=1e-4)
        assert not torch.allclose(logits, plain(ids).logits[:, -1], atol=1e-3) or position == ids.shape[1] - 1

    def test_two_writes_in_one_call_and_token_t_keeps_its_output(self, model, plain, ids):
        layer = lightning_layers(model)[0]
        mix = model.layers[layer].linear_attn
        writes = {2: donor_state(model, layer, 1), 7: donor_state(model, layer, 2)}
        with torch.no_grad(), model.trace(ids):
            for t, value in writes.items():
                mix.set_state_after(t, value)
            logits = model.logits.save()
        expected, _ = continue_from(plain, ids, writes, layer)
        torch.testing.assert_close(logits[:, -1], expected, atol=ATOL, rtol=1e-4)
        clean = plain(ids).logits
        torch.testing.assert_close(logits[:, :3], clean[:, :3], atol=0, rtol=0)  # tokens up to the first write, as computed
        with pytest.raises(OrderError), model.trace(ids):
            mix.state_output
            mix.set_state_after(1, writes[2])

    def test_state_output_of_each_decode_step_equals_the_greedy_loops_cache(self, model, plain, ids):
        layer = lightning_layers(model)[-1]
        mix = model.layers[layer].linear_attn
        got = []
        with torch.no_grad(), model.generate(ids, **KW) as tracer:
            for _ in tracer.iter[:3]:
                got.append(mix.state_output.save())
            result = tracer.result.save()
        cached = {}
        expected_ids = greedy(plain, ids, record=lambda step, cache: cached.__setitem__(step, cache.linear_cache[layer].clone()))
        assert torch.equal(result, expected_ids)
        for step in (1, 2):  # the state entering decode step `step` is what the call before it left
            torch.testing.assert_close(got[step - 1], cached[step], atol=ATOL, rtol=1e-4)

    def test_decode_step_writes_equal_a_greedy_loop_with_a_replaced_cache(self, model, plain, ids):
        layer = lightning_layers(model)[0]
        mix, donor = model.layers[layer].linear_attn, donor_state(model, layer)

        def patch_at(step):
            return lambda s, cache: cache.set_linear_cache(layer, donor.clone()) if s == step else None

        with torch.no_grad(), model.generate(ids, **KW) as tracer:
            for _ in tracer.iter[1]:
                entering = mix.state_input.save()
                mix.state_input = donor
            written = tracer.result.save()
        assert entering is not None and torch.equal(written, greedy(plain, ids, patch=patch_at(1)))
        assert not torch.equal(written, greedy(plain, ids))
        with torch.no_grad(), model.generate(ids, **KW) as tracer:
            for _ in tracer.iter[1]:
                mix.set_state_after(0, donor)  # the step's own token keeps its output; the next step starts from donor
            after = tracer.result.save()
        assert torch.equal(after, greedy(plain, ids, patch=patch_at(2)))

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
        cache = type(hf.output_cache(forward(plain, ids[:, :1])))()
        cache.set_linear_cache(layer, donor.clone())
        with torch.no_grad():
            expected = forward(plain, ids, cache).logits[:, -1]
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
