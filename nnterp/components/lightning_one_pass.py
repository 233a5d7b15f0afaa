"""Lightning attention's ``states`` in one pass: the prompt's outputs computed with every state, the block loop's products skipped.

A prompt's forward computes the recurrence itself, block by block (four
products per block of ``config.block_size`` tokens: the intra-block scores,
their values, the inter-block readout and the block's write to the state),
and ``states`` computes every per-token state again from q, k, v and the
decays (`nnterp.fast.lightning_attention`). Where the states are written in place
anyway (`lightning_run.in_place`: float32, a fresh prompt, no autograd), the
one pass also reads each state with its query (`lightning_one_pass`: ``o_t =
q_t S_t``, a block of states read while still in cache) and skips the four
products of every block: the values product returns the block's outputs, the
other three a zero (the forward adds them, or multiplies by them, to
nothing), and the state the loop ends with is the pass's own last state, which
the forward returns and the cache holds. As the fast path does for the delta
rules and Mamba (`nnterp.recurrent.per_token.from_arguments`) and RWKV-4 and
the mLSTM for their kernels.

It applies when ``states`` is read before the block loop started, with no
write to the call (a write rewrites the outputs after it, `lightning_run.rewrite`),
on one invoke covering the batch, where the installed release's forward
binds the four products by the names below (found once per class), and where
the decay buffers the loop reads (``query_decay``, ``key_decay``,
``diagonal_decay``) are what ``slope_rate``, which the pass reads, gives them
(`decays_agree`: a model loaded in bfloat16 then cast to float32 keeps them
rounded apart); otherwise the loop runs and the states are computed beside it,
as before. The outputs
equal the block loop's to float32 rounding (a recurrence where the loop is
blockwise), as the other one passes' do.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.source import compiled, decorator_chain

from ..core.calls import mediator, pinned
from ..core.errors import NnterpError
from ..core.local import LocalDict
from ..fast.buffers import empty_states
from ..fast.lightning_attention import lightning_one_pass
from ..recurrent.labels import bindings
from ..recurrent.per_token.from_arguments import covers_the_batch
from . import lightning_run as calls

#: Whether ``states`` runs the one pass where it applies (``False``: the block loop runs, the states beside it).
ONE_PASS = True
#: The block loop's products, by the variable each one binds, in the order the loop computes them.
PRODUCTS = ("attn_weights_intra", "attn_output_intra", "attn_output_inter", "next_attn_weights_inter")
#: HF mixer class -> its products' labels (``None``: not found in this release), found once.
FOUND: dict[type, dict | None] = LocalDict()


def find_products(hf_mixer: type) -> dict | None:
    """``{variable: label}`` of the ``torch.matmul`` call each of `PRODUCTS` binds in the block loop, or ``None``."""
    forward = decorator_chain(hf_mixer.forward)[0]
    info = compiled(forward)
    found = {}
    for variable in PRODUCTS:
        try:
            line = info.lines[bindings(forward, variable, in_loop=True)[0]]
        except NnterpError:
            return None
        products = [name for name in info.names if name.startswith("torch_matmul_") and info.lines[name] == line]
        if len(products) != 1:
            return None
        found[variable] = products[0]
    return found


def products_of(hf_mixer: type) -> dict | None:
    if hf_mixer not in FOUND:
        FOUND[hf_mixer] = find_products(hf_mixer)
    return FOUND[hf_mixer]


def decays_agree(hf_mixer: Any) -> bool:
    """Whether the block loop's decay buffers are, to float32 rounding, the ones the mixer's ``slope_rate`` gives."""
    factors = getattr(hf_mixer, "decay_factors", None)
    buffers = [getattr(hf_mixer, name, None) for name in ("query_decay", "key_decay", "diagonal_decay")]
    if factors is None or any(buffer is None for buffer in buffers):
        return False
    with torch.no_grad():
        expected = factors(hf_mixer.slope_rate.float())
        return all(
            b.shape == e.shape and torch.allclose(b.float(), e, rtol=1e-5, atol=0) for b, e in zip(buffers, expected)
        )


def states(mixer: Any, run: calls.Run) -> torch.Tensor | None:
    """The states by the one pass, the block loop's products skipped; ``None`` where it does not apply."""
    if not ONE_PASS or run.writes or run.decays_written or not calls.in_place(run) or not covers_the_batch():
        return None
    products = products_of(type(mixer._module))
    if products is None or not decays_agree(mixer._module):
        return None
    med = mediator("`linear_attn.states`")
    ops = {variable: getattr(mixer.source, label) for variable, label in products.items()}
    # Each product and the loop's state binding occur once per block of every earlier prompt, so before this call's
    # loop starts they have all occurred as often as the state binding had when the call's record was made.
    start = run.first["block_state"]
    if any(med.occurrence(f"{op.path}.output") != start for op in ops.values()):
        return None  # the loop has started (a value inside it, or after it, was read first)
    out = empty_states((run.q.shape[0], run.seq, *mixer._state_shape(run)[1:]), run.q.device)
    with torch.no_grad():
        outputs = lightning_one_pass(run.q, run.k, run.v, run.g, out)
    zero = run.q.new_zeros(())
    size = mixer._module.block_size
    blocks = -(-run.seq // size)
    for block in range(blocks):
        values = {"attn_output_intra": outputs[:, :, block * size : (block + 1) * size]}  # float32, as `in_place` asks
        for variable in PRODUCTS:
            with pinned(start + block):
                ops[variable].skip(values.get(variable, zero))
    # The loop's state ends as its zero writes leave it: the state it returns (and the cache holds) is the pass's last.
    run.final = out[:, -1].clone()
    with pinned(start + blocks - 1):
        Mediator.swap(mixer._at("block_state"), run.final)
    return out


__all__ = ["states", "find_products", "decays_agree", "ONE_PASS"]
