"""The step size Δ of the Mamba scans, written once: ``clamp(softplus(dt + dt_bias), limit)``.

Computed in ``dt``'s own dtype, as transformers' kernels compute it (a
bfloat16 model rounds Δ there); callers cast the result as they need
(`time_step`: then float32, as the effective attentions take it). The
prompt kernels clamp to ``dt_limit``; the decode kernels do not (``limit=None``).
Shared by Mamba-2 (`state_space`) and Mamba-1 (`selective_scan`).
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


def time_step(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple | None) -> torch.Tensor:
    """Δ as the kernels compute it, in ``dt``'s dtype, then float32: ``clamp(softplus(dt + dt_bias), dt_limit)``."""
    return step_size(dt, dt_bias, dt_softplus, dt_limit).float()


def served_step_size(served: dict) -> torch.Tensor:
    """Δ of a kernel call from its served arguments by table name: ``dt``, ``dt_bias``, ``dt_softplus``, ``dt_limit``."""
    return step_size(served.get("dt"), served.get("dt_bias"), bool(served.get("dt_softplus")), served.get("dt_limit"))
