"""`Standard`: the base of every component, an nnsight ``Envoy`` that declares values.

A component is the envoy nnsight builds for one kind of sub-module (an
attention block, a gated DeltaNet, a Mamba mixer), chosen by module class
through nnsight's ``envoys=`` map. It names its kind (``KIND``: the
standardized attribute it is reached by, ``self_attn`` or ``linear_attn``) and
declares its values as `EProperty` descriptors; `values` lists them and
`support` says, for one instance, which it can serve now.
"""

from __future__ import annotations

from nnsight.intervention.envoy import Envoy

from .values import EProperty


class Standard(Envoy):
    """An envoy with declared values (see `nnterp.core.values`)."""

    #: The standardized name a layer reaches this component by; keys `support()`.
    KIND = "module"

    @classmethod
    def values(cls) -> dict[str, EProperty]:
        """Every value this component declares, in declaration order, base first."""
        found: dict[str, EProperty] = {}
        for klass in reversed(cls.__mro__):
            for name, attr in vars(klass).items():
                if isinstance(attr, EProperty):
                    found[name] = attr
        return found

    def dims(self) -> dict[str, int]:
        """Sizes of this component's own dimensions (`nnterp.core.dims` names), from its module.

        The shapes its values are documented with are these names plus
        ``batch``, ``seq`` and ``hidden``.
        """
        return {}

    def support(self) -> dict[str, str | None]:
        """``{value: None or the reason it is unavailable}`` for this instance, now."""
        return {name: value.reason(self) for name, value in self.values().items()}
