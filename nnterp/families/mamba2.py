"""Mamba-2: Mamba-1's layout with the state-space-duality mixer.

Features of the architecture, as the difference from `mamba`: the mixer is
`StateSpace` (multi-head, a scalar decay per head, a chunked scan for prompts).
"""

import transformers.models.mamba2.modeling_mamba2 as MODELING

from ..components.state_space import StateSpace
from .mamba import EMBED_TOKENS, LAYER, LAYERS, LM_HEAD, LN_FINAL, layer_parts, text_config  # noqa: F401

MODEL_TYPES = ("mamba2",)
DECODER_LAYER = MODELING.Mamba2Block
COMPONENTS = {MODELING.Mamba2Mixer: StateSpace}
MIXER = StateSpace
