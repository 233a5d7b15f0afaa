"""Which families the circuits tests run on, derived from the registry (no model_type list outside it)."""

from __future__ import annotations

from nnterp.families import families

#: The plain transformer every family descends from (llama).
PLAIN = families()[0].NAME
#: One family per recurrent mixer kind, the first the registry lists.
BY_KIND = {family.MIXER: family.NAME for family in reversed(families()) if family.MIXER is not None}
#: Families whose parts read no plain residual, and a word of the reason `circuits.support` gives.
UNSERVED = [("zamba2", "concatenation")]
#: Every family `nnterp.circuits` serves.
SERVED = [family.NAME for family in families() if family.NAME not in {name for name, _ in UNSERVED}]
