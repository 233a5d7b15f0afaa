"""OLMo-Hybrid: the gated-DeltaNet oracle suite (tests/components/test_gated_deltanet.py), and what the family adds."""

import pytest
import torch
import transformers
import transformers.models.olmo_hybrid.modeling_olmo_hybrid as modeling

from nnterp.components.gated_deltanet import LinearAttention
from nnterp.recurrent.labels import labels_for
from tests.components.test_gated_deltanet import PROMPT, GatedDeltaNetSuite
from tests.reference import hf_oracles as hf


class TestOlmoHybrid(GatedDeltaNetSuite):
    MODEL_TYPE = "olmo_hybrid"

    def test_both_block_classes_are_layers(self, model):
        hf_layers = model._at(model.family.LAYERS)
        kinds = [type(layer._module) for layer in hf_layers]
        assert kinds == [modeling.OlmoHybridLinearAttentionDecoderLayer] * 3 + [modeling.OlmoHybridAttentionDecoderLayer]
        assert [sorted(layer.parts()) for layer in model.layers] == [["linear_attn", "mlp"]] * 3 + [["mlp", "self_attn"]]

    def test_the_cache_test_is_the_installed_forwards(self):
        major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
        expected = "get_recurrent_state" if (major, minor) >= (5, 21) else "has_previous_state()"
        assert labels_for(LinearAttention, modeling.OlmoHybridGatedDeltaNet)["CACHE_TEST"] == expected

    def test_betas_may_exceed_one_with_negative_eigenvalues(self, model):
        assert model._module.config.linear_allow_neg_eigval
        with torch.no_grad(), model.trace(PROMPT):
            beta = model.layers[0].linear_attn.betas.save()
        assert ((beta > 0) & (beta < 2)).all() and (beta > 1).any()

    def test_the_kernel_read_is_the_one_the_forward_picks_when_layers_disagree(self, model, plain, ids):
        """Clear the last linear block's flag after a prompt: up to 5.20 every block then restarts (the layer-less test)."""
        def primed():
            with torch.no_grad():
                cache = hf.output_cache(plain(ids, use_cache=True))
            cache.layers[2].has_previous_state[0] = False
            return cache

        step = ids[:, -1:]
        mix = model.layers[0].linear_attn
        entering = []
        with torch.no_grad(), model.trace(step, **{hf.cache_kwarg(plain): primed()}):
            state_in = mix.state_input
            entering.append(state_in.save() if state_in is not None else None)
            state_out = mix.state_output.save()
        expected_cache = primed()
        with torch.no_grad():
            plain(step, use_cache=True, **{hf.cache_kwarg(plain): expected_cache})
        restarts = model.layers[0].linear_attn.CACHE_TEST == "has_previous_state()"
        assert (entering[0] is None) == restarts
        torch.testing.assert_close(state_out, hf.recurrent_state(expected_cache, 0), rtol=1e-5, atol=1e-6)


    def test_the_cache_test_is_found_by_name_or_fails_naming_the_release(self):
        from nnterp import NnterpError
        from nnterp.recurrent.labels import cache_test as _previous_state_test

        assert _previous_state_test(_gets) == "get_recurrent_state"
        assert _previous_state_test(_asks_any_layer) == "has_previous_state()"
        assert _previous_state_test(_asks_its_layer) == "has_previous_state(layer)"
        with pytest.raises(NnterpError, match=rf"cache test.*transformers {transformers.__version__}"):
            _previous_state_test(_asks_nothing)


def _gets(self, hidden_states, cache=None):
    recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    return recurrent_state


def _asks_any_layer(self, hidden_states, cache_params=None):
    use_precomputed_states = cache_params is not None and cache_params.has_previous_state()
    return use_precomputed_states


def _asks_its_layer(self, hidden_states, cache_params=None):
    use_precomputed_states = cache_params is not None and cache_params.has_previous_state(self.layer_idx)
    return use_precomputed_states


def _asks_nothing(self, hidden_states, cache=None):
    return hidden_states
