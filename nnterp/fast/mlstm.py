"""The mLSTM's state (Beck et al., 2024, arXiv:2405.04517) packed into one tensor, and its recurrence from a kernel call's arguments.

The mLSTM carries three tensors per head, stored as transformers' kernels
store them, scaled by ``exp(-m)`` so that exponential input gates never
overflow: the matrix memory ``C`` ``[key_dim, value_dim]`` (key first, as a
DeltaNet's state), the normalizer ``n`` ``[key_dim]`` and the stabilizer ``m``
(one number). nnterp serves the three as ONE tensor ``[..., key_dim,
value_dim + 2]``: ``[..., :value_dim]`` is ``C``, ``[..., value_dim]`` is
``n`` and ``[..., value_dim + 1]`` is ``m`` repeated along the key axis. A
single value keeps the three consistent: ``C`` and ``n`` mean nothing without
the ``m`` they are scaled by, so a patch from another prompt must carry all
three, and does. `unpack` reads ``m`` off key row 0.

Per token, from the gate pre-activations ``ĩ`` (input) and ``f̃`` (forget)::

    m_t = max(logsigmoid(f̃_t) + m_{t-1}, ĩ_t)
    C_t = exp(logsigmoid(f̃_t) + m_{t-1} - m_t) C_{t-1} + exp(ĩ_t - m_t) k_t v_tᵀ
    n_t = (the same gates) n_{t-1} + exp(ĩ_t - m_t) k_t

`mlstm_states` runs these equations token by token and stacks the packed
states (differentiable, and with a ``tap`` the outputs too); without autograd
`mlstm_states_into` writes every packed state into one preallocated buffer in
place: the stabilizers ``m_t`` first (`stabilizers`: one ``cummax`` over the
unrolled recurrence, not a loop), then, ``C`` and ``n`` being one decayed
rank-one update of ``[C | n]`` by ``(exp(ĩ_t - m_t) k_t) ⊗ [v_t, 1]``,
`scan.fill_states` into the buffer's ``[..., :value_dim + 1]`` slice. Equal to
float32 rounding (the input gate multiplies ``k`` before the outer product, not
after). `mlstm_one_pass` also reads each state as it is written, the
backend's output, so a call whose states are read need not run the backend.
`mlstm_attention` is the exact effective attention: given the gates and the
denominators, ``h`` is linear in the values.

Shapes, tokens first: ``q``, ``k`` ``[batch, seq, heads, key_dim]``, ``v``
``[batch, seq, heads, value_dim]``, ``igate``, ``fgate`` ``[batch, seq,
heads]`` (pre-activations), a packed state ``[batch, heads, key_dim,
value_dim + 2]``; the backend's own layout is heads first.

The failure mode worth knowing: ``m`` is not unique (any ``m`` serves, ``C``
and ``n`` being scaled by the same ``exp(-m)`` they are written with), so two
correct packed states of one prompt may differ entry by entry; compare them
unscaled (``C exp(m)``), or compare the outputs they give.

By the backend call's names (`nnterp.fast.spec`): `states`, `one_pass`,
`tap`, `state_shape`, `effective_attention`; the specs ``FAST``, ``EFFECTIVE``.
Pure torch: this file knows nothing of nnsight or of the components.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .buffers import empty_states
from .scan import differentiable, fill_states, read_block
from .spec import EffectiveSpec, FastSpec, Selection, indices


def pack(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``(C [..., k, v], n [..., k], m [..., 1])`` -> one float32 tensor ``[..., k, v + 2]`` (a new tensor)."""
    c = c.float()
    return torch.cat([c, n.float()[..., None], m.float()[..., None, :].expand(*c.shape[:-1], 1)], dim=-1)


def unpack(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed state ``[..., k, v + 2]`` -> ``(C [..., k, v], n [..., k], m [..., 1])``, float32, contiguous."""
    return (
        state[..., :-2].contiguous(),
        state[..., -2].contiguous(),
        state[..., 0, -1:].contiguous(),
    )


def mlstm_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    initial: torch.Tensor | None = None,
    tap: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The packed state after every token, ``[batch, seq, heads, key_dim, value_dim + 2]``, float32.

    Args are tokens first, as nnterp serves them: ``q``/``k`` ``[batch, seq,
    heads, key_dim]``, ``v`` ``[batch, seq, heads, value_dim]``, ``igate``/
    ``fgate`` ``[batch, seq, heads]`` (pre-activations); ``initial`` a packed
    state or ``None`` (zeros). The update is transformers' one-step kernel's,
    in float32; ``q`` is not needed for the state.

    With ``tap`` (a zero tensor of the states' shape that requires grad), it is
    added to each token's state after its own readout, before the next token reads it, and the
    outputs ``h`` ``[batch, seq, heads, value_dim]`` are computed from the
    tapped states and returned too, ``(states, h)``: ``tap.grad`` at ``t`` is
    then a loss on ``h``'s derivative by the state after ``t`` (``m``'s in key
    row 0 of its column).
    """
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if initial is None:
        c = k.new_zeros((batch, heads, key_dim, value_dim), dtype=torch.float32)
        n = k.new_zeros((batch, heads, key_dim), dtype=torch.float32)
        m = k.new_zeros((batch, heads, 1), dtype=torch.float32)
    else:
        c, n, m = unpack(initial.float())
    k32, v32 = k.float(), v.float()
    log_f = F.logsigmoid(fgate.float())
    i = igate.float()
    out, hs = [], []
    for t in range(seq):
        m_new = torch.maximum(log_f[:, t, :, None] + m, i[:, t, :, None])
        f_act = torch.exp(log_f[:, t, :, None] + m - m_new)
        i_act = torch.exp(i[:, t, :, None] - m_new)
        c = f_act[..., None] * c + i_act[..., None] * (k32[:, t, :, :, None] @ v32[:, t, :, None, :])
        n = f_act * n + i_act * k32[:, t]
        m = m_new
        if tap is not None:
            qs = q[:, t].float() * key_dim**-0.5
            numerator = (qs[:, :, None, :] @ c).squeeze(2)
            denominator = torch.maximum((qs * n).sum(-1, keepdim=True).abs(), torch.exp(-m)) + eps
            hs.append(numerator / denominator)
            # An exact zero, after token t's own readout (as set_state_after writes): the tokens after t read the
            # state through it, so the gradient by the state after t collects here.
            dc, dn, dm = unpack(tap[:, t])
            c, n, m = c + dc, n + dn, m + dm
        out.append(pack(c, n, m))
    states = torch.stack(out, dim=1)
    return (states, torch.stack(hs, dim=1)) if tap is not None else states


def stabilizers(log_f: torch.Tensor, igate: torch.Tensor, m0: torch.Tensor) -> torch.Tensor:
    """Every token's stabilizer ``m_t``, float32, from ``log σ(f̃)`` and ``ĩ`` ``[..., seq, 1]`` and the entering ``m0`` ``[..., 1]``.

    ``m_t = max(log σ(f̃_t) + m_{t-1}, ĩ_t)`` unrolled is ``F_t + max(m0,
    max_{s≤t} ĩ_s - F_s)`` with ``F`` the cumulated log forget gate: one
    ``cummax`` instead of a loop over tokens. Summed in float64 (``F_t`` and
    ``ĩ_s - F_s`` are long prefix sums whose difference is kept), then rounded:
    equal to the loop's float32 ``m`` to rounding, not bit for bit. Any ``m``
    serves: ``C`` and ``n`` are scaled by the same ``exp(-m)`` they are written with.
    """
    total = log_f.double().cumsum(-2)
    peak = torch.cummax(igate.double() - total, dim=-2).values
    return (total + torch.maximum(peak, m0.double()[..., None, :])).float()


def _write(k, v, igate, fgate, initial, out, first, q=None):
    """Every packed state into ``out[:, first:first + seq]``; with ``q``, also ``(q̂ᵀ[C | n] [b, h, seq, v + 1], m [b, h, seq, 1])``."""
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if initial is None:
        start = k.new_zeros((batch, heads, key_dim, value_dim + 1), dtype=torch.float32)
        m0 = k.new_zeros((batch, heads, 1), dtype=torch.float32)
    else:
        start, m0 = initial[..., :-1].float(), initial[..., 0, -1:].float()
    log_f = F.logsigmoid(fgate.float()).transpose(1, 2)[..., None]  # [b, h, seq, 1]
    i = igate.float().transpose(1, 2)[..., None]
    m = stabilizers(log_f, i, m0)
    previous = torch.cat([m0[:, :, None], m[:, :, :-1]], dim=2)
    decay = log_f + previous - m  # log of the forget activation, ≤ 0 (to rounding)
    writes = torch.exp(i - m) * k.float().transpose(1, 2)  # exp(ĩ_t - m_t) k_t, [b, h, seq, key_dim]
    values = torch.cat([v.float(), v.new_ones((batch, seq, heads, 1), dtype=torch.float32)], dim=-1).transpose(1, 2)
    window = out[:, first : first + seq]
    columns = m.squeeze(-1).transpose(1, 2)[..., None]  # m, repeated along the key axis
    read = None if q is None else (q.float() * key_dim**-0.5).transpose(1, 2)
    readouts = []
    # Block by block, each block's m column written while its states are still in cache (a pass of its own otherwise).
    block = read_block(window[:, 0].numel())
    for lo in range(0, seq, block):
        hi = min(seq, lo + block)
        part = None if read is None else read[:, :, lo:hi]
        start, readout = fill_states(window[..., :-1], lo, start, decay[:, :, lo:hi], writes[:, :, lo:hi], values[:, :, lo:hi], None, part, True)
        readouts.append(readout)
        window[:, lo:hi, ..., -1] = columns[:, lo:hi]
    return (torch.cat(readouts, dim=2) if read is not None else None), m


def mlstm_states_into(
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    initial: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    first: int = 0,
) -> torch.Tensor:
    """`mlstm_states` without autograd, written in place: token ``j`` into ``out[:, first + j]``.

    ``out``: float32 ``[batch, ≥ first + seq, heads, key_dim, value_dim + 2]``
    (`empty_states` of ``[batch, seq, ...]`` when ``None``, ``first`` then 0);
    ``initial`` a packed state (may be a view of ``out``) or ``None`` (zeros).
    Raises `ValueError` on an input that records a graph: in-place writes would
    break it (use `mlstm_states` there).
    """
    batch, seq, heads, key_dim = k.shape
    if differentiable(k, v, igate, fgate, initial):
        raise ValueError("mlstm_states_into writes in place: under autograd use mlstm_states")
    if out is None:
        out, first = empty_states((batch, seq, heads, key_dim, v.shape[-1] + 2), k.device), 0
    _write(k, v, igate, fgate, initial, out, first)
    return out


def mlstm_one_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    initial: torch.Tensor | None,
    out: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`mlstm_states_into` (``first`` 0) that also reads every state: the backend's return, computed alongside.

    ``h_t = C_tᵀ q̂_t / (max(|n_tᵀ q̂_t|, exp(-m_t)) + eps)``, read while the
    state is in cache. Returns ``(h [batch, heads, seq, value_dim], (C [batch,
    heads, key_dim, value_dim], n [batch, heads, key_dim], m [batch, heads,
    1]))``, heads first as transformers' backend returns them; float32, no autograd.
    """
    if differentiable(q, k, v, igate, fgate, initial):
        raise ValueError("mlstm_one_pass writes in place: under autograd use mlstm_states")
    read, m = _write(k, v, igate, fgate, initial, out, 0, q)
    h = read[..., :-1] / (torch.maximum(read[..., -1:].abs(), torch.exp(-m)) + eps)
    return h, unpack(out[:, k.shape[1] - 1])


def mlstm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    initial: torch.Tensor | None = None,
    positions: Selection = None,
    heads: Selection = None,
    coefficients: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The mLSTM's exact effective attention: ``h_t = Σ_s A[t, s] v_s + readout_t``.

    Unrolled, the stabilizer is the largest exponent of any term,
    ``m_t = max(F_t + m_0, max_{s≤t} F_t - F_s + ĩ_s)`` with ``F`` the cumulated
    log forget gate, and ``C_t`` / ``n_t`` are sums of ``exp(F_t - F_s + ĩ_s - m_t)
    k_s v_sᵀ`` / ``k_s`` plus the entering state's ``exp(F_t + m_0 - m_t) C_0``.
    So with ``W[t, s] = (q̂_t·k_s) exp(F_t - F_s + ĩ_s - m_t)`` (every exponent
    ≤ 0) and the denominator ``d_t = max(|Σ_s W[t, s] + r_t q̂_t·n_0|,
    exp(-m_t)) + eps``, ``A[t, s] = W[t, s] / d_t`` and ``readout_t = r_t
    C_0ᵀ q̂_t / d_t`` (``r_t = exp(F_t + m_0 - m_t)``): given the gates and the
    denominators, ``h`` is linear in the values. The cumulated gates are summed in
    float64 (a difference of two long prefix sums), the rest in float32.

    Args are tokens first: ``q``, ``k`` ``[batch, seq, heads, key_dim]``,
    ``igate`` / ``fgate`` ``[batch, seq, heads]``, ``initial`` a packed state (a
    zero one counts as none). Returns ``(A [batch, heads, positions, seq] or
    None, readout [batch, positions, heads, value_dim] or None)``.
    """
    n_heads, key_dim = k.shape[2], k.shape[3]
    chosen = indices(heads, n_heads, "heads").to(k.device)
    rows = indices(positions, k.shape[1], "positions").to(k.device)
    q = q.float().index_select(2, chosen).index_select(1, rows) * key_dim**-0.5
    k = k.float().index_select(2, chosen)
    gate_in = igate.double().index_select(2, chosen).transpose(1, 2)  # [b, h, seq]
    total = F.logsigmoid(fgate.double()).index_select(2, chosen).transpose(1, 2).cumsum(-1)  # F, [b, h, seq]
    if initial is not None and not bool(initial.any()):
        initial = None
    c0 = n0 = None
    m0 = total.new_zeros(total.shape[:2])
    if initial is not None:
        c0, n0, m_in = unpack(initial.float().index_select(1, chosen))
        m0 = m_in[..., 0].double()
    at = total.index_select(2, rows)  # F_t, [b, h, rows]
    exponent = at[..., None] - total[:, :, None, :] + gate_in[:, :, None, :]  # [b, h, rows, seq]
    later = rows[:, None] < torch.arange(k.shape[1], device=k.device)[None, :]
    exponent = exponent.masked_fill(later, float("-inf"))
    entering = at + m0[..., None]
    m = torch.maximum(exponent.amax(-1), entering)  # [b, h, rows]
    scores = torch.einsum("bthd,bshd->bhts", q, k)
    weights = scores * torch.exp(exponent - m[..., None]).float()
    carried = torch.exp(entering - m).float()  # r_t
    qn = weights.sum(-1)
    if n0 is not None:
        qn = qn + carried * torch.einsum("bthd,bhd->bht", q, n0)
    denominator = torch.maximum(qn.abs(), torch.exp(-m).float()) + eps
    readout = None
    if c0 is not None:
        readout = (carried / denominator)[..., None] * torch.einsum("bthd,bhdv->bhtv", q, c0)
        readout = readout.transpose(1, 2)
    return (weights / denominator[..., None] if coefficients else None), readout


# -- by the backend call's names (`nnterp.fast.spec`) -------------------------------------


def states(arguments: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed state after every token, into ``out`` when given: in place without autograd (`mlstm_states_into`),
    else, and on a one-token call (transformers runs its one-step kernel there, whose operations `mlstm_states`
    repeats, so the state equals the cache's bit for bit), the token loop's (`mlstm_states`)."""
    a = arguments
    k, v, i, f, state = a["k"], a["v"], a["igate"], a["fgate"], a.get("state")
    if k.shape[1] == 1 or differentiable(k, v, i, f, state):
        found = mlstm_states(a.get("q"), k, v, i, f, state)
        return found if out is None else out.copy_(found)
    return mlstm_states_into(k, v, i, f, state, out)


def one_pass(arguments: dict, out: torch.Tensor) -> tuple | None:
    """The backend's return ``(h, (C, n, m))`` with the states (`mlstm_one_pass`); ``None`` off float32, and on one
    token (a decode step runs the one-step kernel, whose bits the cache keeps).

    ``arguments["eps"]`` is the backend's ``config.eps`` (the call does not carry it: the component's
    ``FAST_CONSTANTS``; 1e-6, xLSTM's default, without it).
    """
    a = arguments
    inputs = (a["q"], a["k"], a["v"], a["igate"], a["fgate"], a.get("state"))
    if a["k"].shape[1] < 2 or any(x is not None and x.dtype != torch.float32 for x in inputs):
        return None
    return mlstm_one_pass(*inputs, out, eps=a.get("eps", 1e-6)), out


def tap(arguments: dict, taps: torch.Tensor) -> torch.Tensor:
    """An exact zero ``[batch, heads, seq, value_dim]`` (heads first, as the backend returns ``h``) that depends on
    ``taps`` ``[batch, seq, ...packed state]`` as the later tokens' outputs read an addition to each state after its
    readout (`mlstm_states`): added to the backend's return, the gradient of ``taps`` at ``t`` is the loss's by the
    state after ``t``. The arguments are detached: the backend's own return carries their gradient. ``taps`` may hold
    the states (the leaf `FromArguments` returns): the recurrence is tapped at zero, ``taps - taps.detach()``."""
    a = {name: x.detach() if isinstance(x, torch.Tensor) else x for name, x in arguments.items()}
    zero = taps - taps.detach()
    h = mlstm_states(a["q"], a["k"], a["v"], a["igate"], a["fgate"], a.get("state"), tap=zero, eps=a.get("eps", 1e-6))[1]
    return (h - h.detach()).transpose(1, 2)


def state_shape(arguments: dict) -> tuple:
    """``(batch, heads, key_dim, value_dim + 2)``: the packed state."""
    k, v = arguments["k"], arguments["v"]
    return (k.shape[0], k.shape[2], k.shape[3], v.shape[3] + 2)


def effective_attention(arguments: dict, positions: Selection, heads: Selection, coefficients: bool) -> tuple:
    """`mlstm_attention` of a served call's arguments."""
    a = arguments
    return mlstm_attention(a["q"], a["k"], a["igate"], a["fgate"], a.get("state"), positions, heads, coefficients)


#: The mLSTM backend's call (xLSTM): its chunkwise kernel, and its one-step kernel on a decode step. It returns
#: ``(h [batch, heads, seq, value_dim], (C, n, m))``: heads first, and its final state unpacked.
FAST = FastSpec(
    "mLSTM", states, ("q", "k", "v", "igate", "fgate"), state_shape, one_pass=one_pass, output_axis=2,
    state_tokens=("k", "v", "igate", "fgate"), leaving=lambda final: pack(*final), returned=unpack, tap=tap,
)
#: The mLSTM backend's call (xLSTM), by `nnterp.components.mlstm.MLSTM`'s signature table's names.
EFFECTIVE = EffectiveSpec("mLSTM", effective_attention, "heads")
