"""nnterp 1.x's ``nnterp.prompt_utils``: prompts with target tokens, and their next-token probabilities.

`get_first_tokens` gives the first token of ``"word"`` and of ``" word"``;
`Prompt` holds a prompt and, per target name, the tokens whose probability
mass is tracked; `run_prompts` runs prompts in batches and sums each
target's probabilities: ``{target: [prompts, layers]}`` (one layer, ``1``,
for the next-token prediction; more with a lens as ``get_probs_func``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch as th
from nnsight import TransformersModel
from tqdm.auto import tqdm

from .core.errors import InvalidArgument, TokenizationError
from .logging import logger
from .nnsight_utils import LanguageModel, compute_next_token_probs
from .standardized import StandardizedTransformer

__all__ = ["TokenizationError", "get_first_tokens", "Prompt", "next_token_probs_unsqueeze", "run_prompts"]

#: ``id(tokenizer)`` -> the same tokenizer loaded with ``add_prefix_space=False``.
_NO_PREFIX: dict = {}


def _no_prefix_tokenizer(model: Any) -> Any:
    """The model's tokenizer reloaded with ``add_prefix_space=False`` (1.x's ``add_prefix_false_tokenizer``), once per tokenizer."""
    served = getattr(type(model), "add_prefix_false_tokenizer", None)
    if served is not None:
        return model.add_prefix_false_tokenizer
    tokenizer = model.tokenizer
    if id(tokenizer) not in _NO_PREFIX:
        from transformers import AutoTokenizer

        _NO_PREFIX[id(tokenizer)] = AutoTokenizer.from_pretrained(tokenizer.name_or_path, add_prefix_space=False)
    return _NO_PREFIX[id(tokenizer)]


def get_first_tokens(words: str | list[str], llm_or_tokenizer: Any, use_hacky_implementation: bool = False) -> list[int]:
    """The first token of ``word`` and of ``" word"``, for every word, without repeats (in first-seen order).

    ``llm_or_tokenizer``: a `StandardizedTransformer` (its tokenizer reloaded
    with ``add_prefix_space=False``), an nnsight ``LanguageModel`` (its
    tokenizer; nnsight 0.8's ``TransformersModel`` too) or a tokenizer. ``use_hacky_implementation``: find the first
    token of ``word`` by tokenizing ``"🍐word"`` and dropping the pear's tokens.
    Raises `TokenizationError` when neither way isolates the word's first token.
    """
    if isinstance(words, str):
        words = [words]
    if isinstance(llm_or_tokenizer, StandardizedTransformer):
        try:
            tokenizer = _no_prefix_tokenizer(llm_or_tokenizer)
        except Exception as error:
            logger.warning(f"Error getting model.add_prefix_false_tokenizer, using model.tokenizer instead:\n{error}")
            tokenizer = llm_or_tokenizer.tokenizer
    elif isinstance(llm_or_tokenizer, TransformersModel):  # LanguageModel is one
        tokenizer = llm_or_tokenizer.tokenizer
    else:
        tokenizer = llm_or_tokenizer
    final_tokens = []
    for word in words:
        if use_hacky_implementation:
            pear = tokenizer("🍐", add_special_tokens=False).input_ids
            tokens = tokenizer("🍐" + word, add_special_tokens=False).input_ids
            if tokens[: len(pear)] != pear:
                raise TokenizationError(f"tokenizing '🍐{word}' does not start with the tokens of '🍐': the pear trick cannot isolate {word!r}")
            if len(tokens) > len(pear):
                final_tokens.append(tokens[len(pear)])
            continue
        token = tokenizer(word, add_special_tokens=False).input_ids[0]
        token_with_start_of_word = tokenizer(" " + word, add_special_tokens=False).input_ids[0]
        if token == token_with_start_of_word:
            # The tokenizer adds a prefix space: "word" is " word". 1.x checked the pear trick works, then kept going.
            try:
                get_first_tokens(words, tokenizer, use_hacky_implementation=True)
                logger.warning(
                    "Seems like you use a tokenizer that wasn't initialized with add_prefix_space=False. "
                    "add_prefix_space=False is needed to ensure proper tokenization of words without the space."
                )
            except TokenizationError as error:
                raise TokenizationError(
                    "Seems like you use a tokenizer that wasn't initialized with add_prefix_space=False: "
                    "load it with add_prefix_space=False, or pass use_hacky_implementation=True"
                ) from error
        final_tokens.append(token)
        space_token = tokenizer(" ", add_special_tokens=False).input_ids
        if token_with_start_of_word != (space_token[0] if space_token else None):
            final_tokens.append(token_with_start_of_word)
    return list(dict.fromkeys(final_tokens))


@dataclass
class Prompt:
    """A prompt and, per target name, the tokens whose next-token probabilities are summed (``target_strings``: the words they came from)."""

    prompt: str
    target_tokens: dict[str, list[int]]
    target_strings: dict[str, str | list[str]] | None = None

    @classmethod
    def from_strings(cls, prompt: str, target_strings: dict[str, str | list[str]] | list[str] | str, tokenizer: Any) -> Prompt:
        """A `Prompt` whose targets are `get_first_tokens` of each target's words (a bare word or list: the target ``"target"``)."""
        if isinstance(target_strings, (str, list)):
            target_strings = {"target": target_strings}
        target_tokens = {target: get_first_tokens(words, tokenizer) for target, words in target_strings.items()}
        return cls(target_tokens=target_tokens, target_strings=target_strings, prompt=prompt)

    def has_no_collisions(self, ignore_targets: None | str | list[str] = None) -> bool:
        """Whether no token belongs to two targets (or twice to one), ``ignore_targets`` left out."""
        ignore = [ignore_targets] if isinstance(ignore_targets, str) else ignore_targets or []
        tokens = [token for target, found in self.target_tokens.items() if target not in ignore for token in found]
        return len(tokens) == len(set(tokens))

    def get_target_probs(self, probs: th.Tensor, layer: int | None = None) -> dict[str, th.Tensor]:
        """``{target: probs[:, :, tokens].sum(-1)}`` on the CPU, from ``[batch, layers, vocab]`` probabilities (at ``layer`` only, if given)."""
        found = {target: probs[:, :, tokens].sum(dim=2).cpu() for target, tokens in self.target_tokens.items()}
        if layer is not None:
            found = {target: value[:, layer] for target, value in found.items()}
        return found

    def run(self, nn_model: Any, get_probs: Callable) -> dict[str, th.Tensor]:
        """``get_target_probs(get_probs(nn_model, self.prompt))``: each target's probability mass."""
        with th.no_grad():
            return self.get_target_probs(get_probs(nn_model, self.prompt))


def next_token_probs_unsqueeze(nn_model: LanguageModel, prompt: str | list[str], remote: bool = False, **_kwargs: Any) -> th.Tensor:
    """`compute_next_token_probs` with a layer axis of size 1: ``[batch, 1, vocab]``."""
    return compute_next_token_probs(nn_model, prompt, remote=remote).unsqueeze(1)


def run_prompts(
    nn_model: LanguageModel,
    prompts: list[Prompt],
    batch_size: int = 32,
    get_probs_func: Callable | None = None,
    func_kwargs: dict | None = None,
    remote: bool = False,
    tqdm: Any = tqdm,
) -> dict[str, th.Tensor]:
    """Every prompt's targets' probability mass: ``{target: [prompts, layers]}`` on the CPU.

    ``get_probs_func(nn_model, batch, remote=remote, **func_kwargs)`` returns
    ``[batch, layers, vocab]`` (default: `next_token_probs_unsqueeze`, one
    layer). Every prompt must have the same target names. ``tqdm``: the
    progress bar (``tqdm.auto.tqdm``); ``None`` for none.
    """
    with th.no_grad():
        if len(prompts) == 0:
            return {}
        keys = set(prompts[0].target_tokens)
        for prompt in prompts:
            if set(prompt.target_tokens) != keys:
                raise InvalidArgument(f"All prompts must have the same target keys. Got {keys} and {set(prompt.target_tokens)}")
        texts = [prompt.prompt for prompt in prompts]
        get_probs_func = get_probs_func or next_token_probs_unsqueeze
        starts: Any = range(0, len(texts), batch_size)
        if tqdm is not None:
            starts = tqdm(starts, desc="Running prompts")
        probs = th.cat([get_probs_func(nn_model, texts[i : i + batch_size], remote=remote, **(func_kwargs or {})) for i in starts])
        found: dict = {target: [] for target in prompts[0].target_tokens}
        for i, prompt in enumerate(prompts):
            for target, tokens in prompt.target_tokens.items():
                found[target].append(probs[i, :, tokens].sum(dim=1))
        return {target: th.stack(values).cpu() for target, values in found.items()}
