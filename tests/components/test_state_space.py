"""StateSpace (Mamba-2): its kernels' argument layouts, and the spec's block as written on the tiny ``mamba2`` checkpoint.

The SSD oracle suite runs for the family in tests/families/test_mamba2.py.
"""

from __future__ import annotations

import torch

from nnterp.components.state_space import StateSpace
from nnterp.recurrent.arguments import ONE_TOKEN_PER_HEAD, PER_HEAD
from tests.blocks import check_printed, run_block


def test_decode_values_are_served_per_head_and_laid_back_expanded():
    assert StateSpace.RECURRENT_ARGUMENTS["dt"] == (2, ONE_TOKEN_PER_HEAD)
    assert StateSpace.CHUNK_ARGUMENTS["state"][0] == "initial_states"
    dt = torch.arange(3.0)[None, :, None].expand(2, 3, 4)  # [batch, heads, head_dim], expanded per head
    view = ONE_TOKEN_PER_HEAD.read(dt)
    assert view.shape == (2, 1, 3) and torch.equal(ONE_TOKEN_PER_HEAD.write(view, dt), dt)
    A = torch.arange(3.0)[:, None, None].expand(3, 4, 5)  # [heads, head_dim, state_size]
    assert torch.equal(PER_HEAD.read(A), torch.arange(3.0)) and torch.equal(PER_HEAD.write(PER_HEAD.read(A), A), A)


SPEC_BLOCK = '''
mamba2 = StandardizedTransformer("AntonV/mamba2-130m-hf", dispatch=True, device="cpu")
ssd = mamba2.layers[0].linear_attn
route_kernels(mamba2.family, "torch")
print(mamba2.support()["linear_attn.states"][0])
# the chunk scan materializes the state only at chunk boundaries, every 256 tokens (chunk_size=256); call nnterp.chunk_per_token(model) to set every mixer's chunk_size to 1, so every token is a boundary (slower on long prompts)
nnterp.chunk_per_token(mamba2)
with mamba2.trace(prompt):
    states = ssd.states.save()
    out = ssd.state_output.save()
print(mamba2.support()["linear_attn.states"], tuple(states.shape), torch.equal(states[:, -1], out))   # None (1, 3, 24, 128, 64) True
nnterp.chunk_per_token(mamba2, enabled=False)
route_kernels(mamba2.family, "default")
'''


def test_the_spec_block_runs_as_written(checkpoint, tmp_path):
    import transformers.models.mamba2.modeling_mamba2 as modeling

    import nnterp
    from nnterp import StandardizedTransformer, route_kernels

    code = SPEC_BLOCK.replace("AntonV/mamba2-130m-hf", str(checkpoint("mamba2")))
    scope = dict(torch=torch, nnterp=nnterp, StandardizedTransformer=StandardizedTransformer, route_kernels=route_kernels, prompt="Hello world there")
    try:
        records = run_block(code, tmp_path, "spec_mamba2", scope)
    finally:
        route_kernels(modeling, "default")
    assert check_printed(records) == 1
    config = scope["mamba2"]._module.config
    assert records[0][1] == f"None (1, 3, {config.num_heads}, {config.head_dim}, {config.state_size}) True"
    module = scope["ssd"]._module
    assert module.chunk_size == config.chunk_size, "enabled=False restored the chunk size"
    assert scope["mamba2"].support()["linear_attn.states"][0] == (
        f"the chunk scan materializes the state only at chunk boundaries, every {config.chunk_size} tokens "
        f"(chunk_size={config.chunk_size}); call nnterp.chunk_per_token(model) to set every mixer's chunk_size to 1, "
        "so every token is a boundary (slower on long prompts)"
    )
