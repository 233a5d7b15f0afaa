"""Lightning attention's recurrence in pure torch (MiniMax-01, arXiv:2501.08313; Qin et al., arXiv:2401.04658).

Per head, a state ``S`` of ``[key_dim, value_dim]`` decays by a fixed rate
``λ_h`` (HF's ``slope_rate``) every token and adds the token's ``kᵀv``:

    S_t = exp(g_t) S_{t-1} + k_tᵀ v_t        (g_t = -λ_h, the log decay)
    o_t = q_t S_t                            (before the mixer's norm and gate)

`lightning_scan` runs it token by token with the same operations as
transformers' decode branch (``ratio * S + kᵀv``, then ``q @ S``), so a state
continued here equals a plain forward fed one token at a time over a replaced
cache bit for bit; `lightning_attention` is the exact effective attention of the
same outputs, ``A[t, s] = (q_t · k_s) exp(Σ_{s<r≤t} g_r)``. `lightning_states`
writes the state after every token (no outputs) into one preallocated float32
buffer in place (`scan.fill_states`; on a CPU token by token: one multiply into the token's slot, one
``addcmul_``), for reads without autograd; `lightning_one_pass` also reads each
state with its query, the outputs of a prompt computed with its states.

Shapes, tokens first: ``q``, ``k`` ``[batch, seq, heads, key_dim]``, ``v``
``[batch, seq, heads, value_dim]``, ``g`` ``[batch, seq, heads]``; a state
``[batch, heads, key_dim, value_dim]`` in the inputs' dtype.

The failure mode worth knowing: the in-place path equals the recurrence to
float32 rounding, not bit for bit (an ``addcmul_`` may round as one fused
multiply-add where ``ratio * S + kᵀv`` rounds twice), so where a continued
state must match the forward's own token loop (a decode step, a state in
another dtype, autograd) the token loop `lightning_scan` serves instead.

There is no kernel call: the forward computes the recurrence itself, blockwise
on a prompt. ``arguments`` are the call's ``q``, ``k``, ``v``, ``g`` and the
entering ``state`` as the component reads them; by those names
(`nnterp.fast.spec`): `states`, `one_pass`, `state_shape`, `tap`, `final_state`,
`effective_attention`; the specs ``FAST``, ``EFFECTIVE``. The forward's own
return, as `one_pass` and the component's ``run_kernel`` give it, is
``(outputs [batch, heads, seq, value_dim], final state)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .buffers import empty_states
from .scan import differentiable, fill_states
from .spec import EffectiveSpec, FastSpec, indices


def lightning_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial: torch.Tensor | None = None, keep: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(outputs [batch, seq, heads, value_dim], final state, states [batch, seq, heads, key_dim, value_dim] or None)``.

    ``initial``: the state entering the first token (zeros when ``None``);
    ``keep``: also return the state after every token (``seq`` times the state's memory).
    """
    batch, seq, heads, key_dim = q.shape
    state = initial if initial is not None else q.new_zeros(batch, heads, key_dim, v.shape[-1])
    queries, keys, values = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, dim], as the forward holds them
    ratio = g.exp().transpose(1, 2)[..., None]  # [batch, heads, seq, 1]
    outputs, states = [], []
    for i in range(seq):
        state = ratio[:, :, i : i + 1] * state + torch.matmul(keys[:, :, i : i + 1].transpose(-1, -2), values[:, :, i : i + 1])
        outputs.append(torch.matmul(queries[:, :, i : i + 1], state))
        if keep:
            states.append(state)
    out = torch.cat(outputs, dim=2).transpose(1, 2)
    return out, state, torch.stack(states, dim=1) if keep else None


def lightning_states(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial: torch.Tensor | None = None, out: torch.Tensor | None = None, first: int = 0
) -> torch.Tensor:
    """The state after every token, written in place into ``out`` ``[batch, seq, heads, key_dim, value_dim]`` float32.

    ``k``, ``v``, ``g`` are the tokens written (tokens first, as for
    `lightning_scan`); token ``j`` goes to ``out[:, first + j]`` (``out`` is
    `empty_states` of ``[batch, n, ...]`` when ``None``, ``first`` then 0).
    ``initial``: the state before token ``first`` (zeros when ``None``; may be
    a view of ``out``). No autograd: raises `ValueError` on an input that
    records a graph (use `lightning_scan` with ``keep=True`` there).
    """
    batch, seq, heads, key_dim = k.shape
    if differentiable(k, v, g, initial):
        raise ValueError("lightning_states writes in place: under autograd use lightning_scan(keep=True)")
    if out is None:
        out, first = empty_states((batch, seq, heads, key_dim, v.shape[-1]), k.device), 0
    start = k.new_zeros((batch, heads, key_dim, v.shape[-1]), dtype=torch.float32) if initial is None else initial.float()
    fill_states(out, first, start, g.float().transpose(1, 2)[..., None], k.float().transpose(1, 2), v.float().transpose(1, 2))
    return out


def lightning_one_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`lightning_states` from a zero state (``first`` 0) that also reads every state: ``o_t = q_t S_t``.

    Returns the outputs ``[batch, heads, seq, value_dim]`` (heads first, as the
    forward holds them), float32, each block of states read by its queries while
    still in cache (`scan.fill_states` with ``read``); no autograd. ``out`` may be
    a ring of fewer tokens (token ``t`` in slot ``t % slots``).
    """
    if differentiable(q, k, v, g):
        raise ValueError("lightning_one_pass writes in place: under autograd use lightning_scan(keep=True)")
    batch, _, heads, key_dim = k.shape
    start = k.new_zeros((batch, heads, key_dim, v.shape[-1]), dtype=torch.float32)
    queries, keys, values = q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)
    return fill_states(out, 0, start, g.float().transpose(1, 2)[..., None], keys, values, read=queries, read_rows=True)[1]


def lightning_attention(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, initial: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(A [batch, heads, seq, seq], readout [batch, seq, heads, value_dim] or None)``, float32.

    ``o_t = Σ_s A[t, s] v_s + readout_t`` with ``A[t, s] = (q_t · k_s) exp(Σ_{s<r≤t} g_r)``
    for ``s ≤ t`` (0 above the diagonal) and ``readout_t = exp(Σ_{r≤t} g_r) q_t S_0``.
    """
    q32, k32, g32 = q.float(), k.float(), g.float()
    total = torch.cumsum(g32, dim=1).transpose(1, 2)  # [batch, heads, seq]: Σ_{r≤t} g_r
    gap = total[..., :, None] - total[..., None, :]  # Σ_{s<r≤t} g_r
    seq = q.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, gap, torch.full_like(gap, float("-inf"))).exp()
    scores = torch.einsum("bthd,bshd->bhts", q32, k32)
    readout = None
    if initial is not None:
        readout = torch.einsum("bthd,bhde->bthe", q32, initial.float()) * total.exp().transpose(1, 2)[..., None]
    return scores * decay, readout


def lightning_tap_readout(q: torch.Tensor, g: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``o_u = q_u Σ_{t<u} exp(Σ_{t<r≤u} g_r) taps_t``, ``[batch, seq, heads, value_dim]``: how the tokens after ``t`` read
    an addition ``taps_t`` ``[batch, seq, heads, key_dim, value_dim]`` to the state after token ``t``."""
    batch, seq, heads, key_dim = q.shape
    carried = taps.new_zeros(batch, heads, key_dim, taps.shape[-1])
    outputs = []
    for u in range(seq):
        if u:
            carried = g[:, u, :, None, None].exp() * (carried + taps[:, u - 1])
        outputs.append(torch.einsum("bhd,bhde->bhe", q[:, u], carried))
    return torch.stack(outputs, dim=1)


# -- by the names the component reads (`nnterp.fast.spec`) -------------------------------


def in_place(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor | None) -> bool:
    """Whether a run's states are written in place (`lightning_states`), not by the token loop (`lightning_scan`):
    from zeros, in float32, without autograd. The token loop is kept under autograd (a graph to keep), in another
    dtype (computed in it, as transformers does) and from a given state (a decode step: the forward runs the same token
    loop there, so its states equal the cache's bit for bit, which an ``addcmul_`` would not)."""
    return state is None and k.dtype == torch.float32 and not differentiable(k, v, g)


def final_state(arguments: dict) -> torch.Tensor:
    """The state after a run's last token as `states` computes it (so it is ``states[:, -1]`` bit for bit): in place in a
    two-slot ring where `in_place`, else the token loop's."""
    a = arguments
    k, v, g, state = a["k"], a["v"], a["g"], a.get("state")
    if in_place(k, v, g, state):
        ring = k.new_empty((k.shape[0], 2, k.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32)
        lightning_states(k, v, g, None, ring)
        return ring[:, (k.shape[1] - 1) % 2].clone()
    return lightning_scan(a.get("q", k), k, v, g, state)[1]


def lightning_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial: torch.Tensor | None) -> tuple:
    """The forward's own return on a run of tokens from ``initial``: ``(outputs [batch, heads, seq, value_dim], final
    state)``, its final state computed as `states` computes the run's last (in place in a two-slot ring, or the token
    loop's), so a run's final state is ``states[:, -1]`` bit for bit."""
    if in_place(k, v, g, initial):
        ring = k.new_empty((k.shape[0], 2, k.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32)
        outputs = lightning_one_pass(q, k, v, g, ring)
        return outputs, ring[:, (k.shape[1] - 1) % 2].clone()
    outputs, final, _ = lightning_scan(q, k, v, g, initial)
    return outputs.transpose(1, 2), final


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """The state after every token, into ``out`` when given: in place (`lightning_states`) where `in_place`, else the
    token loop's (`lightning_scan`)."""
    a = arguments
    q, k, v, g, state = a.get("q"), a["k"], a["v"], a["g"], a.get("state")
    if in_place(k, v, g, state):
        return lightning_states(k, v, g, state, out)
    found = lightning_scan(q if q is not None else k, k, v, g, state, keep=True)[2]
    return found if out is None else out.copy_(found)


def one_pass(arguments: dict, out: torch.Tensor) -> tuple | None:
    """``((outputs [batch, heads, seq, value_dim], final state), states)`` in one pass: the forward's own return
    (outputs heads first, as it concatenates them, `FAST.output_axis`) and the states; ``None`` off float32 or on a
    call that continues a state (`lightning_one_pass` starts from zeros)."""
    a = arguments
    if a.get("state") is not None or a["q"].dtype != torch.float32:
        return None
    outputs = lightning_one_pass(a["q"], a["k"], a["v"], a["g"], out)
    return (outputs, out[:, -1].clone()), out


def tap(arguments: dict, taps: torch.Tensor) -> torch.Tensor:
    """An exact zero ``[batch, heads, seq, value_dim]`` (as the outputs are held) that depends on ``taps`` ``[batch,
    seq, ...state]`` as the later tokens' outputs read an addition to each state (`lightning_tap_readout`): added to
    the outputs, the gradient of ``taps`` at ``t`` is the loss's by the state after ``t``."""
    q, g = arguments["q"].detach(), arguments["g"].detach()
    return (lightning_tap_readout(q, g, taps) - lightning_tap_readout(q, g, taps.detach())).transpose(1, 2)


def state_shape(arguments: dict) -> tuple:
    """``(batch, heads, key_dim, value_dim)``."""
    k, v = arguments["k"], arguments["v"]
    return (k.shape[0], k.shape[2], k.shape[3], v.shape[3])


def effective_attention(arguments: dict, positions: Any, heads: Any, coefficients: bool) -> tuple:
    """`lightning_attention` of the call, computed whole, then the rows ``positions`` and the ``heads`` selected."""
    a = arguments
    A, readout = lightning_attention(a["q"], a["k"], a["g"], a.get("state"))
    rows = indices(positions, A.shape[2], "positions").to(A.device)
    chosen = indices(heads, A.shape[1], "heads").to(A.device)
    if readout is not None:
        readout = readout.index_select(1, rows).index_select(2, chosen)
    return (A.index_select(1, chosen).index_select(2, rows) if coefficients else None), readout


#: MiniMax's lightning attention (the forward's own block loop and decode loop).
FAST = FastSpec(
    "lightning attention", states, ("q", "k", "v", "g"), state_shape, one_pass=one_pass, output_axis=2,
    state_tokens=("k", "v", "g"), tap=tap, final_state=final_state,
)
#: MiniMax's lightning attention, prompt and decode step alike.
EFFECTIVE = EffectiveSpec("lightning attention", effective_attention, "heads")
