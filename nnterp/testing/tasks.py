"""The toys' synthetic tasks and their word-level tokenizer.

Mental model: a toy is a tiny model *trained* on a task whose mechanism is
known, so an interpretability method run on it has a right answer to find.
Every word of a task is one token (a word-level tokenizer, built here from the
task vocabularies, no training), so a prompt's token positions are the word
positions and a sample can name where each key and value sits.

Two tasks:

* ``AssociativeRecall`` (multi-query associative recall, Zoology: Arora et al.
  2023, arXiv 2312.04927): a context of 4-16 ``key value`` pairs, keys drawn
  from ``k0..k31`` and values from the disjoint ``v0..v31`` (both without
  repetition within a context), then queries: a context key, whose next token
  is its value. Training sequences hold several queries with their answers;
  the loss is on the answers only.
* ``PlantedFacts``: a fixed table of 64 two-token subjects (``a<i> b<j>``) each
  with one attribute ``c0..c7``, asked as ``[filler...] a<i> b<j> is`` ->
  ``c<k>`` after 0-6 random filler words ``w0..w15``. The table is drawn from
  `FACT_SEED` and is part of the task (the model memorises it).

A `Sample` is one prompt (ending where the answer is predicted), its answer and
the positions (0-based token indices) of each key and value.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL", "TASKS", "VOCAB", "AssociativeRecall", "PlantedFacts", "Sample", "word_tokenizer"]

SPECIAL = "<|endoftext|>"
KEYS = tuple(f"k{i}" for i in range(32))
VALUES = tuple(f"v{i}" for i in range(32))
FIRST = tuple(f"a{i}" for i in range(8))
LAST = tuple(f"b{i}" for i in range(8))
ATTRIBUTES = tuple(f"c{i}" for i in range(8))
FILLER = tuple(f"w{i}" for i in range(16))
RELATION = "is"
#: Every word of every task; a token's id is its index here.
VOCAB = (SPECIAL, *KEYS, *VALUES, *FIRST, *LAST, *ATTRIBUTES, *FILLER, RELATION)
FACT_SEED = 1234


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word of `VOCAB` (``<|endoftext|>`` as eos, bos, pad and unknown).

    No special token is added to an encoding, so a prompt's token ``i`` is its word ``i``;
    left padding keeps every row's last position a real token.
    """
    tok = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token=SPECIAL))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        pad_token=SPECIAL,
        unk_token=SPECIAL,
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


@dataclass(frozen=True)
class Sample:
    """One prompt and its answer; positions are token indices into ``prompt``'s encoding.

    ``key_positions[i]`` and ``value_positions[i]`` are pair ``i``'s key and value
    (for `PlantedFacts`: the subject's tokens, and no value); ``queried`` is the
    pair the last token asks for; ``pairs`` are the context's ``(key, value)`` words.
    """

    prompt: str
    answer: str
    key_positions: tuple[int, ...]
    value_positions: tuple[int, ...]
    queried: int
    pairs: tuple[tuple[str, str], ...] = field(default=())

    @property
    def words(self) -> list[str]:
        return self.prompt.split()


class AssociativeRecall:
    """Multi-query associative recall (see the module doc); ``pairs`` bounds the context's pair count."""

    name = "associative_recall"

    def __init__(self, pairs: tuple[int, int] = (4, 16), queries: int = 4) -> None:
        self.pairs, self.queries = pairs, queries

    def sequence(self, rng: random.Random, n_pairs: int, n_queries: int) -> tuple[list[str], list[int]]:
        """A training sequence's words and the positions whose next word is an answer (the query keys)."""
        keys = rng.sample(KEYS, n_pairs)
        values = rng.sample(VALUES, n_pairs)
        words = [w for pair in zip(keys, values) for w in pair]
        targets = []
        for index in rng.sample(range(n_pairs), min(n_queries, n_pairs)):
            targets.append(len(words))
            words += [keys[index], values[index]]
        return words, targets

    def sample(self, rng: random.Random, n_pairs: int | None = None, queried: int | None = None,
               values: list[str] | None = None) -> Sample:
        """A context and one query (the prompt ends at the queried key; the answer is its value).

        ``queried`` picks the pair asked for and ``values`` overrides the context's
        values (a donor context: same keys, same order, other values).
        """
        n = n_pairs if n_pairs is not None else rng.randint(*self.pairs)
        keys = rng.sample(KEYS, n)
        drawn = rng.sample(VALUES, n)
        values = list(values) if values is not None else drawn
        index = queried if queried is not None else rng.randrange(n)
        words = [w for pair in zip(keys, values) for w in pair] + [keys[index]]
        return Sample(
            prompt=" ".join(words),
            answer=values[index],
            key_positions=tuple(range(0, 2 * n, 2)),
            value_positions=tuple(range(1, 2 * n, 2)),
            queried=index,
            pairs=tuple(zip(keys, values)),
        )

    def donor(self, rng: random.Random, sample: Sample) -> Sample:
        """The same keys in the same order with fresh values, every one different from ``sample``'s at its pair."""
        old = [v for _, v in sample.pairs]
        while True:
            new = rng.sample(VALUES, len(old))
            if all(a != b for a, b in zip(old, new)):
                break
        words = [w for (k, _), v in zip(sample.pairs, new) for w in (k, v)] + [sample.pairs[sample.queried][0]]
        return Sample(" ".join(words), new[sample.queried], sample.key_positions, sample.value_positions,
                      sample.queried, tuple((k, v) for (k, _), v in zip(sample.pairs, new)))

    def samples(self, n: int, seed: int = 0, **kwargs) -> Iterator[Sample]:
        """``n`` fresh samples from ``seed`` (the same seed gives the same samples)."""
        rng = random.Random(seed)
        for _ in range(n):
            yield self.sample(rng, **kwargs)


class PlantedFacts:
    """Planted facts (see the module doc): ``facts`` maps a subject ``(a<i>, b<j>)`` to its attribute."""

    name = "planted_facts"

    def __init__(self) -> None:
        rng = random.Random(FACT_SEED)
        self.facts = {(a, b): rng.choice(ATTRIBUTES) for a in FIRST for b in LAST}

    def sequence(self, rng: random.Random, n_pairs: int = 4, n_queries: int = 0) -> tuple[list[str], list[int]]:
        """A training sequence (the prompt and its answer) and the answer's position; a batch shares
        ``n_pairs``, which sets the filler's length so that its rows have one length."""
        sample = self.sample(rng, filler=min(6, max(0, n_pairs - 4)))
        return sample.words + [sample.answer], [len(sample.words) - 1]

    def sample(self, rng: random.Random, subject: tuple[str, str] | None = None, filler: int | None = None) -> Sample:
        subject = subject if subject is not None else rng.choice(sorted(self.facts))
        n = filler if filler is not None else rng.randint(0, 6)
        words = [rng.choice(FILLER) for _ in range(n)] + [*subject, RELATION]
        return Sample(" ".join(words), self.facts[subject], (n, n + 1), (), 0, (subject,))

    def donor(self, rng: random.Random, sample: Sample) -> Sample:
        """The same filler with another subject, whose attribute differs from ``sample``'s (a prompt of the same length)."""
        others = [subject for subject, attribute in sorted(self.facts.items()) if attribute != sample.answer]
        subject = rng.choice(others)
        words = sample.words[: sample.key_positions[0]] + [*subject, RELATION]
        return Sample(" ".join(words), self.facts[subject], sample.key_positions, (), 0, (subject,))

    def samples(self, n: int, seed: int = 0, **kwargs) -> Iterator[Sample]:
        rng = random.Random(seed)
        for _ in range(n):
            yield self.sample(rng, **kwargs)


TASKS = {"associative_recall": AssociativeRecall, "planted_facts": PlantedFacts}
