"""``states_of(positions)``: the states after the tokens a researcher names, at a cost that follows the selection.

`RecurrentMixer` binds `states_of` in its body (next to ``state_after``) and
delegates to the per-token strategy, as it does for every per-token value:
the token loop pins only those tokens' occurrences, Mamba-2's chunk
boundaries are indexed, and the fast path computes the states a block at a
time up to the last selected token, keeping only the selected ones
(`nnterp.recurrent.per_token.from_arguments`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..recurrent.per_token import PerToken, strategy_for
from . import per_token_values


def states_of(self, positions: Any) -> torch.Tensor:
    """The states after tokens ``positions`` of this call only, ``[batch, len(positions), ...state]``, float32.

    ``positions``: a sequence of ints (a list, a tuple, a range, a 1-d
    tensor), negative ones counting from the call's end, in the order given
    (repeats allowed). Equal to ``states[:, positions]``, as
    ``effective_attention_of(positions=...)`` selects rows of
    ``effective_attention``. With ``fast_states(model)`` only the tokens up to
    the last selected one are computed, and memory is the selection plus one
    block of tokens, not ``[batch, seq, ...state]``.

    Order: as `state_after` at each of them (in the same trace, before a write
    at an earlier position and before ``state_output`` / ``attention_output``).

    Gradients: the result is a new tensor (a stack, or an index of the
    states), which the model does not read, so its ``.grad`` never comes; read
    ``states.grad`` or ``state_after(t).grad`` for the derivative by a state.
    On the fast path, under autograd, it is a function of the kernel's
    arguments, as ``states`` is there.
    """
    if type(self).state_after is not per_token_values.state_after:
        # A component serving the per-token states its own way (a window, a method's loop): through its own state_after.
        return OWN_STATE_AFTER.states_of(self, positions)
    return strategy_for(self).states_of(self, positions)


class OwnStateAfter(PerToken):
    """`PerToken`'s default ``states_of``, over a component's own ``state_after``."""

    name = "the component's own state_after"

    def unavailable(self, mixer: Any) -> str | None:
        return type(mixer).values()["states"].reason(mixer)

    def state_after(self, mixer: Any, t: int) -> torch.Tensor:
        return mixer.state_after(t)


OWN_STATE_AFTER = OwnStateAfter()
