"""nnterp 1.x's ``nnterp.nnsight_utils``: functional access to a model's parts and values, at their 1.x names and signatures.

Each function takes a `StandardizedTransformer` or, as in 1.x, a plain
nnsight ``LanguageModel`` of a Llama-like layout (``model.model.layers``,
``model.model.norm``, ``lm_head``). On a `StandardizedTransformer` every read
goes through its standard names (``layers_output[i]``, ``attentions[i]``,
``project_on_vocab``, ...), so it works on every family nnterp registers: on a
hybrid, ``get_attention(model, i)`` is layer i's token mixer, softmax
attention or recurrent. On a plain model the 1.x paths are read as 1.x read
them: a tuple output gives its first element.

`get_token_activations` and `collect_token_activations_batched` return 1.x's
``[layers, prompts, hidden]`` tensor; ``nnterp.interventions`` has the same
functions with ``values=`` (any standard value, as a dict).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch as th
from nnsight import Envoy, LanguageModel, NNsight
from torch import nn

from .core.errors import InvalidArgument, NnterpError
from .families import family_for
from .rename_utils import RenameConfig, get_rename_dict
from .standardized import StandardizedTransformer
from .utils import TraceTensor, unpack_tuple

__all__ = [
    "GetModuleOutput", "get_embed_tokens", "get_layers", "get_num_layers", "get_layer", "get_layer_input",
    "get_layer_output", "get_attention", "get_attention_output", "get_mlp", "get_mlp_output", "get_logits",
    "get_unembed_norm", "get_unembed", "project_on_vocab", "get_next_token_probs", "set_layer_output",
    "ModuleAccessor", "get_token_activations", "collect_last_token_activations_session",
    "collect_token_activations_batched", "compute_next_token_probs", "LanguageModel",
]

GetModuleOutput = Callable[[LanguageModel, int], TraceTensor]


def _standard(model: Any) -> bool:
    return isinstance(model, StandardizedTransformer)


def get_embed_tokens(model: LanguageModel) -> nn.Module:
    """The token embedding's envoy (``model.embed_tokens``)."""
    return model.embed_tokens


def get_layers(model: LanguageModel) -> list[Envoy]:
    """The decoder blocks: ``model.layers``, or ``model.model.layers`` on a plain model."""
    return model.layers if _standard(model) else model.model.layers


def get_num_layers(nn_model: LanguageModel) -> int:
    """The number of decoder blocks."""
    return len(get_layers(nn_model))


def get_layer(nn_model: LanguageModel, layer: int) -> Envoy:
    """The envoy of block ``layer``."""
    return get_layers(nn_model)[layer]


def get_layer_input(nn_model: LanguageModel, layer: int) -> TraceTensor:
    """The residual stream entering block ``layer``, inside a trace."""
    return nn_model.layers_input[layer] if _standard(nn_model) else get_layer(nn_model, layer).input


def get_layer_output(nn_model: LanguageModel, layer: int) -> TraceTensor:
    """The residual stream leaving block ``layer``, inside a trace."""
    if _standard(nn_model):
        return nn_model.layers_output[layer]
    return unpack_tuple(get_layer(nn_model, layer).output)


def get_attention(nn_model: LanguageModel, layer: int) -> Envoy:
    """Block ``layer``'s attention envoy (on a `StandardizedTransformer`, its token mixer: ``attentions[layer]``)."""
    return nn_model.attentions[layer] if _standard(nn_model) else get_layer(nn_model, layer).self_attn


def get_attention_output(nn_model: LanguageModel, layer: int) -> TraceTensor:
    """The output of block ``layer``'s attention (its token mixer), inside a trace."""
    if _standard(nn_model):
        return nn_model.attentions_output[layer]
    return unpack_tuple(get_attention(nn_model, layer).output)


def get_mlp(nn_model: LanguageModel, layer: int) -> Envoy:
    """Block ``layer``'s MLP envoy."""
    return nn_model.mlps[layer] if _standard(nn_model) else get_layer(nn_model, layer).mlp


def get_mlp_output(nn_model: LanguageModel, layer: int) -> TraceTensor:
    """The output of block ``layer``'s MLP, inside a trace."""
    if _standard(nn_model):
        return nn_model.mlps_output[layer]
    return unpack_tuple(get_mlp(nn_model, layer).output)


def get_logits(nn_model: LanguageModel) -> TraceTensor:
    """The model's output logits ``[batch, seq, vocab]``, inside a trace."""
    return nn_model.logits if _standard(nn_model) else nn_model.output.logits


def get_unembed_norm(nn_model: LanguageModel) -> Envoy:
    """The final norm: ``ln_final``, or ``model.model.norm`` on a plain model."""
    return nn_model.ln_final if _standard(nn_model) else nn_model.model.norm


def get_unembed(nn_model: LanguageModel) -> Envoy:
    """The unembedding, ``lm_head``."""
    return nn_model.lm_head


def project_on_vocab(nn_model: LanguageModel, h: TraceTensor) -> TraceTensor:
    """Logits of hidden states ``h``: the final norm then the unembedding (and, on a `StandardizedTransformer`, the family's logits scale and softcap)."""
    if _standard(nn_model):
        return nn_model.project_on_vocab(h)
    return nn_model.lm_head(get_unembed_norm(nn_model)(h))


def get_next_token_probs(nn_model: LanguageModel) -> TraceTensor:
    """Softmax of the logits at the last position, ``[batch, vocab]``, inside a trace (left padding: every row's last token)."""
    return get_logits(nn_model)[:, -1, :].softmax(-1)


def set_layer_output(nn_model: LanguageModel, layer: int, tensor: TraceTensor) -> None:
    """Replace the residual stream leaving block ``layer`` by ``tensor``, inside a trace (a tuple output keeps its other elements)."""
    if _standard(nn_model):
        nn_model.layers_output[layer] = tensor
        return
    block = get_layer(nn_model, layer)
    output = block.output
    block.output = (tensor, *output[1:]) if isinstance(output, tuple) else tensor


class ModuleAccessor:
    """A Hugging Face model's ``torch.nn`` modules under the standard names, without tracing::

        ModuleAccessor(hf_model).layers / .embed_tokens / .ln_final / .lm_head / .get_attention(i) / .get_mlp(i)

    The names are 1.x's renaming (`get_rename_dict`, with ``rename_config`` and
    ``rename`` added); for a model nnterp has a family for, the family's own
    paths of the layers, embedding, final norm and unembedding come first, so
    every registered family resolves. An attribute that is not a module
    raises `AttributeError`, as in 1.x.
    """

    def __init__(self, model: Any, rename_config: RenameConfig | None = None, rename: dict[str, str] | None = None) -> None:
        full_rename = get_rename_dict(rename_config=rename_config)
        full_rename.update(_family_paths(model))
        if rename is not None:
            full_rename.update(rename)
        self.nn_model = NNsight(model, rename=full_rename)

    def __getattr__(self, name: str) -> nn.Module:
        if name == "nn_model":  # not yet set: __init__ failed or the object is being unpickled
            raise AttributeError(name)
        attr = getattr(self.nn_model, name)
        if hasattr(attr, "_module"):
            return attr._module
        raise AttributeError(f"Attribute {name} is not a module")

    def get_embed_tokens(self) -> nn.Module:
        return self.nn_model.embed_tokens._module

    def get_layers(self) -> nn.ModuleList:
        return self.nn_model.layers._module

    def get_mlp(self, layer: int) -> nn.Module:
        return self.nn_model.layers[layer].mlp._module

    def get_attention(self, layer: int) -> nn.Module:
        return self.nn_model.layers[layer].self_attn._module

    def get_unembed_norm(self) -> nn.Module:
        return self.nn_model.ln_final._module

    def get_unembed(self) -> nn.Module:
        return self.nn_model.lm_head._module


def _family_paths(model: Any) -> dict:
    """The registered family's paths of the four model-level parts, as nnsight renames; ``{}`` for a model without a family."""
    try:
        family = family_for(model.config)
    except (NnterpError, AttributeError):
        return {}
    return {family.LAYERS: "layers", family.EMBED_TOKENS: "embed_tokens", family.LN_FINAL: "ln_final", family.LM_HEAD: "lm_head"}


def _check_idx(nn_model: Any, idx: int) -> None:
    side = nn_model.tokenizer.padding_side
    if idx < 0 and side != "left":
        raise InvalidArgument(f"negative index is currently only supported with left padding, not {side}")
    if idx > 0 and side != "right":
        raise InvalidArgument(f"positive index is currently only supported with right padding, not {side}")


def get_token_activations(
    nn_model: LanguageModel,
    prompts: Any = None,
    layers: list[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
    tracer: Any = None,
) -> th.Tensor:
    """Token ``idx``'s (the last by default) ``get_activations(nn_model, layer)`` of each prompt at each layer: ``[layers, prompts, hidden]``.

    ``get_activations`` defaults to `get_layer_output`. Without ``tracer``
    the prompts run in a trace of their own (stopped after the last read) and
    the result is on the CPU; with ``tracer=`` (inside a trace, prompts
    ``None``) the values are read there, on the device of the first one read.
    A negative ``idx`` needs left padding, a positive one right padding.
    """
    with th.no_grad():
        if tracer is None and prompts is None:
            raise InvalidArgument("prompts must be provided if tracer is None")
        get_activations = get_activations or get_layer_output
        idx = -1 if idx is None else idx
        _check_idx(nn_model, idx)
        layers = list(range(get_num_layers(nn_model))) if layers is None else layers
        count = get_num_layers(nn_model)
        # Read in the order the model runs (nnsight 0.8 serves each value once, as it passes), returned in the order asked.
        order = sorted(set(layers), key=lambda layer: layer + count if layer < 0 else layer)
        read: dict = {}
        if tracer is None:
            with nn_model.trace(prompts, remote=remote) as run:
                for layer in order:
                    read[layer] = get_activations(nn_model, layer)[:, idx].cpu().save()
                run.stop()
        else:
            for layer in order:
                read[layer] = get_activations(nn_model, layer)[:, idx]
            # 1.x moved every value to layer 0's output device; that value is served once, so the first read's device is used.
            read = {layer: value.to(read[order[0]].device) for layer, value in read.items()}
        return th.stack([read[layer] for layer in layers])


def collect_last_token_activations_session(
    nn_model: Any,
    prompts: Any,
    batch_size: int,
    layers: list[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
) -> th.Tensor:
    """`collect_token_activations_batched` with every batch's trace inside one nnsight ``session`` (one request remotely)."""
    with th.no_grad():
        layers = list(range(get_num_layers(nn_model))) if layers is None else layers
        get_activations = get_activations or get_layer_output
        idx = -1 if idx is None else idx
        _check_idx(nn_model, idx)
        all_acts = []
        with nn_model.session(remote=remote):
            for start in range(0, len(prompts), batch_size):
                with nn_model.trace(list(prompts[start:start + batch_size])) as run:
                    acts = [get_activations(nn_model, layer)[:, idx].cpu().save() for layer in layers]
                    run.stop()
                all_acts.append(th.stack(acts))
            result = th.cat(all_acts, dim=1).save()
        return result


def collect_token_activations_batched(
    nn_model: LanguageModel,
    prompts: Any,
    batch_size: int,
    layers: list[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
    tqdm: Any = None,
    use_session: bool = True,
) -> th.Tensor:
    """`get_token_activations` over ``prompts`` in batches of ``batch_size``: ``[layers, prompts, hidden]`` on the CPU.

    ``tqdm``: a progress-bar factory (``tqdm.auto.tqdm``) or ``None``.
    Remotely (``remote=True``) with ``use_session`` every batch runs in one
    session (`collect_last_token_activations_session`).
    """
    if use_session and remote:
        return collect_last_token_activations_session(nn_model, prompts, batch_size, layers, get_activations, remote, idx)
    starts: Any = range(0, len(prompts), batch_size)
    if tqdm is not None:
        starts = tqdm(starts)
    acts = [
        get_token_activations(nn_model, prompts[start:start + batch_size], layers, get_activations, remote, idx)
        for start in starts
    ]
    return th.cat(acts, dim=1)


def compute_next_token_probs(nn_model: LanguageModel, prompt: str | list[str], remote: bool = False) -> th.Tensor:
    """The next-token probabilities ``[batch, vocab]`` of ``prompt`` (left-padded: each row's last token), on the CPU."""
    with nn_model.trace(prompt, remote=remote):
        out = get_logits(nn_model)[:, -1].softmax(-1).cpu().save()
    return out
