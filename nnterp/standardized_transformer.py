"""nnterp 1.x's ``nnterp.standardized_transformer``: `StandardizedTransformer`, at the path 1.x code imports it from.

The class is `nnterp.standardized.StandardizedTransformer` itself (not a
subclass), so ``isinstance`` checks and both import paths agree.
"""

from __future__ import annotations

from .standardized import StandardizedTransformer

__all__ = ["StandardizedTransformer"]
