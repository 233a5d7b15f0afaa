"""`ForwardCall`: the per-call record of a mixer whose recurrence is its forward's own operations.

MiniMax's lightning attention calls no kernel function: its forward splits
q, k and v, reads the entering state from the cache, runs the recurrence in
its own loop (over blocks of ``config.block_size`` tokens on a prompt, over
tokens on a call that continues a cache), concatenates the outputs and
returns the final state, which the cache holds. This is `Call` built by that
call source: at the mixer's input (`Call.entry`) and where the forward splits
q, k, v. It keeps the forward's operations by name, found by the component
in the installed release's source (``labels``: ``"split"``, ``"get"`` (the
cache read), ``"cat"`` (the outputs' concatenation), ``"block_state"`` /
``"token_state"`` (the state's binding in either loop), ``"products"`` (the
block loop's four `PRODUCTS`, or ``None``)), how often each had fired before
this call (``first``), and the call's own q, k, v and log decays ``g``
(tokens first: ``[batch, seq, heads, dim]``, ``[batch, seq, heads]``).

As on every record, its arguments are served by name (`serve_all`: ``q``,
``k``, ``v``, ``g`` and the entering ``state``, as `nnterp.fast.lightning_attention`
takes them), the state entering and leaving the call are its `state_input` /
`state_output` (and their writes), ``writes`` holds ``set_state_after``'s
states and every order check is `Call`'s; the concatenation is its ``op``
(a write changes the call until the forward concatenates its outputs). The
strategy (`FromArguments`) ends the call with the forward's own return,
``(outputs [batch, heads, seq, value_dim], final state)``: `skip` skips the
block loop's products with it (a one pass: no write, the loop not started),
`replace` puts it where the forward concatenates its outputs (kept as the
forward computed them up to the first write) and into the final-state
tensor the cache holds.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ..core.calls import mediator, pinned
from ..core.errors import Unavailable
from ..core.values import check_expected
from .call import Call

#: The forward's operations a record reads, by name (``"products"`` are the one pass's, read only there).
OPERATIONS = ("split", "get", "cat", "block_state", "token_state")
#: The block loop's products, by the variable each one binds, in the order the loop computes them.
PRODUCTS = ("attn_weights_intra", "attn_output_intra", "attn_output_inter", "next_attn_weights_inter")
NO_CACHE = "this call runs without a cache, so the forward reads no entering state: run it with use_cache=True"


class ForwardCall(Call):
    """What a worker knows of one call of a mixer that runs its recurrence in its own forward (see the module)."""

    __slots__ = (
        "labels", "first", "cache", "continues", "initial", "q", "k", "v", "g", "decays_written", "original",
        "final", "g_leaf", "last",
    )

    @classmethod
    def at_entry(cls, mixer: Any, labels: dict) -> ForwardCall:
        """The record of this call, made at the mixer's input: waits where the forward splits q, k, v."""
        entry = Call.entry(mixer, ())
        med = mediator()
        split, cat = (getattr(mixer.source, labels[name]) for name in ("split", "cat"))
        # Its op is the concatenation: a write changes the call until the forward concatenates its outputs.
        call = cls(mixer, "", cat, False, med.occurrence(f"{cat.path}.input"))
        call.labels = labels
        call.first = {name: med.occurrence(f"{getattr(mixer.source, labels[name]).path}.output") for name in OPERATIONS}
        call.output_at = call.first["cat"]
        call.first["output"] = med.occurrence(f"{mixer.path}.output")
        call.cache, call.seq = entry["cache"], entry["seq"]
        entering = call.cache.get_linear_cache(mixer.hf_module().layer_idx) if call.cache is not None else None
        call.continues = entering is not None
        call.initial = entering.clone() if entering is not None else None
        # The forward's last binding of the state in this call, ``(location, occurrence)``: its loop's last step.
        loop = "token_state" if call.continues else "block_state"
        steps = call.seq if call.continues else -(-call.seq // mixer.hf_module().block_size)
        call.last = (call.at(loop), call.first[loop] + steps - 1)
        call.decays_written, call.original, call.final, call.g_leaf = False, None, None, None
        with pinned(call.first["split"]):
            call.q, call.k, call.v = split.output
        call.g = mixer.decays_of(call)
        call.expected = (mixer.state_shape(call), call.q.dtype, call.q.device)
        return call

    # -- the forward's operations ------------------------------------------------------

    def operation(self, name: str) -> Any:
        """The envoy of operation ``name`` (``mixer.source.<label>``)."""
        return getattr(self.mixer.source, self.labels[name])

    def at(self, name: str) -> str:
        """The location of operation ``name``'s output."""
        return f"{self.operation(name).path}.output"

    def passed(self, name: str, occurrence: int) -> bool:
        """Whether the run has passed occurrence ``occurrence`` of operation ``name``."""
        return self.occurrences(self.at(name)) > occurrence

    def check_ahead(self, name: str, what: str, moment: str) -> None:
        """Raise `OrderError` unless the forward has not passed operation ``name`` of this call yet."""
        Call.check_reachable(self.at(name), self.first[name], what, moment)

    @property
    def changed(self) -> bool:
        """Whether a write changed the call's recurrence (``set_state_after``, ``decays``)."""
        return bool(self.writes) or self.decays_written

    def concatenated(self) -> torch.Tensor:
        """The forward's concatenated outputs before the norm, ``[batch, heads, seq, dim]`` (kept as `original`)."""
        with pinned(self.first["cat"]):
            current = self.operation("cat").output
        if self.original is None:
            self.original = current
        return current

    def replace_outputs(self, outputs: torch.Tensor) -> None:
        """Make ``outputs`` ``[batch, heads, seq, dim]`` the concatenated outputs the forward goes on with."""
        with pinned(self.first["cat"]):
            Mediator.swap(self.at("cat"), outputs)

    # -- the arguments by name, and the call ended with the forward's own return (`Call.skip`, `Call.replace`) --------

    def serve_all(self) -> dict:
        """``q``, ``k``, ``v``, ``g`` (tokens first) and the entering ``state``, as the record holds them now."""
        return {"q": self.q, "k": self.k, "v": self.v, "g": self.g, "state": self.initial}

    def assign(self, name: str, view: Any) -> None:
        """Replace the decays ``g`` (the one argument the forward does not read: it reads its buffers), before the
        strategy replaces the call's return with the recurrence's under them."""
        if name != "g":
            raise Unavailable(f"a write to `linear_attn.{name}`", "lightning attention's record takes only its decays g")
        self.g, self.decays_written = view, True

    def kernel_waiting(self) -> bool:
        """Whether the forward's loop has not started in this call: neither loop has bound the state and, where they
        are found, no block product has fired (each fires once per block, as the block loop's binding does)."""
        products = self.labels["products"] or {}
        fired = [(self.at(name), self.first[name]) for name in ("block_state", "token_state")]
        fired += [(f"{getattr(self.mixer.source, label).path}.output", self.first["block_state"]) for label in products.values()]
        med = mediator()
        return all(med.occurrence(location) <= first for location, first in fired)

    def skip(self, result: tuple) -> None:
        """Skip the block loop's products with ``result`` where the call is unchanged (the one pass, which applies on a
        fresh prompt whose loop has not started, its products found: `kernel_waiting`); otherwise the loop runs and its
        outputs are `replace`d (a split call)."""
        if self.changed:
            return self.replace(result, True)
        outputs, self.final = result
        ops = {variable: getattr(self.mixer.source, label) for variable, label in self.labels["products"].items()}
        start, size, zero = self.first["block_state"], self.mixer.hf_module().block_size, outputs.new_zeros(())
        blocks = -(-self.seq // size)
        for block in range(blocks):
            values = {"attn_output_intra": outputs[:, :, block * size : (block + 1) * size]}
            for variable in PRODUCTS:
                with pinned(start + block):
                    ops[variable].skip(values.get(variable, zero))
        # The loop's state ends as its zero writes leave it: the state it returns (and the cache holds) is the pass's last.
        with pinned(start + blocks - 1):
            Mediator.swap(self.at("block_state"), self.final)

    def replace(self, result: tuple, waits: bool) -> None:
        """Make ``result`` the call's outputs before the norm (the forward's own kept up to the first write, unless the
        decays were written) and its final state (written into the forward's final-state tensor, which the cache holds);
        the forward always runs here, and the pinned reads below wait for it (``waits`` is a kernel call's)."""
        outputs, final = result  # the outputs of the call's last tokens (those after `kept` at least)
        what = "a write to the call"
        holder = self.forward_final()  # the loop's last binding: the tensor it returns and the cache holds
        if holder is None:
            self.check_reachable(*self.last, what, "the forward had computed the call's final state")
        with pinned(self.first["cat"]):
            current = self.operation("cat").output
            if self.original is None:
                self.original = current
            start = self.seq - outputs.shape[2]
            outputs = torch.cat([self.original[:, :, : self.kept], outputs[:, :, self.kept - start :]], dim=2)
            Mediator.swap(self.at("cat"), outputs.to(current.dtype))
        holder.copy_(final)

    @property
    def kept(self) -> int:  # type: ignore[override]
        """The tokens up to the first write keep the outputs the forward computed (none once the decays are written)."""
        return min(self.writes) + 1 if self.writes and not self.decays_written else 0

    def own_final(self) -> torch.Tensor | None:
        """The forward's own final state while the call is unchanged (`forward_final`), else ``None``."""
        return None if self.changed else self.forward_final()

    def graft(self, zero: torch.Tensor) -> None:
        """Add ``zero`` (exact zeros that carry a gradient) to the concatenated outputs, ``[batch, heads, seq, dim]``."""
        current = self.concatenated()
        self.replace_outputs(current + zero.to(current.dtype))

    def forward_final(self) -> torch.Tensor | None:
        """The forward's own final-state tensor (its loop's last binding of the state), or ``None`` once passed."""
        if self.final is None:
            location, last = self.last
            if mediator().occurrence(location) > last:
                return None
            with pinned(last):
                self.final = Mediator.value(location)
        return self.final

    # -- q, k, v, written before the forward uses them -------------------------------------

    def write_qkv(self, index: int, value: Any) -> None:
        """Replace q (0), k (1) or v (2) where the forward splits them."""
        name = ("attention_queries", "attention_keys", "attention_values")[index]
        what = f"`linear_attn.{name}`"
        current = (self.q, self.k, self.v)
        check_expected(what, value, tuple(current[index].shape), current[index].dtype, current[index].device)
        self.check_ahead("split", f"a write to {what}", "the forward had used q, k and v")
        written = tuple(value if i == index else x for i, x in enumerate(current))
        self.q, self.k, self.v = written
        with pinned(self.first["split"]):
            Mediator.swap(self.at("split"), written)

    # -- the state entering and leaving the call -----------------------------------------

    def state_input(self) -> torch.Tensor | None:
        """The state entering the call (the cache's), a copy; ``None`` on a fresh prompt."""
        return self.initial.clone() if self.initial is not None else None

    def assign_state_input(self, value: Any) -> None:
        """Make the forward read ``value`` from the cache: on a prompt it then takes its token loop, which continues from it."""
        what = "`linear_attn.state_input`"
        check_expected(what, value, *self.expected)
        if self.cache is None:
            raise Unavailable("linear_attn.state_input", NO_CACHE)
        self.check_ahead("get", f"a write to {what}", "the forward had read the cache")
        self.check_unwritten(f"a write to {what}", "a write inside the call", self.decays_written)
        with pinned(self.first["get"]):
            self.operation("get").output
        with pinned(self.first["get"]):
            Mediator.swap(self.at("get"), value)
        self.initial, self.continues = value, True
        self.last = (self.at("token_state"), self.first["token_state"] + self.seq - 1)  # its token loop's last step

    def output(self) -> tuple:
        """The mixer's return: ``(attention output, final state, ...)``."""
        with pinned(self.first["output"]):
            return Mediator.value(f"{self.mixer.path}.output")

    def state_output(self) -> torch.Tensor:
        """The state after the call's last token (the forward's return, which the cache holds)."""
        return self.output()[1]

    def write_state_output(self, value: Any) -> None:
        """Make ``value`` the state after the call's last token: in the forward's return and in the cache."""
        output = self.output()
        check_expected("`linear_attn.state_output`", value, tuple(output[1].shape), output[1].dtype, output[1].device)
        if self.cache is not None:
            # The forward has stored its final state in the cache: the next call reads this one.
            self.cache.set_linear_cache(self.mixer.hf_module().layer_idx, value)
        with pinned(self.first["output"]):
            Mediator.swap(f"{self.mixer.path}.output", (output[0], value, *output[2:]))


__all__ = ["ForwardCall", "OPERATIONS", "PRODUCTS", "NO_CACHE"]
