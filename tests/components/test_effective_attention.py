"""`linear_attn.effective_attention` on a model, on every kind of recurrent mixer.

Oracle: the kernel call's own output. ``Σ_s A[t, s] v_s`` (plus
``state_input_readout``, the entering state's part) reproduces what the
kernel returned for the call, within 1e-5 in float32, on a prompt, on a
left-padded batch and on a decode step; ``effective_attention_of`` is a
selection of the same numbers. One family per distinct mixer component
(the first of `nnterp.families.families` that has it).
"""

from __future__ import annotations

import re

import pytest
import torch

import nnterp
from nnterp import NnterpError
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.families import families

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"


def _first_per_mixer() -> list[str]:
    seen: dict = {}
    for family in families():
        if family.MIXER is not None and family.MIXER not in seen:
            seen[family.MIXER] = family.MODEL_TYPES[0]
    return list(seen.values())


KINDS = _first_per_mixer()


@pytest.fixture(scope="module", params=KINDS)
def model(request, load):
    return load(request.param)


def _mixers(model):
    return [layer.linear_attn for layer in model.layers if getattr(layer, "linear_attn", None) is not None][:2]


def _read(model, mixers, prompt):
    """Per mixer on a prompt: effective attention, the readout, the values, the kernel's output tokens first."""
    got = []
    with torch.no_grad(), model.trace(prompt):
        _read_mixers(mixers, got)
    return got


def _read_step(model, mixers, prompt):
    """The same on decode step 1 of generate."""
    got = []
    with torch.no_grad(), model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for _ in tracer.iter[1]:
            _read_mixers(mixers, got)
    return got


def _read_mixers(mixers, got):
    for mix in mixers:
        cls = type(mix)
        attention = mix.effective_attention.save()
        readout = mix.state_input_readout
        readout = readout.save() if readout is not None else None
        values = mix.attention_values.save()
        if hasattr(cls, "kernel_output"):  # a mixer computed in its own forward, with no kernel call (lightning attention)
            got.append((attention, readout, values, mix.kernel_output().save()))
            continue
        kernel = cls.KERNEL(mix)
        table = cls.RECURRENT_ARGUMENTS if kernel == cls.RECURRENT_KERNEL else cls.CHUNK_ARGUMENTS
        value_name = "v" if "v" in table else "x"
        output = mix.record().op.output  # the kernel call's envoy (the RG-LRU calls its scan in a child module)
        output = output[0] if isinstance(output, tuple) else output
        got.append((attention, readout, values, table[value_name][1].read(output).save()))


def _predicted(attention, readout, values):
    if values.dim() == 3:  # Mamba-1: one pattern per channel
        out = torch.einsum("bcts,bsc->btc", attention, values.float())
    else:
        out = torch.einsum("bhts,bshd->bthd", attention, values.float())
    return out + readout if readout is not None else out


def _check(got, what):
    assert got, what
    for index, (attention, readout, values, output) in enumerate(got):
        expected = output.float()
        scale = expected.abs().max().clamp(min=1.0)
        torch.testing.assert_close(
            _predicted(attention, readout, values) / scale, expected / scale, rtol=0, atol=1e-5, msg=f"{what}, mixer {index}"
        )


def test_the_coefficients_reproduce_the_kernels_output_on_a_prompt(model):
    got = _read(model, _mixers(model), PROMPT)
    seq = len(model.tokenizer(PROMPT).input_ids)
    for attention, readout, _, _ in got:
        assert attention.shape[-2:] == (seq, seq) and attention.dtype == torch.float32
        assert readout is None, "nothing enters a fresh prompt"
        assert torch.equal(attention, attention.tril()), "causal"
    _check(got, "prompt")


def test_the_coefficients_reproduce_the_kernels_output_on_a_left_padded_batch(model):
    if model.family.PADDING_REFUSED is not None:
        pytest.skip(model.family.PADDING_REFUSED)
    assert model.tokenizer.padding_side == "left"
    got = _read(model, _mixers(model), [PROMPT, OTHER])
    assert got[0][0].shape[0] == 2
    _check(got, "left-padded batch")


def test_the_coefficients_and_the_entering_state_reproduce_a_decode_step(model):
    got = _read_step(model, _mixers(model), PROMPT)
    for attention, readout, _, _ in got:
        assert attention.shape[-2:] == (1, 1)
        assert readout is not None, "a decode step starts from the cache"
    _check(got, "decode step")


def test_a_selection_is_the_same_numbers(model):
    mix = _mixers(model)[0]
    axis = getattr(getattr(type(mix), "EFFECTIVE", None), "axis", "heads")  # lightning attention: one pattern per head
    with torch.no_grad(), model.trace(PROMPT):
        full = mix.effective_attention.save()
        part = mix.effective_attention_of(positions=[-1, 2], **{axis: [1, 0]}).save()
        last = mix.effective_attention_of(positions=-1).save()
    torch.testing.assert_close(part, full[:, [1, 0]][:, :, [-1, 2]], rtol=0, atol=1e-6)
    torch.testing.assert_close(last, full[:, :, -1:], rtol=0, atol=1e-6)
    wrong = "channels" if axis == "heads" else "heads"
    with pytest.raises(NnterpError, match=f"pass {axis}="), torch.no_grad(), model.trace(PROMPT):
        mix.effective_attention_of(**{wrong: [0]})


def test_support_lists_it_where_the_kernel_arguments_are(model):
    support = model.support()
    for name in ("effective_attention", "state_input_readout"):
        entry = support[f"linear_attn.{name}"]
        reasons = entry if isinstance(entry, list) else [entry]
        assert any(reason is None for reason in reasons), (name, reasons)
        assert support[f"linear_attn.{name}"] == support["linear_attn.attention_values"], name


def test_a_decode_step_that_gates_inside_the_kernel_is_the_output_before_the_gate(load):
    """Falcon-H1 without mamba_rms_norm passes z to its Mamba-2 decode kernel: per channel, so A is the output before it."""
    model = load("falcon_h1")
    assert not model._module.config.mamba_rms_norm
    mixers = _mixers(model)
    got, gates = [], []
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for _ in tracer.iter[1]:
            for mix in mixers:  # in forward order: each mixer's reads before the next mixer's
                gates.append(mix.argument("z").save())
                _read_mixers([mix], got)
    assert all(gate is not None for gate in gates)
    for (attention, readout, values, output), gate in zip(got, gates):
        predicted = _predicted(attention, readout, values) * torch.nn.functional.silu(gate.float())
        torch.testing.assert_close(predicted, output.float(), rtol=0, atol=1e-5)


def test_routed_through_the_token_loop_and_under_fast_states_it_is_the_same_call(model):
    """The token-by-token kernel (routed DeltaNet prompts) takes the same arguments; fast_states does not touch them."""
    if not isinstance(_mixers(model)[0], LinearAttention):
        pytest.skip("only a DeltaNet's prompt is routed through another kernel")
    with nnterp.route_kernels(model.family, "torch"):
        _check(_read(model, _mixers(model), [PROMPT, OTHER]), "routed")
    with nnterp.fast_states(model):
        _check(_read(model, _mixers(model), PROMPT), "fast_states")


def _raised(model, read):
    """The error ``read(mix)`` raises inside a trace over PROMPT, on the first recurrent mixer."""
    mix = _mixers(model)[0]
    try:
        with torch.no_grad(), model.trace(PROMPT):
            read(mix).save()
    except Exception as error:  # noqa: BLE001  (the class is what is compared)
        return error
    return None


def test_an_index_is_checked_as_states_of_checks_it(model):
    """One check for every index: a float or a bool is refused (not served as ``int(x)``), one outside the axis
    raises naming the range (not wrapped), as ``states_of`` does, on every kind."""
    mix = _mixers(model)[0]
    seq = len(model.tokenizer(PROMPT).input_ids)
    axis = getattr(getattr(type(mix), "EFFECTIVE", None), "axis", "heads")
    width = mix.dims()[type(mix).values()["effective_attention"].annotation.dim_str.split()[1]]
    states_served = type(mix).values()["states"].reason(mix) is None
    bad_positions = {
        "one past the end": ([seq], nnterp.PositionError, rf"position {seq} is outside this call's {seq} tokens \(0\.\.{seq - 1}\)"),
        "before the start": ([-seq - 1], nnterp.PositionError, rf"position {-seq - 1} is outside"),
        "a float": ([1.5], nnterp.WrongType, "got float"),
        "a bool": ([1, True], nnterp.WrongType, "got bool"),
        "a float tensor": (torch.tensor([1.0]), nnterp.WrongType, "got float"),
    }
    for case, (bad, error, message) in bad_positions.items():
        raised = _raised(model, lambda m, bad=bad: m.effective_attention_of(positions=bad))
        assert isinstance(raised, error) and re.search(message, str(raised)), (case, raised)
        if states_served:
            assert isinstance(_raised(model, lambda m, bad=bad: m.states_of(bad)), error), case
    for bad, error in ((seq, nnterp.PositionError), (1.5, nnterp.WrongType), (True, nnterp.WrongType)):
        assert isinstance(_raised(model, lambda m, bad=bad: m.effective_attention_of(positions=bad)), error), bad
    raised = _raised(model, lambda m: m.effective_attention_of(**{axis: [width]}))
    assert isinstance(raised, nnterp.PositionError) and f"outside the mixer's {width} {axis}" in str(raised), raised
    raised = _raised(model, lambda m: m.effective_attention_of(**{axis: [0.5]}))
    assert isinstance(raised, nnterp.WrongType), raised
