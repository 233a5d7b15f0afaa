"""Which families the circuits tests run on, derived from the registry (no model_type list outside it)."""

from __future__ import annotations

from nnterp.families import families

#: The plain transformer every family descends from (llama).
PLAIN = families()[0].NAME
#: One family per recurrent mixer kind, the first the registry lists.
BY_KIND = {family.MIXER: family.NAME for family in reversed(families()) if family.MIXER is not None}
#: Every family `nnterp.circuits` serves: all of them.
SERVED = [family.NAME for family in families()]
