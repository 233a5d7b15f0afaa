"""``tokenizer_kwargs=`` reaches the tokenizer, and a right-padded batch is served as each prompt alone, or refused.

``StandardizedTransformer(path, tokenizer_kwargs=dict(padding_side="right"))``
used to be handed on to ``from_pretrained`` and die at the first trace in a
``TypeError`` from the model's ``__init__``. Now the padding side is the
user's, also after nnsight loads the pipeline (which sets left padding for a
causal LM). On a right-padded batch each row's real tokens are the prompt
alone (oracle: a plain transformers forward of each prompt by itself), and
``next_token_probs`` is read at each row's own last token, as documented.
Where a run needs every row to end at the last position, it is refused: a
``generate`` (it continues each row after the last position), the lens
helpers, and the families whose model ignores the mask (``PADDING_REFUSED``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import NnterpError, StandardizedTransformer
from nnterp.families import REGISTRY
from nnterp.interventions import logit_lens
from tests.suites.checkpoint import model_type_params

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"


def right_padded(checkpoint, model_type: str, **kwargs) -> StandardizedTransformer:
    return StandardizedTransformer(str(checkpoint(model_type)), device="cpu", tokenizer_kwargs=dict(padding_side="right"), **kwargs)


@pytest.mark.parametrize("dispatch", [False, True])
def test_the_padding_side_is_applied_and_survives_the_first_trace(checkpoint, dispatch):
    model = right_padded(checkpoint, "llama", dispatch=dispatch)
    assert model.tokenizer.padding_side == "right"
    with torch.no_grad(), model.trace([PROMPT, OTHER]):
        logits = model.logits.save()
    assert model.tokenizer.padding_side == "right"
    ids = model.tokenizer([PROMPT, OTHER], padding=True, return_tensors="pt").attention_mask
    assert not bool(ids[:, -1].all()) and logits.shape[:2] == ids.shape  # the batch really was right-padded


def test_a_given_tokenizer_gets_the_settings_too(checkpoint):
    from transformers import AutoTokenizer

    path = str(checkpoint("llama"))
    model = StandardizedTransformer(path, tokenizer=AutoTokenizer.from_pretrained(path), tokenizer_kwargs=dict(padding_side="right"))
    with torch.no_grad(), model.trace(PROMPT):
        model.logits.save()
    assert model.tokenizer.padding_side == "right"


@pytest.mark.parametrize("model_type", model_type_params(sorted(REGISTRY)))
def test_a_right_padded_batch_is_each_prompt_alone_or_refused(checkpoint, model_type):
    model = right_padded(checkpoint, model_type)
    if model.family.PADDING_REFUSED is not None:
        with pytest.raises(NnterpError) as raised, torch.no_grad(), model.trace([PROMPT, OTHER]):
            model.next_token_probs.save()
        assert str(raised.value) == model.family.PADDING_REFUSED
        return
    inputs = model.tokenizer([PROMPT, OTHER], padding=True, return_tensors="pt")
    lengths = inputs.attention_mask.sum(-1).tolist()
    assert inputs.attention_mask[:, 0].all() and min(lengths) < inputs.attention_mask.shape[1]
    with torch.no_grad(), model.trace([PROMPT, OTHER]):
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint(model_type)).eval()
    for row, prompt in enumerate([PROMPT, OTHER]):
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            alone = hf(ids).logits[0]
        torch.testing.assert_close(logits[row, : lengths[row]], alone, rtol=1e-4, atol=1e-5, msg=f"row {row}")
        torch.testing.assert_close(probs[row], torch.softmax(alone[-1].float(), -1), rtol=1e-4, atol=1e-5, msg=f"row {row}")


def test_generate_and_the_lens_refuse_a_right_padded_batch(checkpoint):
    model = right_padded(checkpoint, "llama")
    with pytest.raises(NnterpError, match="padding_side = 'left'"), model.generate([PROMPT, OTHER], max_new_tokens=2):
        pass
    with pytest.raises(NnterpError, match="padding_side = 'left'"):
        logit_lens(model, [PROMPT, OTHER])
    # One prompt has no padding: both run.
    with model.generate(PROMPT, max_new_tokens=2) as tracer:
        out = tracer.result.save()
    assert out.shape[-1] == len(model.tokenizer(PROMPT).input_ids) + 2
    assert logit_lens(model, PROMPT).shape[:2] == (1, model.num_layers)
    # The default left padding still serves a batch.
    model.tokenizer.padding_side = "left"
    assert logit_lens(nnterp.StandardizedTransformer(str(checkpoint("llama"))), [PROMPT, OTHER]).shape[0] == 2
