"""The step size Δ of the Mamba scans, written once: ``clamp(softplus(dt + dt_bias), limit)``.

Computed in ``dt``'s own dtype, as transformers' kernels compute it (a
bfloat16 model rounds Δ there); callers cast the result as they need. The
prompt kernels clamp to ``dt_limit``; the decode kernels do not (``limit=None``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def step_size(dt: torch.Tensor, bias: torch.Tensor | None, softplus: bool, limit: tuple | None = None) -> torch.Tensor:
    """Δ = clamp(softplus(dt + bias), limit), in ``dt``'s dtype."""
    step = dt + bias.to(dt.dtype) if bias is not None else dt
    if softplus:
        step = F.softplus(step)
    return torch.clamp(step, min=limit[0], max=limit[1]) if limit is not None else step
