"""nnterp 1.x's intervention helpers, on every family: logit lens, patchscopes, token activations.

Same names, signatures and semantics as ``nnterp.interventions`` and
``nnterp.nnsight_utils`` of nnterp 1.x, on `StandardizedTransformer`:

* `logit_lens`: ``[prompts, layers, vocab]`` next-token probabilities read
  from every layer's output at the last token (the family's final norm,
  unembedding, logits scale and softcap: ``model.project_on_vocab``).
* `patchscope_lens` with `TargetPrompt` / `repeat_prompt` / `it_repeat_prompt` /
  `TargetPromptBatch`; `patchscope_generate` (generations from the patched
  prompt) and `patch_object_attn_lens` (a source's attention input patched in).
* `get_token_activations` / `collect_token_activations_batched`: one token's
  activations per prompt and layer; with ``values=`` any standard value
  (``"layer_output"``, ``"self_attn.attention_output"``, ``"mlp.mlp_output"``,
  ``"linear_attn.state_output"``, ...), returned as ``{value: {layer: tensor}}``
  (defined in `nnterp.token_activations`, the lenses' source of hidden states).

The steering and skipping helpers are methods: ``model.steer``,
``model.skip_layer`` / ``model.skip_layers``. The helpers run locally:
``remote=True`` is refused with the way to run the same reads on NDIF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .core.errors import InvalidArgument, SignatureError, WrongType
from .logging import logger
from .nnsight_utils import get_attention, get_layer_output, get_next_token_probs, get_num_layers
from .nnsight_utils import get_token_activations as layer_activations
from .token_activations import (
    chosen_layers,
    collect_token_activations_batched,
    get_token_activations,
    run_locally,
    the_model,
)

__all__ = [
    "logit_lens",
    "TargetPrompt",
    "repeat_prompt",
    "it_repeat_prompt",
    "TargetPromptBatch",
    "patchscope_lens",
    "patchscope_generate",
    "patch_object_attn_lens",
    "get_token_activations",
    "collect_token_activations_batched",
]


def _left_padded(model: Any, prompts: Any, what: str) -> None:
    """Refuse a batch the tokenizer would pad on the right: ``[:, -1]`` would be padding for its shorter prompts."""
    if isinstance(prompts, (list, tuple)) and len(prompts) > 1 and model.tokenizer.padding_side != "left":
        mask = model.tokenizer(list(prompts), padding=True, return_tensors="pt").attention_mask
        if not bool(mask[:, -1].all()):
            raise InvalidArgument(
                f"{what} reads each prompt's last token at position -1, which needs left padding; the tokenizer pads "
                f"{model.tokenizer.padding_side}: set model.tokenizer.padding_side = 'left', or pass prompts of one length"
            )


def logit_lens(
    nn_model: Any = None,
    prompts: str | list[str] | None = None,
    remote: bool = False,
    return_inv_logits: bool = False,
    *,
    model: Any = None,
) -> Any:
    """Next-token probabilities at the last token of each prompt, read from every layer's output.

    Args:
        nn_model: a `StandardizedTransformer` (1.x's name, first; ``model=`` also takes it).
        prompts: a prompt or a list of prompts (left-padded together).
        return_inv_logits: also return the probabilities of the negated (normed) hidden states.

    Returns:
        ``[prompts, layers, vocab]`` probabilities on the CPU (and the inverse ones).
        At the last layer they are ``model.next_token_probs``.
    """
    model = the_model("logit_lens", nn_model, model, prompts=prompts)
    with torch.no_grad():  # a block, not a decorator: a server rebuilds the bare function
        run_locally(remote)
        _left_padded(model, prompts, "logit_lens")
        probs: list = []
        inverse: list = []
        with model.trace(prompts):
            for layer in range(model.num_layers):
                hidden = model.layers_output[layer][:, -1]
                probs.append(model.project_on_vocab(hidden).float().softmax(-1).cpu().save())
                if return_inv_logits:
                    inverse.append(model.lm_head(-model.ln_final(hidden)).float().softmax(-1).cpu().save())
        stacked = torch.stack(probs).transpose(0, 1)
        if return_inv_logits:
            return stacked, torch.stack(inverse).transpose(0, 1)
        return stacked


@dataclass
class TargetPrompt:
    """A prompt to patch and the index of the token whose residual stream is replaced."""

    prompt: str
    index_to_patch: int


def repeat_prompt(words: list[str] | None = None, rel: str = " ", sep: str = "\n", placeholder: str = "?", index_to_patch: int = -1) -> TargetPrompt:
    """The patchscopes paper's next-token prompt: ``"king king\\n1135 1135\\nhello hello\\n?"``, patched at the placeholder."""
    if words is None:
        words = ["king", "1135", "hello"]
    return TargetPrompt(sep.join(w + rel + w for w in words) + sep + placeholder, index_to_patch)


@dataclass
class TargetPromptBatch:
    """Several target prompts with their indices to patch."""

    prompts: list[str]
    index_to_patch: torch.Tensor

    @classmethod
    def from_target_prompts(cls, prompts_: list[TargetPrompt]) -> TargetPromptBatch:
        return cls([p.prompt for p in prompts_], torch.tensor([p.index_to_patch for p in prompts_]))

    @classmethod
    def from_target_prompt(cls, prompt: TargetPrompt, batch_size: int) -> TargetPromptBatch:
        return cls([prompt.prompt] * batch_size, torch.tensor([prompt.index_to_patch] * batch_size))

    @classmethod
    def from_prompts(cls, prompts: str | list[str], index_to_patch: int | list[int] | torch.Tensor) -> TargetPromptBatch:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if isinstance(index_to_patch, int):
            index_to_patch = [index_to_patch] * len(prompts)
        return cls(prompts, torch.as_tensor(index_to_patch))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx: int) -> TargetPrompt:
        return TargetPrompt(self.prompts[idx], int(self.index_to_patch[idx]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @staticmethod
    def auto(target_prompt: Any, batch_size: int) -> TargetPromptBatch:
        if isinstance(target_prompt, TargetPrompt):
            return TargetPromptBatch.from_target_prompt(target_prompt, batch_size)
        if isinstance(target_prompt, list):
            return TargetPromptBatch.from_target_prompts(target_prompt)
        if not isinstance(target_prompt, TargetPromptBatch):
            raise WrongType(f"target prompts must be a TargetPrompt, a list of them or a TargetPromptBatch, got {type(target_prompt).__name__}")
        return target_prompt


def patchscope_lens(
    nn_model: Any = None,
    source_prompts: str | list[str] | None = None,
    target_patch_prompts: TargetPromptBatch | list[TargetPrompt] | TargetPrompt | None = None,
    layers: int | list[int] | None = None,
    latents: torch.Tensor | None = None,
    remote: bool = False,
    *,
    model: Any = None,
) -> torch.Tensor:
    """Patch each source prompt's last-token residual stream at each layer into the target prompt; read its next-token probabilities.

    Args:
        nn_model: a `StandardizedTransformer` (1.x's name, first; ``model=`` also takes it).
        source_prompts: where the hidden states come from (their last token), or give ``latents``.
        target_patch_prompts: the prompt(s) patched at ``index_to_patch`` (`repeat_prompt` by default).
        layers: the layers to patch at (all by default); the target is patched at the same layer.
        latents: ``[layers, sources, hidden]`` hidden states to patch instead of reading them.

    Returns:
        ``[sources, layers, vocab]`` probabilities on the CPU.
    """
    model = the_model("patchscope_lens", nn_model, model)
    with torch.no_grad():  # a block, not a decorator: a server rebuilds the bare function
        run_locally(remote)
        if target_patch_prompts is None:
            target_patch_prompts = repeat_prompt()
        if latents is not None:
            if source_prompts is not None:
                raise InvalidArgument("pass source_prompts or latents, not both")
            num_sources = len(latents[0])
        else:
            if source_prompts is None:
                raise SignatureError("pass source_prompts or latents")
            source_prompts = [source_prompts] if isinstance(source_prompts, str) else source_prompts
            num_sources = len(source_prompts)
        targets = TargetPromptBatch.auto(target_patch_prompts, num_sources)
        if len(targets) != num_sources:
            raise InvalidArgument(f"{num_sources} sources but {len(targets)} target prompts")
        layers = chosen_layers(model, layers, "patchscope_lens")
        if latents is None:
            latents = get_token_activations(model, source_prompts, layers=layers)
        probs = []
        for index, layer in enumerate(layers):
            with model.trace(targets.prompts):
                output = model.layers_output[layer]
                output[torch.arange(num_sources), targets.index_to_patch] = latents[index].to(device=output.device, dtype=output.dtype)
                model.layers_output[layer] = output
                probs.append(model.next_token_probs.cpu().save())
        return torch.stack(probs).transpose(0, 1)




def it_repeat_prompt(
    tokenizer: Any,
    words: list[str] | None = None,
    rel: str = " ",
    sep: str = "\n",
    placeholder: str = "?",
    complete_prompt: bool = True,
    add_user_instr: bool = True,
    use_system_prompt: bool = True,
) -> TargetPrompt:
    """`repeat_prompt` in the tokenizer's chat template, for instruction-tuned models; patched at the last token.

    ``add_user_instr``: a user turn explains the task and the assistant
    answers "Ok." before the prompt; ``use_system_prompt``: a system turn
    (the task in it without ``add_user_instr``); ``complete_prompt``: the
    assistant's turn starts with the prompt itself (else it is empty).
    """
    prompt = repeat_prompt(words, rel, sep, placeholder).prompt
    answer = {"role": "assistant", "content": prompt if complete_prompt else ""}
    chat: list = []
    if add_user_instr:
        if use_system_prompt:
            chat.append({"role": "system", "content": "You are a helpful assistant."})
        chat += [
            {"role": "user", "content": "I will provide you with a series of sentences. Your task is to guess the next word in the sentence. You must answer with the next word only."},
            {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": prompt},
            answer,
        ]
    elif use_system_prompt:
        chat += [
            {"role": "system", "content": "The user will provide you with a sentence. Your task is to guess the next word in the sentence. You must answer with the next word only."},
            {"role": "user", "content": prompt},
            answer,
        ]
    else:
        chat += [{"role": "user", "content": f"Guess the next word in the following sentence (answer only the next word): {prompt}"}, answer]
    text = tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True, add_special_tokens=False)
    return TargetPrompt(text, -1)


def patchscope_generate(
    nn_model: Any,
    prompts: list[str] | str,
    target_patch_prompt: TargetPrompt,
    max_length: int = 50,
    layers: list[int] | None = None,
    remote: bool = False,
    max_batch_size: int = 32,
) -> dict[int, torch.Tensor]:
    """Generate from ``target_patch_prompt`` with its ``index_to_patch`` token's residual stream replaced, at each layer, by each prompt's last token's.

    Returns ``{layer: [prompts, target tokens + max_length]}`` token ids on
    the CPU (the target prompt and up to ``max_length`` new tokens; the patch
    is applied on the prompt's forward). Layers run ``max_batch_size //
    len(prompts)`` at a time, one invoke each, in one ``generate``.
    """
    with torch.no_grad():
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if len(prompts) > max_batch_size:
            logger.warning(f"Number of prompts ({len(prompts)}) exceeds max_batch_size ({max_batch_size}). This may cause memory errors.")
        layers = list(range(get_num_layers(nn_model))) if layers is None else list(layers)
        hiddens = layer_activations(nn_model, prompts, layers=layers, remote=remote)
        generations: dict = {}
        per_run = max(max_batch_size // len(prompts), 1)
        for start in range(0, len(layers), per_run):
            chunk = list(enumerate(layers))[start:start + per_run]
            with nn_model.generate(max_new_tokens=max_length, remote=remote) as tracer:
                for index, layer in chunk:
                    with tracer.invoke([target_patch_prompt.prompt] * len(prompts)):
                        output = get_layer_output(nn_model, layer)
                        output[:, target_patch_prompt.index_to_patch] = hiddens[index].to(device=output.device, dtype=output.dtype)
                        generations[layer] = tracer.result.save()  # this invoke's rows
        return {layer: generated.cpu() for layer, generated in generations.items()}


def patch_object_attn_lens(
    nn_model: Any,
    source_prompts: list[str] | str,
    target_prompts: list[str] | str,
    attn_idx_patch: int,
    num_patches: int = 5,
) -> torch.Tensor:
    """Next-token probabilities of ``target_prompts`` with the attention input at ``attn_idx_patch`` replaced by the source's last token's.

    For each layer ``l``, the attention (token mixer) inputs of layers ``l``
    to ``l + num_patches - 1`` are patched with those of the source prompts'
    last token (one source for every target, or one each). Returns
    ``[targets, layers, vocab]`` on the CPU.
    """
    with torch.no_grad():
        source_prompts = [source_prompts] if isinstance(source_prompts, str) else source_prompts
        target_prompts = [target_prompts] if isinstance(target_prompts, str) else target_prompts
        num_layers = get_num_layers(nn_model)
        sources = layer_activations(nn_model, source_prompts, get_activations=lambda model, layer: get_attention(model, layer).input)
        probs = []
        for layer in range(num_layers):
            with nn_model.trace(target_prompts):
                for patched in range(layer, min(num_layers, layer + num_patches)):
                    hidden = get_attention(nn_model, patched).input
                    hidden[:, attn_idx_patch] = sources[patched].to(device=hidden.device, dtype=hidden.dtype)
                probs.append(get_next_token_probs(nn_model).cpu().save())
        return torch.stack(probs).transpose(0, 1)
