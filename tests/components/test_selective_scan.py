"""SelectiveScan (Mamba-1): its kernels' argument tables, and the spec's block as written on the tiny ``mamba`` checkpoint.

The Mamba-1 oracle suite runs for the family in tests/families/test_mamba.py.
"""

from __future__ import annotations

import torch

from nnterp.components.selective_scan import SelectiveScan
from nnterp.recurrent.arguments import CHANNELS_FIRST, ONE_TOKEN
from tests.blocks import check_printed, run_block
from tests.suites.standins import compiled_kernels, mixer_kernels


def test_the_two_kernels_hold_each_argument_in_their_own_place_and_layout():
    chunk, step = SelectiveScan.CHUNK_ARGUMENTS, SelectiveScan.RECURRENT_ARGUMENTS
    assert chunk["x"] == (0, CHANNELS_FIRST) and step["x"] == (1, ONE_TOKEN)
    assert chunk["dt_bias"][0] == "delta_bias" and step["dt_bias"][0] == "dt_bias"
    assert "state" not in chunk, "Mamba-1's prompt kernel takes no initial state"
    x = torch.arange(24.0).reshape(2, 3, 4)  # [batch, channels, seq]
    view = CHANNELS_FIRST.read(x)
    assert view.shape == (2, 4, 3) and torch.equal(CHANNELS_FIRST.write(view, x), x)


SPEC_BLOCK = '''
mamba = StandardizedTransformer("state-spaces/mamba-130m-hf", dispatch=True, device="cpu")
scan = mamba.layers[0].linear_attn
print(type(scan).__name__, type(scan).STATE_OP, type(scan).STEP_STATE_OP)   # SelectiveScan ssm_state_3 ssm_state_0
print(mamba.support()["linear_attn.attention_queries"][0])
# read inside transformers' pure-torch mamba_selective_scan, but this process dispatches it to an optimized kernel (mamba_ssm) with no Python source; uninstall it, or call nnterp.route_kernels(model.family, 'torch'), to read these
route_kernels(mamba.family, "torch")
with mamba.trace(prompt):
    states = scan.states.save()
    out = mamba.layers[0].layer_output.save()
print(mamba.support()["linear_attn.states"], tuple(states.shape), tuple(out.shape))   # None (1, 3, 1536, 16) (1, 3, 768)
route_kernels(mamba.family, "default")
'''


def test_the_spec_block_runs_as_written(checkpoint, tmp_path):
    """The design page's Mamba-1 block, on the tiny checkpoint, with mamba_ssm stood in (the block assumes it)."""
    import transformers.models.mamba.modeling_mamba as modeling

    import nnterp
    from nnterp import StandardizedTransformer, route_kernels

    code = SPEC_BLOCK.replace("state-spaces/mamba-130m-hf", str(checkpoint("mamba")))
    scope = dict(torch=torch, nnterp=nnterp, StandardizedTransformer=StandardizedTransformer, route_kernels=route_kernels, prompt="Hello world there")
    with compiled_kernels(modeling, mixer_kernels(SelectiveScan)):
        try:
            records = run_block(code, tmp_path, "spec_mamba1", scope)
        finally:
            route_kernels(modeling, "default")
    assert check_printed(records) == 1
    texts = [text for _, text in records]
    assert texts[0] == "SelectiveScan ssm_state_3 ssm_state_0"
    config = scope["mamba"]._module.config
    assert texts[1] == f"None (1, 3, {config.intermediate_size}, {config.state_size}) (1, 3, {config.hidden_size})"
    with compiled_kernels(modeling, mixer_kernels(SelectiveScan)):
        assert scope["mamba"].support()["linear_attn.attention_queries"][0] == (
            "read inside transformers' pure-torch mamba_selective_scan, but this process dispatches it to an optimized "
            "kernel (mamba_ssm) with no Python source; uninstall it, or call nnterp.route_kernels(model.family, 'torch'), "
            "to read these"
        )
