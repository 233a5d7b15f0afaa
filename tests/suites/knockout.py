"""`KnockoutContract`: what ``knockout`` and ``steer_state`` do on every recurrent kind, against oracles built apart.

Oracles:

* ``mode="value"``: the call's own effective attention and values, read in a
  clean trace (``effective_attention`` is checked against the kernel's output
  in ``tests/components/test_effective_attention.py``): the kernel output of
  the knocked-out call is the clean one less ``Σ_{s ∈ sources} A[t, s] v_s``
  at the targets, and the clean one elsewhere.
* ``mode="skip"``: the plain model's own cache (`tests.suites.caches`): the
  state after the source replaced by the state the plain forward has before
  it, and the rest fed one token at a time; the states after the source are
  that run's.
* ``steer_state``: the same cache oracle with the state after ``t`` replaced
  by the plain forward's state plus ``scale * delta``; on a decode step of
  ``generate``, the plain greedy loop with each layer's cached state edited
  by hand before the next step.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import InvalidArgument, PositionError, WrongType
from tests.suites.checkpoint import CheckpointFixtures

SOURCES = [1, 2]


def _layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]


def _terms(A, v, sources, targets):
    """``Σ_{s ∈ sources} A[t, s] v_s`` at each target, tokens first (heads: ``[b, T, h, d]``; channels: ``[b, T, c]``)."""
    A = A[:, :, targets][..., sources].float()
    v = v[:, sources].float()
    return torch.einsum("bhts,bshd->bthd", A, v) if v.dim() == 4 else torch.einsum("bcts,bsc->btc", A, v)


class KnockoutContract(CheckpointFixtures):
    """Mixed into `tests.suites.contract.StateContract`: it uses its ``CACHE``, ``WRITE_LAYER``, ``reading`` and tolerances."""

    @pytest.mark.parametrize("targets", [None, [2, 4]], ids=["every-target", "targets"])
    def test_a_value_knockout_removes_the_sources_effective_attention_terms(self, model, ids, targets):
        layer = _layers(model)[self.WRITE_LAYER]
        mix = model.layers[layer].linear_attn
        with torch.no_grad(), model.trace(ids):
            A = mix.effective_attention.save()
            v = mix.attention_values.save()
            clean = mix.kernel_output().save()
        with torch.no_grad(), model.trace(ids):
            mix.knockout(SOURCES, targets=targets)
            got = mix.kernel_output().save()
        seq = ids.shape[1]
        chosen = list(range(min(SOURCES), seq)) if targets is None else targets
        offset = clean.shape[1] - seq
        expected = clean.float().clone()
        expected[:, [t + offset for t in chosen]] -= _terms(A, v, SOURCES, chosen)
        atol = 1e-6 * clean.abs().max().item()
        torch.testing.assert_close(got.float(), expected, rtol=1e-4, atol=atol)
        removed = _terms(A, v, SOURCES, chosen).abs().max().item()
        assert removed > 100 * atol, f"the sources' terms ({removed:.2e}) are not negligible, so the check bites"
        if targets is not None:
            others = [t + offset for t in range(seq) if t not in targets]
            assert torch.equal(got[:, others], clean[:, others]), "only the targets' outputs change"

    def test_knockouts_compose_and_a_removed_pair_is_removed_once(self, model, ids):
        mix = model.layers[_layers(model)[self.WRITE_LAYER]].linear_attn
        with torch.no_grad(), model.trace(ids):
            mix.knockout(1, targets=[4])
            once = mix.kernel_output().save()
        with torch.no_grad(), model.trace(ids):
            mix.knockout(1, targets=[4])
            mix.knockout([1, 2], targets=4)
            both = mix.kernel_output().save()
        with torch.no_grad(), model.trace(ids):
            mix.knockout(2, targets=[4])
            second = mix.kernel_output().save()
        with torch.no_grad(), model.trace(ids):
            clean = mix.kernel_output().save()
        # (4, 1) removed once even though asked twice; (4, 2) added by the second call.
        torch.testing.assert_close(both.float(), (once + second - clean).float(), rtol=1e-4, atol=1e-6)

    def _clean_state_after(self, reader, prompt, mix, t):
        with torch.no_grad(), reader.trace(prompt):
            state = mix.state_after(t).save()
        return state

    def test_a_skip_leaves_the_state_as_before_the_source_and_continues_like_a_replaced_cache(self, reader, plain, prompt, path):
        layer = _layers(reader)[self.WRITE_LAYER]
        mix = reader.layers[layer].linear_attn
        s = 2
        with torch.no_grad(), reader.trace(prompt):
            mix.knockout(s, mode="skip")
            after = mix.state_after(s).save()
            later = mix.state_after(s + 1).save()
            final = mix.state_output.save()
        before = self._prefix_end(plain, prompt[:, :s], layer)  # the plain forward's state before the source
        _, states = self.CACHE.continue_from(plain, prompt, s, layer, self._clean_state_after(reader, prompt, mix, s - 1))
        tol = self.tol(path, states, self.CONTINUED_TOL or self.STATE_TOL)
        torch.testing.assert_close(self.CACHE.served(after), before, **self.tol(path, before, self.STATE_TOL), msg="the state after s")
        torch.testing.assert_close(self.CACHE.served(later), self._first(states), **tol, msg="the state after s + 1")
        torch.testing.assert_close(self.CACHE.served(final), self._last(states), **tol, msg="the state leaving the call")

    def test_steer_state_continues_like_a_cache_steered_by_hand(self, reader, plain, prompt, path):
        layer = _layers(reader)[self.WRITE_LAYER]
        mix = reader.layers[layer].linear_attn
        t = 2
        start = self._clean_state_after(reader, prompt, mix, t)
        delta = torch.randn(start.shape[1:], generator=torch.Generator().manual_seed(0)).to(start.dtype)
        with torch.no_grad(), reader.trace(prompt):
            mix.steer_state(delta, positions=[t], scale=0.5)
            final = mix.state_output.save()
            logits = reader.logits.save()
        expected, states = self.CACHE.continue_from(plain, prompt, t, layer, start + 0.5 * delta)
        torch.testing.assert_close(logits[:, t + 1 :], expected, **self.tol(path, expected, self.LOGIT_TOL))
        tol = self.tol(path, states, self.CONTINUED_TOL or self.STATE_TOL)
        torch.testing.assert_close(self.CACHE.served(final), self._last(states), **tol)

    def test_knockout_refuses_bad_input_naming_the_fix(self, model, ids):
        mix = model.layers[_layers(model)[0]].linear_attn
        seq = ids.shape[1]
        cases = [
            (dict(sources=1, mode="mask"), InvalidArgument, "self_attn.knockout"),
            (dict(sources=1, targets=3, mode="skip"), InvalidArgument, "targets=None"),
            (dict(sources=seq), PositionError, "outside"),
            (dict(sources=[0], targets=[-seq - 1]), PositionError, "outside"),
            (dict(sources=True), WrongType, "token position"),
            (dict(sources=[]), InvalidArgument, "no position"),
        ]
        for kwargs, error, words in cases:
            with pytest.raises(error, match=words), torch.no_grad(), model.trace(ids):
                mix.knockout(**kwargs)
        assert issubclass(InvalidArgument, ValueError) and issubclass(PositionError, IndexError)
        with pytest.raises(InvalidArgument, match="broadcast"), torch.no_grad(), model.trace(ids):
            mix.steer_state(torch.zeros(7, 3, 5, 11))

    def test_steer_states_on_a_decode_step_generates_like_a_greedy_loop_steered_by_hand(self, model, plain, ids):
        layers = _layers(model)
        deltas = {layer: self.donor(model, plain, layer, self.DECODE_SCALE, seed=layer) for layer in layers}
        new = 4
        left = {}
        with torch.no_grad(), model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False) as tracer:
            for _ in tracer.iter[1]:
                for layer in layers:
                    left[layer] = model.layers[layer].linear_attn.state_output.save()  # what decode step 1 leaves
        with torch.no_grad(), model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False) as tracer:
            for _ in tracer.iter[1]:
                model.steer_states(deltas)
            steered = tracer.result.save()

        def patch(step, cache):
            if step == 2:  # before the step after it, the cache holds step 1's states
                for layer in layers:
                    self.CACHE.write(cache, layer, left[layer] + deltas[layer])

        assert torch.equal(steered, self.CACHE.greedy(plain, ids, new, patch=patch))
        assert not torch.equal(steered, self.CACHE.greedy(plain, ids, new)), "the steering changes the continuation"
