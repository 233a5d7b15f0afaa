"""Mamba-2: Mamba-1's layout with the state-space-duality mixer."""

import transformers.models.mamba2.modeling_mamba2 as MODELING
from transformers.models.mamba2.configuration_mamba2 import Mamba2Config

from ..components.state_space import StateSpace
from .base import RealCheckpoint
from .mamba import Mamba


class Mamba2(Mamba):
    """Mamba-2: Mamba-1's layout with the state-space-duality mixer.

    Features of the architecture, as the difference from `mamba`: the mixer is
    `StateSpace` (multi-head, a scalar decay per head, a chunked scan for prompts).
    """

    MODELING = MODELING
    CONFIG = Mamba2Config
    MODEL_TYPES = ("mamba2",)

    DECODER_LAYERS = (MODELING.Mamba2Block,)
    COMPONENTS = {MODELING.Mamba2Mixer: StateSpace}
    MIXER = StateSpace
    CHUNKS_DIFFER = None  # its forward continues a prompt from the cache's state and convolution window
    CHUNK_STATE_INPUT = False

    REAL_CHECKPOINTS = {
        "AntonV/mamba2-130m-hf": RealCheckpoint(
            dict(
                hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128,
                n_groups=1, expand=2, conv_kernel=4, chunk_size=256,
            ),
            "the Mamba-2 paper's 130M model (24 layers, d_model 768, expansion 2, head dim 64 so 24 heads, "
            "N 128, one group) and the chunk size the spec's support message names (256)",
        ),
    }

    @classmethod
    def tiny_sizes(cls) -> dict:
        return dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=32,
            n_groups=1,
            state_size=16,
            expand=2,
            conv_kernel=4,
            chunk_size=8,  # small, so ordinary prompts span several chunks
        )
