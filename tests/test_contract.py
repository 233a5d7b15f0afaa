"""The contract every registered family keeps, run for each one automatically.

(a) the standardized model's logits are the plain transformers model's;
(b) every declared value is served with its documented shape on every layer
    that has its component, or raises `Unavailable` with the reason
    ``support()`` gives;
(c) writing a value back unchanged leaves the logits unchanged;
(d) a block has exactly the parts its config says;
(e) ``next_token_probs`` of a left-padded batch is each prompt's alone (or refused with the family's
    ``PADDING_REFUSED`` where its model ignores the attention mask);
(f) a left-padded greedy ``generate`` is each prompt's alone, or, where the family declares
    ``PADDING_DIFFERS``, exactly transformers' own padded generate (the declaration is checked, not trusted);
(g) every value name a component serves is in the glossary (`nnterp.core.names`), and the glossary lists
    no name that nothing serves.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import nnterp
from nnterp import Unavailable
from nnterp.components.layer import PARTS
from nnterp.core.names import VALUES
from nnterp.core.standard import Standard
from nnterp.families import REGISTRY, absent, families
from tests.suites.checkpoint import model_type_params

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"
TYPES = model_type_params(sorted(REGISTRY))
RECURRENT = model_type_params([t for t in sorted(REGISTRY) if absent(t) is None and REGISTRY[t].MIXER is not None])


@pytest.fixture(scope="module", params=TYPES)
def case(request, load, checkpoint):
    return request.param, load(request.param), checkpoint(request.param)


@pytest.fixture(scope="module", params=RECURRENT)
def recurrent(request, load):
    return request.param, load(request.param)


def _routing(model):
    return nnterp.route_kernels(model.family, "torch")


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_logits_equal_plain_transformers(case):
    _, model, path = case
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf(ids).logits
    with torch.no_grad(), model.trace(ids):
        logits = model.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6, msg="logits")


def test_layers_have_the_parts_the_config_says(case):
    _, model, _ = case
    config = model._module.config
    expected = model.family.layer_parts(config)
    assert len(model.layers) == len(expected)
    for index, (layer, parts) in enumerate(zip(model.layers, expected)):
        assert set(layer.parts()) == parts, f"layer {index}"
        for part in set(PARTS) - parts:
            assert getattr(layer, part) is None, f"layer {index} has no {part}"


def _expected_shape(model, component, value, batch, seq):
    config = model._module.config.get_text_config()
    sizes = {"batch": batch, "seq": seq, "hidden": config.hidden_size, "vocab": config.vocab_size, **component.dims()}
    return tuple(sizes[name] for name in value.annotation.dim_str.split())


def _components(layer):
    return [("layer", layer)] + [(part, getattr(layer, part)) for part in PARTS if hasattr(type(getattr(layer, part)), "values")]


def test_every_value_is_served_with_its_shape_or_says_why_not(case):
    _check_every_value(case[1], routed=False)


def test_every_value_routed_is_served_with_its_shape_or_says_why_not(recurrent):
    _check_every_value(recurrent[1], routed=True)


def _check_every_value(model, routed):
    seq = len(model.tokenizer(PROMPT).input_ids)
    with _routing(model) if routed else _Nothing():
        support = model.support()
        checked = 0
        for index, layer in enumerate(model.layers):
            for kind, component in _components(layer):
                for name, value in type(component).values().items():
                    entry = support[f"{kind}.{name}"]
                    reason = entry if entry is None or isinstance(entry, str) else entry[index]
                    if reason is not None:
                        with pytest.raises(Unavailable) as raised, model.trace(PROMPT):
                            getattr(component, name)
                        assert raised.value.reason == reason
                        continue
                    got = []  # a None bound inside the trace would not survive it
                    with torch.no_grad(), model.trace(PROMPT):
                        value_read = getattr(component, name)
                        got.append(value_read.save() if value_read is not None else None)
                    served = got[0]
                    if value.none_on_fresh_prompt:
                        assert served is None, f"{kind}.{name} on a fresh prompt"
                        continue
                    shape = _expected_shape(model, component, value, 1, seq)
                    assert tuple(served.shape) == shape, f"layer {index} {kind}.{name}"
                    checked += 1
        assert checked > 0


def test_writing_values_back_unchanged_leaves_logits_unchanged(case):
    _, model, _ = case
    with torch.no_grad(), model.trace(PROMPT):
        baseline = model.logits.save()
    for index, layer in enumerate(model.layers):
        for kind, component in _components(layer):
            for name, value in type(component).values().items():
                if not value.writable or value.reason(component) is not None:
                    continue
                if value.none_on_fresh_prompt:
                    continue  # nothing enters a prompt; written back on a decode step below
                with torch.no_grad(), model.trace(PROMPT):
                    setattr(component, name, getattr(component, name))
                    logits = model.logits.save()
                torch.testing.assert_close(logits, baseline, rtol=0, atol=0, msg=f"layer {index} {kind}.{name}")


def test_entering_values_written_back_on_a_decode_step_change_nothing(recurrent):
    _, model = recurrent
    mixers = [layer.linear_attn for layer in model.layers if getattr(layer, "linear_attn", None) is not None]
    entering = [name for name, value in type(mixers[0]).values().items() if value.writable and value.none_on_fresh_prompt]
    assert entering, "a recurrent mixer serves what enters a call from the cache"
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad(), model.generate(PROMPT, **kwargs) as tracer:
        for step in tracer.iter[1]:
            plain = model.logits.save()
        ids = tracer.result.save()
    for name in entering:
        with torch.no_grad(), model.generate(PROMPT, **kwargs) as tracer:
            for step in tracer.iter[1]:
                for mixer in mixers:
                    current = getattr(mixer, name)
                    assert current is not None, f"{name} on a decode step"
                    setattr(mixer, name, current)
                logits = model.logits.save()
            written = tracer.result.save()
        torch.testing.assert_close(logits, plain, rtol=0, atol=0, msg=name)
        assert torch.equal(written, ids), name


def test_next_token_probs_of_a_left_padded_batch_is_each_prompt_alone(case):
    _, model, _ = case
    assert len(model.tokenizer(PROMPT).input_ids) != len(model.tokenizer(OTHER).input_ids)
    if model.family.PADDING_REFUSED is not None:  # the model ignores the mask: refused, not run wrong
        with pytest.raises(nnterp.NnterpError) as raised, torch.no_grad(), model.trace([PROMPT, OTHER]):
            model.next_token_probs.save()
        assert str(raised.value) == model.family.PADDING_REFUSED
        return
    with torch.no_grad(), model.trace([PROMPT, OTHER]):
        batch = model.next_token_probs.save()
    if model.family.PADDING_DIFFERS is not None:
        # transformers' own forward mixes the padding into the row: nnterp must serve exactly what it computes.
        hf = AutoModelForCausalLM.from_pretrained(case[2]).eval()
        inputs = model.tokenizer([PROMPT, OTHER], return_tensors="pt", padding=True)
        positions = (inputs.attention_mask.cumsum(-1) - 1).clamp(min=0)  # as nnsight supplies them for a padded row
        with torch.no_grad():
            logits = hf(**inputs, position_ids=positions).logits[:, -1]
        torch.testing.assert_close(batch, torch.softmax(logits, -1), rtol=0, atol=1e-6)
        return
    for row, prompt in enumerate([PROMPT, OTHER]):
        with torch.no_grad(), model.trace(prompt):
            alone = model.next_token_probs.save()
        torch.testing.assert_close(batch[row], alone[0], rtol=1e-4, atol=1e-5, msg=f"row {row}")
    assert not torch.allclose(batch[0], batch[1], atol=1e-3)


def test_a_left_padded_generate_is_each_prompt_alone_or_the_family_says_why(case):
    """(f) Greedy ``generate`` of a left-padded batch: each row is what transformers generates from its prompt alone,
    unless the family declares ``PADDING_DIFFERS`` (then exactly transformers' own padded generate) or refuses padding."""
    _, model, path = case
    if model.family.PADDING_REFUSED is not None:
        return  # refused before it runs: test_next_token_probs_of_a_left_padded_batch_is_each_prompt_alone
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad(), model.generate([PROMPT, OTHER], **settings) as tracer:
        batch = tracer.result.save()
    padded = model.tokenizer([PROMPT, OTHER], return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = hf.generate(**padded, **settings)
        alone = [hf.generate(**model.tokenizer(prompt, return_tensors="pt"), **settings)[0, -4:] for prompt in (PROMPT, OTHER)]
    assert torch.equal(batch, ours), "nnterp serves what transformers' own padded generate computes"
    differs = [row for row in range(2) if not torch.equal(batch[row, -4:], alone[row])]
    if model.family.PADDING_DIFFERS is None:
        assert differs == [], f"rows {differs} differ from their prompt alone, and the family declares no PADDING_DIFFERS"


def _served() -> dict:
    """``{value name: [component classes serving it]}`` over every registered family's components."""
    classes = {
        klass
        for family in families()
        for klass in (*family.COMPONENTS.values(), family.LAYER, family.MIXER)
        if isinstance(klass, type) and issubclass(klass, Standard)
    }
    served: dict = {}
    for klass in sorted(classes, key=lambda k: k.__name__):
        for name in klass.values():
            served.setdefault(name, []).append(klass.__name__)
    return served


def test_every_served_value_name_is_in_the_glossary():
    missing = {name: where for name, where in _served().items() if name not in VALUES}
    assert not missing, f"value names outside nnterp/core/names.py (take a name there, or add one line): {missing}"


def test_the_glossary_names_only_served_values():
    unserved = sorted(set(VALUES) - set(_served()))
    assert not unserved, f"nnterp/core/names.py lists names no component serves: {unserved}"
