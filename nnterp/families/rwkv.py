"""RWKV-4: a stack of time-mixing (WKV) and channel-mixing blocks, no attention."""

from typing import Any

import torch
import transformers.models.rwkv.modeling_rwkv as MODELING
from torch._guards import detect_fake_mode
from transformers.models.rwkv.configuration_rwkv import RwkvConfig

from ..components.layer import Layer
from ..components.wkv import WKV
from ..core.errors import InvalidArgument
from ..core.interrupts import interrupts_held
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
    Its decode step mixes the rows of a batch (``DECODE_BATCH_REFUSED``), so
    nnterp refuses a decode step over two rows or more.
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

    #: Why a one-token call continuing from a state (every decode step of ``generate``) cannot run on two rows or more.
    DECODE_BATCH_REFUSED = (
        "transformers' RWKV decode step broadcasts each block's carried token shift ([batch, hidden]) against the new "
        "token ([batch, 1, hidden]), which mixes the rows of a batch of two or more, so each row would generate other "
        "tokens than its prompt alone (transformers' own generate does the same): generate each prompt in its own "
        "model.generate (its invokes are one batch too), or trace the batch without generating"
    )

    #: With use_cache=True, transformers writes each block's state into the state list in place after the
    #: kernel read it, so autograd refuses a backward pass (a plain transformers forward included).
    BACKWARD_KWARGS = {"use_cache": False}

    LAYER = RwkvLayer
    DECODER_LAYERS = (MODELING.RwkvBlock,)
    COMPONENTS = {MODELING.RwkvSelfAttention: WKV}
    MIXER = WKV
    CHUNKS_DIFFER = None  # its forward continues a prompt from the state list it returned
    CACHE_ARGUMENT = "state"

    @classmethod
    def zero_carried_context(cls, cache: Any, layer: int) -> None:
        """The channel mix's token shift (the state list's part 0, ``x_{t-1}`` fed to the feed-forward)."""
        cache[0][:, :, layer] = 0

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
    def around_run(cls, model) -> "RwkvRun":
        return RwkvRun(model, cls.DECODE_BATCH_REFUSED)


class RwkvRun:
    """Around a run: the weights kept as they were (`KeepScale`), and a decode step over several rows refused."""

    def __init__(self, model, refused: str) -> None:
        self.keep = KeepScale(model)
        self.model = model.rwkv
        self.refused = refused

    def __enter__(self) -> "RwkvRun":
        self.keep.__enter__()
        self.hook = self.model.register_forward_pre_hook(self.check_rows, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.hook.remove()
        finally:
            self.keep.__exit__(*exc)

    def check_rows(self, module, args, kwargs) -> None:
        """Refuse the call before it runs where its one token continues from a state on two rows or more."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids if ids is not None else kwargs.get("inputs_embeds")
        state = kwargs.get("state", args[3] if len(args) > 3 else None)
        if state is not None and tokens is not None and tokens.shape[0] > 1 and tokens.shape[1] == 1:
            raise InvalidArgument(self.refused)


class KeepScale:
    """Around a run: undo the rescaling of weights transformers' RWKV forward makes in place (`_rescale_layers`).

    In eval mode, the first forward divides each block's ``attention.output``
    and ``feed_forward.value`` weights by ``2 ** (block // rescale_every)``
    and sets ``layers_are_rescaled`` (a training forward multiplies them back).
    The run computes as transformers does; on exit, each weight an in-place op
    touched (its ``_version`` moved) is brought back to the scale it entered
    with, read from the weight itself: a few of its entries kept on entry
    against the same entries now (a power of two apart: exact), so a rescale
    an interrupt stopped halfway is undone weight by weight, whatever the flag
    says; then the flag is put back. The undo holds Ctrl-C until it is done.
    Quantized weights (bitsandbytes) are left as transformers made them, since
    their scale lives in their statistics.
    """

    #: Entries of each weight kept on entry: a power-of-two rescale scales every one of them exactly.
    PROBE = 64

    def __init__(self, model) -> None:
        self.model = model.rwkv

    def weights(self) -> list:
        return [weight for block in self.model.blocks for weight in (block.attention.output.weight, block.feed_forward.value.weight)]

    def __enter__(self) -> "KeepScale":
        self.before = self.model.layers_are_rescaled
        # Quantized weights keep their scale in their statistics, and a scan's weights hold no values to read.
        self.kept = not self.quantized() and detect_fake_mode() is None and not self.weights()[0].is_meta
        self.entered = [(w, w._version, self.probe(w)) for w in self.weights()] if self.kept else []
        return self

    def probe(self, weight) -> torch.Tensor:
        # Entries from the front, or the whole weight's largest where the front is all zeros (a pruned row).
        with torch.no_grad():
            head = weight.detach().reshape(-1)[: self.PROBE]
            return head.abs().amax().clone() if bool(head.ne(0).any()) else weight.detach().abs().amax()

    def __exit__(self, *exc) -> None:
        if not self.kept:
            return
        with interrupts_held(), torch.no_grad():
            for weight, version, entered in self.entered:
                if weight._version == version:
                    continue
                now = self.probe(weight)
                weight.mul_(torch.where(now > 0, entered / now, torch.ones_like(now)))
            self.model.layers_are_rescaled = self.before

    def quantized(self) -> bool:
        weight = self.model.blocks[0].attention.output.weight
        return hasattr(weight, "SCB") or hasattr(weight, "quant_state")
