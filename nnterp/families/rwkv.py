"""RWKV-4: a stack of time-mixing (WKV) and channel-mixing blocks, no attention."""

import transformers.models.rwkv.modeling_rwkv as MODELING
from transformers.models.rwkv.configuration_rwkv import RwkvConfig

from ..components.layer import Layer
from ..components.wkv import WKV
from .base import RealCheckpoint
from .mamba import Mamba


class RwkvLayer(Layer):
    """An RWKV block: ``ln1``, the time mixing (``attention``, served as ``linear_attn``), ``ln2``, the channel mixing (``feed_forward``, the ``mlp``)."""

    MLP = "feed_forward"


class Rwkv(Mamba):
    """RWKV-4 (Peng et al., 2023, arXiv:2305.13048): time mixing and channel mixing per block.

    Features of the architecture, as the difference from `mamba`: each block
    is a norm and a `WKV` mixer (HF's ``attention``, RWKV's time mixing,
    exposed as ``linear_attn``), then a norm and a channel-mixing MLP (HF's
    ``feed_forward``, exposed as ``mlp``), with a token shift in front of
    each; block 0 normalizes its input first (``pre_ln``). The parts live
    under ``rwkv`` and the head is ``head``. The model carries no cache
    object: its state is a list of five ``[batch, hidden, layers]`` tensors
    passed as ``state=``. transformers' model ignores the attention mask, so
    a left-padded batch runs the padding through the recurrence; and in eval
    mode its first forward rescales two weights per block in place
    (``rescale_every``), which nnterp undoes after each run (`around_run`).
    """

    MODELING = MODELING
    CONFIG = RwkvConfig
    MODEL_TYPES = ("rwkv",)

    LAYERS = "rwkv.blocks"
    EMBED_TOKENS = "rwkv.embeddings"
    LN_FINAL = "rwkv.ln_out"
    LM_HEAD = "head"

    PADDING_REFUSED = (
        "transformers' RWKV model ignores the attention mask, so a padded batch would run the padding through every "
        "block's recurrence and change each shorter prompt's result: trace prompts of one length together, or each "
        "prompt in its own trace"
    )

    #: With use_cache=True, transformers writes each block's state into the state list in place after the
    #: kernel read it, so autograd refuses a backward pass (a plain transformers forward included).
    BACKWARD_KWARGS = {"use_cache": False}

    LAYER = RwkvLayer
    DECODER_LAYERS = (MODELING.RwkvBlock,)
    COMPONENTS = {MODELING.RwkvSelfAttention: WKV}
    MIXER = WKV

    REAL_CHECKPOINTS = {
        "RWKV/rwkv-4-169m-pile": RealCheckpoint(
            dict(hidden_size=768, num_hidden_layers=12, attention_hidden_size=768, intermediate_size=3072, context_length=1024, rescale_every=6),
            "the checkpoint's config.json (hidden 768, 12 layers, intermediate 3072, context 1024, rescale every 6 layers)",
        ),
    }

    @classmethod
    def layer_parts(cls, config) -> list[set[str]]:
        return [{"linear_attn", "mlp"} for _ in range(cls.text_config(config).num_hidden_layers)]

    @classmethod
    def tiny_sizes(cls) -> dict:
        # rescale_every=1: the eval forward's in-place rescaling touches block 1's weights (divided by 2).
        return dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, context_length=128, rescale_every=1)

    @classmethod
    def around_run(cls, model) -> "KeepScale":
        return KeepScale(model)


class KeepScale:
    """Around a run: undo the rescaling of weights transformers' RWKV forward makes in place (`_rescale_layers`).

    In eval mode, the first forward divides each block's ``attention.output``
    and ``feed_forward.value`` weights by ``2 ** (block // rescale_every)``
    and sets ``layers_are_rescaled`` (a training forward multiplies them back).
    The run computes as transformers does; on exit, transformers' own
    ``_rescale_layers`` brings the weights back to the state they entered the
    run in (a power of two: exact). Quantized weights (bitsandbytes) are left
    as transformers made them, since its undo is not the inverse there.
    """

    def __init__(self, model) -> None:
        self.model = model.rwkv

    def __enter__(self) -> "KeepScale":
        self.before = self.model.layers_are_rescaled
        return self

    def __exit__(self, *exc) -> None:
        model = self.model
        if model.layers_are_rescaled == self.before or self.quantized():
            return
        training = model.training
        model.training = not self.before  # _rescale_layers brings the weights to what `training` asks
        try:
            model._rescale_layers()
        finally:
            model.training = training

    def quantized(self) -> bool:
        weight = self.model.blocks[0].attention.output.weight
        return hasattr(weight, "SCB") or hasattr(weight, "quant_state")
