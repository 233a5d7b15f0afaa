"""The HF ``kernels`` package's bindings, played by a stand-in, for every recurrent family.

With ``kernels`` installed (and ``USE_HUB_KERNELS`` not disabled), transformers
binds each kernel name of a modeling module to an ``nn.Module`` whose forward
calls the function (``kernels``' ``Func``, carrying ``kernel_layer_name``), and
nnsight cannot drill into a call of a submodule. The stand-in is such a module,
bound in place of the family's kernel names and restored after: every value read
inside the kernel call then says so, in ``support()`` and in `Unavailable` alike,
with the ``USE_HUB_KERNELS=0`` fix, and the rest of the model is untouched.
"""

from __future__ import annotations

import pytest
import torch

from nnterp import Unavailable
from nnterp.families import families

PROMPT = "The Eiffel Tower is in the city of"
#: One model type per family whose mixer reads inside its kernels.
RECURRENT = [family.MODEL_TYPES[0] for family in families() if getattr(family.MIXER, "CHUNK_FUNCTION", "")]


class HubFunc(torch.nn.Module):
    """Plays ``kernels.layer.layer._create_func_module.<locals>.Func``: a module whose forward calls a kernel."""

    def __init__(self, func, name: str) -> None:
        super().__init__()
        self.func = func
        self.kernel_layer_name = name

    def forward(self, *args, **kwargs):
        return self.func(*args, **kwargs)


class hub_bound:
    """Bind ``family``'s kernel names to `HubFunc` stand-ins; restore the originals on exit."""

    def __init__(self, family) -> None:
        mixer = family.MIXER
        self.modeling = family.MODELING
        self.names = (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION)
        self.originals = {name: self.modeling.__dict__[name] for name in self.names}

    def __enter__(self):
        for name, fn in self.originals.items():
            setattr(self.modeling, name, HubFunc(fn, name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.modeling, name, fn)


def _reasons(model, value: str) -> set:
    entry = model.support()[f"linear_attn.{value}"]
    if entry is None:
        return {None}
    return set(entry.values()) if isinstance(entry, dict) else set(entry)


@pytest.mark.parametrize("model_type", RECURRENT)
def test_a_hub_module_binding_is_reported_with_the_fix(load, model_type):
    model = load(model_type)
    layer = next(i for i, block in enumerate(model.layers) if block.linear_attn is not None)
    mix = model.layers[layer].linear_attn
    names = list(type(mix).values())
    before = model.support()
    with torch.no_grad(), model.trace(PROMPT):
        clean = model.logits.save()

    with hub_bound(model.family) as bound:
        support = model.support()
        changed = {name for name in names if before[f"linear_attn.{name}"] is None and support[f"linear_attn.{name}"] is not None}
        # A short convolution's state_output is the cache's window, read outside the kernel call.
        outside = type(mix).values()["state_output"].unavailable is None
        assert changed and ("state_output" in changed or outside), "the values read inside the kernel call say why"
        for name in changed:
            (reason,) = _reasons(model, name)
            assert "HF `kernels` package" in reason and "USE_HUB_KERNELS=0" in reason, reason
            assert any(kernel in reason for kernel in bound.names), reason
        assert support["linear_attn.attention_output"] is None, "the mixer's own output does not need the kernel"

        value = sorted(changed)[0]
        with pytest.raises(Unavailable) as raised, model.trace(PROMPT):
            getattr(mix, value)
        assert raised.value.reason in _reasons(model, value)
        assert f"linear_attn.{value} is unavailable" in str(raised.value)

        with torch.no_grad(), model.trace(PROMPT):
            out = mix.attention_output.save()
            logits = model.logits.save()
        assert out.shape[-1] == model._module.config.get_text_config().hidden_size
        torch.testing.assert_close(logits, clean, rtol=0, atol=0)

    assert model.support() == before, "unbinding the stand-in serves everything again"
