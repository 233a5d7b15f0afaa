"""nnterp 1.x's ``nnterp.logging``: the package logger, ``logger`` (``logging.getLogger("nnterp")``).

As in 1.x, importing this module gives the logger a handler printing
``LEVEL | nnterp | message`` at INFO and above, unless one is already set;
configure it as any `logging.Logger`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("nnterp")

if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s | %(name)s | %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
