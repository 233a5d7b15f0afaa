"""Falcon-Mamba: Mamba-1 with weightless RMS norms on Δ, B and C before the scan."""

import transformers.models.falcon_mamba.modeling_falcon_mamba as MODELING
from transformers.models.falcon_mamba.configuration_falcon_mamba import FalconMambaConfig

from ..components.selective_scan import SelectiveScan
from .base import RealCheckpoint
from .mamba import Mamba


class FalconMamba(Mamba):
    """Falcon-Mamba: Mamba-1 with weightless RMS norms on Δ, B and C before the scan.

    Features of the architecture, as the difference from `mamba`: the mixer
    (HF's ``FalconMambaMixer``, served by `SelectiveScan` like Mamba's) RMS-normalizes
    the low-rank time step, B and C (``dt_layernorm``, ``b_layernorm``,
    ``c_layernorm``: no learned scale, ``config.mixer_rms_eps``) right after
    ``x_proj`` and *before* the kernel call; Δ's norm sits before ``dt_proj``.
    So the kernel arguments nnterp serves are the normalized ones:
    ``attention_keys`` (B) and ``attention_queries`` (C) have unit RMS over
    ``state_size`` per token, ``dt`` is ``dt_proj.weight`` applied to the
    normalized time step, and ``betas``, ``decays`` and the states follow from
    them exactly as in Mamba-1 (the scan itself is unchanged). Writing B, C or
    ``dt`` sets the kernel's input after the norms: nothing renormalizes it.
    Only the fused training path (``mamba_inner_fn``, mamba_ssm with no cache)
    takes the norms' weights into the kernel; nnterp never reads inside it.
    """

    MODELING = MODELING
    CONFIG = FalconMambaConfig
    MODEL_TYPES = ("falcon_mamba",)

    DECODER_LAYERS = (MODELING.FalconMambaBlock,)
    COMPONENTS = {MODELING.FalconMambaMixer: SelectiveScan}

    REAL_CHECKPOINTS = {
        "tiiuae/falcon-mamba-7b": RealCheckpoint(
            dict(hidden_size=4096, num_hidden_layers=64, state_size=16),
            "the model card and the Falcon Mamba paper, arXiv:2410.05355 (64 layers, hidden 4096, state 16); "
            "the other fields are the config's defaults, not the checkpoint's",
        ),
    }
