"""The mLSTM (`MLSTM`, xLSTM): its suite and its own cases.

`MLSTMSuite` is the state contract (tests/suites/contract.py, against the
plain model's ``xLSTMCache``; a donor state comes from another prompt, so a
write carries its own C, n and m together, the packed state) plus what the
kind adds: the packed layout, the kernel's arguments through the paper's
recurrence (`tests.reference.mlstm`), a prompt's entering state against a
cache holding it, gradients, the order errors, and the calls the one pass must
leave to transformers' backend body (``wrap_chunkwise_arbitrary_sequence_length``,
its runs counted by a profile hook, `tests.reference.calls`). A family's test
file subclasses it and names ``MODEL_TYPE``; the one pass every fast kind
shares is in tests/recurrent/test_one_pass.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nnterp import StandardizedTransformer
from nnterp.components.mlstm import MLSTM
from tests.reference import hf_oracles as hf
from tests.reference import mlstm as ref
from tests.reference.calls import counting
from tests.suites.caches import XLSTMCache
from tests.suites.checkpoint import OTHER, PROMPT
from tests.suites.contract import StateContract

NEW = 4
#: What the mLSTM does not serve, and the words its reason must contain.
UNAVAILABLE = {"state": "tracer.iter"}


def donor(model, layer: int, prompt: str = OTHER) -> torch.Tensor:
    """Layer ``layer``'s packed state after another prompt's last token."""
    with torch.no_grad(), model.trace(prompt):
        state = model.layers[layer].linear_attn.state_output.save()
    return state


def strong(state: torch.Tensor, gain: float = 30.0) -> torch.Tensor:
    """``state`` with its memory C amplified (n and m kept): a patch a one-token decode step cannot ignore."""
    c, n, m = MLSTM.unpack(state)
    return MLSTM.pack(c * gain, n, m)


def unpacked(states: torch.Tensor) -> tuple:
    """``(C, n, m)`` of packed states ``[..., key_dim, value_dim + 2]``, ``m`` without its last axis."""
    c, n, m = MLSTM.unpack(states)
    return c, n, m[..., 0]


def backend(model):
    """transformers' backend body: the chunkwise kernel and the token loop past the last whole chunk."""
    return counting(model.family.MODELING.wrap_chunkwise_arbitrary_sequence_length)


def suppressed(plain) -> tuple:
    return (plain.config.eos_token_id,)


class MLSTMSuite(StateContract):
    """An mLSTM mixer (`MLSTM`): set ``MODEL_TYPE``."""

    CACHE = XLSTMCache(MLSTM.unpack)
    STATE_TOL = dict(rtol=1e-4, atol=1e-6)
    DECODE_TOL = dict(rtol=1e-5, atol=1e-6)
    FINAL_IS_LAST = False
    WRITE_AT = (0, 3, -2, -1)
    CHANGE_ATOL = 1e-4
    WRITE_SCALE = 1.0
    DECODE_LAYERS = (1,)
    DECODE_WRITES = (("state_input", 1), ("state_input", 2), ("set_state_after", 1))
    DECODE_WRITE_LAYERS = None

    def donor(self, model, plain, layer, scale, seed=0):
        """Another prompt's packed state (C, n and m together); on a decode step its memory amplified."""
        value = donor(model, layer)
        return value if scale == 1.0 else strong(value, scale)

    def test_support_serves_every_value_but_the_iterated_state(self, model):
        support = model.support()
        for name in MLSTM.values():
            entry = support[f"linear_attn.{name}"]
            if name in UNAVAILABLE:
                assert entry is not None and all(UNAVAILABLE[name] in reason for reason in entry), name
            else:
                assert entry is None, f"linear_attn.{name}: {entry}"

    def test_the_packed_state_is_c_then_n_then_m(self):
        c, n, m = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), torch.randn(2, 3, 1)
        packed = MLSTM.pack(c, n, m)
        assert packed.shape == (2, 3, 4, 7)
        assert torch.equal(packed[..., :5], c) and torch.equal(packed[..., 5], n) and torch.equal(packed[..., 2, 6:], m)
        for got, expected in zip(MLSTM.unpack(packed), (c, n, m)):
            assert torch.equal(got, expected)

    def test_kernel_arguments_reproduce_states_through_the_paper_recurrence(self, model):
        mix = model.layers[1].linear_attn
        with backend(model) as calls, torch.no_grad(), model.trace(PROMPT):
            q, k, v = mix.attention_queries.save(), mix.attention_keys.save(), mix.attention_values.save()
            i, f, decays = mix.input_gates.save(), mix.forget_gates.save(), mix.decays.save()
            states = mix.states.save()
            h = getattr(mix.source, type(mix).CHUNK_KERNEL).output[0].save()
        assert len(calls) == len(model.layers) - 1, "only layer 1's backend is skipped: h is the one pass's"
        out, c, n, m = ref.mlstm(q, k, v, i, f)
        for name, got, want in zip("Cnm", unpacked(states), (c, n, m)):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(h.transpose(1, 2).double(), out, rtol=1e-4, atol=1e-5, msg="the kernel's output")
        assert (decays <= 0).all() and torch.equal(decays, torch.nn.functional.logsigmoid(f))

    def test_state_input_on_a_prompt_continues_like_a_cache_holding_it(self, model, plain, ids):
        # transformers' prompt kernel starts from the cached state (unlike Mamba-1's): a fresh cache with one layer's
        # state replaced, then the whole prompt in one call.
        from transformers.models.xlstm.modeling_xlstm import xLSTMCache

        layer, value = 1, donor(model, 1)
        with torch.no_grad(), model.trace(ids):
            model.layers[layer].linear_attn.state_input = value
            logits = model.logits.save()
        cache = xLSTMCache(plain.config, ids.shape[0], dtype=torch.float32)
        ref.set_layer_state(cache, layer, MLSTM.unpack(value))
        with torch.no_grad():
            expected = plain(ids, use_cache=True, **{hf.cache_kwarg(plain): cache}).logits
            clean = plain(ids).logits
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(logits, clean, atol=1e-4), "the entering state changes the outputs"

    def test_gradients_reach_the_arguments_and_a_written_state(self, model, ids):
        # transformers copies each block's state into its cache in place: a backward pass needs use_cache=False.
        assert model.family.BACKWARD_KWARGS == {"use_cache": False}
        mix = model.layers[0].linear_attn
        with model.trace(ids, use_cache=False):
            values = mix.attention_values.save()
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                g_values = values.grad.save()
        with model.trace(ids, use_cache=False):
            forget = mix.forget_gates.save()
            decays = mix.decays.save()
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                # In the order the backward pass reaches them: the decays the kernel reads, then the gates they come from.
                g_decays, g_forget = decays.grad.save(), forget.grad.save()
        assert g_values.abs().sum() > 0 and g_decays.abs().sum() > 0
        # The chain rule through d = log sigmoid(f): dL/df = dL/dd * sigmoid(-f).
        torch.testing.assert_close(g_forget, g_decays * torch.sigmoid(-forget.detach()), rtol=1e-4, atol=1e-8)
        with torch.no_grad(), model.trace(ids):
            state = mix.state_after(2).save()
        target = (state * 1.1).requires_grad_(True)
        with model.trace(ids, use_cache=False):
            mix.set_state_after(2, target)
            loss = model.logits[0, -1].log_softmax(-1)[3].save()
            with loss.backward():
                g_target = target.grad.save()
        assert g_target.abs().sum() > 0, "the split backend reads the written state"

    def test_writes_after_the_kernel_ran_or_out_of_order_raise(self, model, ids):
        from nnterp import OrderError

        mix = model.layers[0].linear_attn
        value = donor(model, 0)
        with pytest.raises(OrderError), torch.no_grad(), model.trace(ids):
            mix.state_output.save()
            mix.set_state_after(1, value)
        with pytest.raises(OrderError), torch.no_grad(), model.trace(ids):
            mix.state_after(4).save()
            mix.set_state_after(2, value)

    def test_a_split_needs_the_inference_backend_and_says_so(self, checkpoint, model, ids):
        # In a training mode the backend runs its chunkwise kernel alone (whole chunks, no final state), which a split
        # cannot run on part of the call; the states are still computed from the call's arguments, as in inference.
        from nnterp import StandardizedTransformer, Unavailable

        trained = StandardizedTransformer(str(checkpoint(self.MODEL_TYPE)), mode="train")
        mix = trained.layers[1].linear_attn
        chunk = trained._module.config.chunk_size
        ids = ids[:, : ids.shape[1] // chunk * chunk]  # whole chunks only, as training mode runs them
        with torch.no_grad(), trained.trace(ids, use_cache=False):
            states = mix.states.save()
        with torch.no_grad(), model.trace(ids, use_cache=False):
            expected = model.layers[1].linear_attn.states.save()
        torch.testing.assert_close(states, expected, rtol=1e-5, atol=1e-6)
        for write in (lambda: mix.state_after(1).save(), lambda: mix.set_state_after(1, states[:, 1])):
            with pytest.raises(Unavailable, match="mode='inference'"), torch.no_grad(), trained.trace(ids, use_cache=False):
                write()

    # -- the one pass: what the mLSTM adds ------------------------------------------

    def test_a_one_token_call_runs_the_backend(self, model, plain, ids):
        one = ids[:, :1]
        with backend(model) as calls, torch.no_grad(), model.trace(one):
            single = model.layers[0].linear_attn.states.save()
        assert len(calls) == len(model.layers)
        torch.testing.assert_close(self.CACHE.served(single), self.CACHE.prefix_states(plain, one, 0), rtol=1e-4, atol=1e-5)

    def test_a_backend_keeping_its_state_in_bfloat16_runs(self, checkpoint, ids):
        # inference_state_dtype="bfloat16": the arguments stay float32 but the backend's token loop rounds its state.
        path = str(checkpoint(self.MODEL_TYPE))
        model = StandardizedTransformer(path, dispatch=True, device="cpu", inference_state_dtype="bfloat16")
        plain = AutoModelForCausalLM.from_pretrained(path, inference_state_dtype="bfloat16").eval()
        assert ids.shape[1] % model._module.config.chunk_size, "the prompt ends inside a chunk: the token loop runs"
        with backend(model) as calls, torch.no_grad(), model.trace(ids):
            for layer in model.layers:
                layer.linear_attn.states.save()
            logits = model.logits.save()
        with torch.no_grad():
            torch.testing.assert_close(logits, plain(ids).logits, rtol=0, atol=1e-6)
        assert len(calls) == len(model.layers), "the backend ran"

    def test_the_one_pass_divides_by_the_backends_own_eps(self, checkpoint, ids):
        # The backend call does not carry config.eps: the spec reads it off the module (MLSTM.FAST_CONSTANTS). A large
        # one moves every output, so a pass that used xLSTM's default instead would miss the plain forward.
        path = str(checkpoint(self.MODEL_TYPE))
        model = StandardizedTransformer(path, dispatch=True, device="cpu", eps=0.05)
        plain = AutoModelForCausalLM.from_pretrained(path, eps=0.05).eval()
        logits = []
        with backend(model) as calls, torch.no_grad(), model.trace(ids):
            for layer in model.layers:
                layer.linear_attn.states.save()
            logits.append(model.logits.save())
        assert calls == [], "the backend ran although every call's states were read"
        with torch.no_grad():
            expected, default = plain(ids).logits, AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
        assert (expected - default).abs().max() > 1e2 * 1e-5, "eps moves the outputs"
        torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-5)
