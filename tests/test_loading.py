"""Loading when another package registered its own classes for a model type nnterp serves (nnterp/loading.py).

flash-linear-attention registers its own ``Mamba2Config`` / ``Mamba2ForCausalLM`` for ``"mamba2"`` with
``exist_ok=True`` when transformers imports it (the hub kernels do). The fixture does what fla does, with
classes of a stand-in package, and undoes it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mamba2ForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from nnterp import StandardizedTransformer
from nnterp.loading import ForeignRegistration
from nnterp.testing import tiny_checkpoint
from tests.reference import hf_oracles as hf


class ForeignMamba2Config(PretrainedConfig):
    model_type = "mamba2"


class ForeignMamba2ForCausalLM(PreTrainedModel):
    config_class = ForeignMamba2Config


for cls in (ForeignMamba2Config, ForeignMamba2ForCausalLM):
    cls.__module__ = "fla.models.mamba2.stand_in"  # what nnterp reads to tell a foreign class


@pytest.fixture
def foreign_mamba2():
    AutoConfig.register("mamba2", ForeignMamba2Config, exist_ok=True)
    AutoModelForCausalLM.register(ForeignMamba2Config, ForeignMamba2ForCausalLM, exist_ok=True)
    try:
        yield
    finally:
        CONFIG_MAPPING._extra_content.pop("mamba2", None)
        MODEL_FOR_CAUSAL_LM_MAPPING._extra_content.pop(ForeignMamba2Config, None)


def test_a_foreign_registration_loads_transformers_model(foreign_mamba2):
    folder = tiny_checkpoint("mamba2")
    assert type(AutoConfig.from_pretrained(folder)) is ForeignMamba2Config  # the trap is set
    with pytest.warns(ForeignRegistration, match="fla had registered its own ForeignMamba2Config"):
        model = StandardizedTransformer(folder, dispatch=True)
    assert type(model._module) is Mamba2ForCausalLM
    assert model.layers[0].linear_attn is not None
    plain = Mamba2ForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[3, 17, 5, 9, 12, 4]])
    with torch.no_grad(), model.trace(ids):
        state = model.layers[0].linear_attn.state_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        out = plain(ids, use_cache=True)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)
    torch.testing.assert_close(state, hf.recurrent_state(hf.output_cache(out), 0))


def test_transformers_own_classes_load_without_a_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignRegistration)
        model = StandardizedTransformer(tiny_checkpoint("mamba2"), dispatch=True)
    assert type(model._module) is Mamba2ForCausalLM
