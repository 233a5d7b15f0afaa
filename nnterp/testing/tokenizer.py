"""A tiny byte-level BPE tokenizer, trained on the spot, for offline tests.

Mental model: tests need a real tokenizer (special tokens, left padding,
byte-level round-trips) but must never touch the network.  So the
tokenizer is *trained* here, in a few milliseconds, from a small English
corpus written into this file.  Training is deterministic, so the same
corpus always yields the same vocabulary and merges; the tiny checkpoints in
:mod:`nnterp.testing.checkpoints` rely on that, because their embedding rows
are indexed by these token ids.

Byte-level BPE means every string encodes (no unknown token) and decodes back
to itself exactly (after NFC normalisation).  Pre-tokenisation copies
Qwen3.5's, because ``AutoTokenizer`` rebuilds some families' tokenizers with
that pipeline regardless of the saved ``tokenizer.json``.
``<|endoftext|>`` plays eos, bos and pad at once, as in GPT-2-style
vocabularies.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["CORPUS", "SPECIAL_TOKEN", "VOCAB_SIZE", "publish_dir", "tiny_tokenizer", "tokenizer_fingerprint"]

SPECIAL_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 512

# AutoTokenizer does not always honour the saved tokenizer.json: for model
# types it lists as having wrong hub tokenizer classes (qwen3_5, qwen3_5_moe,
# ...) it rebuilds the tokenizer as Qwen3_5Tokenizer from vocab + merges,
# imposing this split regex and an NFC normalizer.  Training with the very
# same pipeline makes every loading route tokenize identically.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Varied on purpose: prompts used across the test suite ("Paris", "pizza",
# "Hello world") should split into few tokens, and enough distinct words are
# needed for the trainer to reach VOCAB_SIZE merges.
CORPUS: tuple[str, ...] = (
    "The Eiffel Tower is in the city of Paris.",
    "The Colosseum is in the city of Rome.",
    "The Statue of Liberty is in the city of New York.",
    "Big Ben is in the city of London, next to the river.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "The capital of Germany is Berlin, and the capital of Spain is Madrid.",
    "My favourite food is pizza with cheese and tomatoes.",
    "My favourite food is pasta with garlic, basil and olive oil.",
    "My favourite colour is blue, but my sister likes green.",
    "Hello world there, how are you today?",
    "Hello there! It is a lovely morning in the world.",
    "Once upon a time, a small fox lived in a quiet forest.",
    "The quick brown fox jumps over the lazy dog.",
    "She opened the window and the cold wind came into the room.",
    "We walked along the beach and watched the sun go down.",
    "The cat sat on the mat and looked at the bird outside.",
    "He drinks a cup of coffee every morning before work.",
    "The train to Berlin leaves at seven o'clock tonight.",
    "Please write your name and the date at the top of the page.",
    "Numbers like 1, 2, 3, 10, 42 and 2024 appear in text too.",
    "The scientist measured the temperature of the water twice.",
    "A neural network learns patterns from many examples.",
    "The model predicts the next word in the sentence.",
    "Rain fell all night, and in the morning the streets were wet.",
    "They played football in the park until it was dark.",
    "The library is open from nine in the morning to six in the evening.",
    "My brother plays the guitar and my mother plays the piano.",
    "The mountain was covered with snow during the whole winter.",
    "In the summer we like to swim in the lake near our house.",
    "The teacher asked the students to read the first chapter.",
    "Apples, oranges and bananas are sold at the market.",
    "The doctor said that I should sleep more and eat less sugar.",
    "The ship sailed across the ocean for thirty days.",
    "Water boils at one hundred degrees at sea level.",
    "The moon moves around the earth, and the earth moves around the sun.",
    "Our neighbours have a garden full of red and yellow flowers.",
    "Can you tell me the way to the station, please?",
    "The old man told us a story about the war.",
    "Every language has its own words for family and friends.",
    "The museum shows paintings from many different centuries.",
    "I think that the answer is simple, but the proof is long.",
    "If you heat ice, it melts; if you cool water, it freezes.",
    "The children laughed when the clown fell off his chair.",
    "def add(a, b): return a + b  # a tiny piece of code",
    "The Amazon is the largest rainforest in South America.",
    "Mount Everest is the highest mountain in the world.",
    "The price of bread went up again this year.",
    "After dinner, we usually go for a walk around the town.",
)


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    """Train once per process and keep the serialised result.

    Callers get a fresh wrapper each time (tokenizers are mutable: padding
    side, added tokens), so only the immutable JSON is cached.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            # No prefix space: decode(encode(s)) == s for NFC text.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[SPECIAL_TOKEN],
        # The full byte alphabet guarantees any unicode text is encodable,
        # not just the characters that happen to occur in CORPUS.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    return tok.to_str()


def tokenizer_fingerprint() -> str:
    """Short hash of the trained tokenizer, so caches keyed on it invalidate
    whenever the corpus or the training recipe changes."""
    return hashlib.sha256(_trained_json().encode()).hexdigest()[:16]


def _wrap(json_str: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json_str),
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        # Left padding keeps the last position of every row a real token,
        # which is where next-token reads and recurrent final states live.
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def tiny_tokenizer(cache_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """Return the tiny byte-level BPE tokenizer (512 tokens, ``<|endoftext|>``
    as eos/bos/pad, left padding).

    Without ``cache_dir`` it is trained in memory (milliseconds).  With
    ``cache_dir`` it is also saved there with ``save_pretrained`` under a
    folder named after its fingerprint, loadable with
    ``AutoTokenizer.from_pretrained``; an existing folder is reused.
    """
    tokenizer = _wrap(_trained_json())
    if cache_dir is not None:
        final = Path(cache_dir).expanduser() / f"tokenizer-{tokenizer_fingerprint()}"
        if not final.is_dir():
            publish_dir(final, tokenizer.save_pretrained)
    return tokenizer


def publish_dir(final: Path, write) -> None:
    """Run ``write(tmp)`` on a fresh temp folder next to ``final``, then
    rename it to ``final`` in one step.

    The rename is atomic within a file system, so a reader sees either no
    folder or a complete one.  If another process published ``final`` first,
    its content is equivalent (same hash-derived name): keep it, drop ours.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
