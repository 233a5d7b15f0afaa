"""The models and the measured calls of the benchmark runner.

Mental model: one medium, randomly initialized model per family, built from
its config class and saved with ``save_pretrained`` (with nnterp's tiny
tokenizer) under a cache folder, then loaded twice: a plain transformers
model (the baseline every ratio divides by) and a `StandardizedTransformer`
(what nnterp users trace). `methods` returns, per prompt length, the calls
to time; `checks` computes once, untimed, what they are supposed to agree on.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

import nnterp
from nnterp import StandardizedTransformer, fast_states
from nnterp.fast import empty_cache
from nnterp.recurrent.per_token.from_arguments import FROM_ARGUMENTS

from .timing import Method

GENERATE = 32


def configs(tiny: bool) -> dict:
    """``{name: config}``: Qwen3.5-like gated DeltaNet hybrid, Mamba-1, Mamba-2 (tiny ones for the smoke test)."""
    from transformers import Mamba2Config, MambaConfig, Qwen3_5TextConfig

    from nnterp.testing import tiny_tokenizer

    vocab = len(tiny_tokenizer())
    if tiny:
        return {
            "gated_deltanet": Qwen3_5TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
            "mamba": MambaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2),
            "mamba2": Mamba2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16, n_groups=1, chunk_size=8, expand=2),
        }
    # Qwen3.5-0.8B's linear attention: 16 key heads and 16 value heads of 128; hidden 1024; 3 DeltaNet blocks per attention block.
    return {
        "gated_deltanet": Qwen3_5TextConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256),
        "mamba": MambaConfig(vocab_size=vocab, hidden_size=768, num_hidden_layers=4, state_size=16, expand=2),
        "mamba2": Mamba2Config(vocab_size=vocab, hidden_size=768, num_hidden_layers=4, num_heads=24, head_dim=64, state_size=128, n_groups=1, chunk_size=256, expand=2),
    }


def build(name: str, config: Any, cache_dir: Path) -> Path:
    """Save a seeded random-init model of ``config`` with the tiny tokenizer; reused when already there."""
    from transformers import AutoModelForCausalLM

    from nnterp.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config.eos_token_id = config.pad_token_id = config.bos_token_id = tokenizer.eos_token_id
    folder = cache_dir / f"{name}-{abs(hash(config.to_json_string())) % 10**10}"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def load(folder: Path) -> tuple:
    """``(plain transformers model, StandardizedTransformer)`` of one saved folder, eval mode, float32."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = StandardizedTransformer(str(folder), dispatch=True, device="cpu")
    model._module.eval()
    return plain, model


def mixers(model: Any) -> list:
    return [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]


def prompt(model: Any, length: int, seed: int) -> torch.Tensor:
    """Random token ids ``[1, length]``, never the end-of-text token (generate would stop)."""
    vocab = model._module.config.vocab_size
    ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    eos = model.tokenizer.eos_token_id
    return torch.where(ids == eos, (ids + 1) % vocab, ids)


def donors(model: Any, ids: torch.Tensor) -> list:
    """A state to write into each recurrent layer: its own state at the end of the prompt, scaled."""
    outs = []
    with torch.no_grad(), model.trace(ids):
        for mix in mixers(model):
            outs.append(mix.state_output.save())
    return [3.0 * out for out in outs]


class Paths:
    """The spec's per-token path (routing; Mamba-2: a chunk size of one) and the fast path, switched outside timing."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.kind = model.family.NAME
        self.stack = ExitStack()

    def routed(self) -> None:
        self.stack.close()
        self.stack = ExitStack()
        if self.kind == "mamba2":
            self.stack.enter_context(nnterp.chunk_per_token(self.model))
        elif self.kind != "mamba":  # Mamba-1's pure-torch prompt kernel is already the token loop
            self.stack.enter_context(nnterp.route_kernels(self.model.family, "torch"))

    def fast(self) -> None:
        self.stack.close()
        self.stack = ExitStack()
        self.stack.enter_context(fast_states(self.model))

    def default(self) -> None:
        self.stack.close()
        self.stack = ExitStack()

    @property
    def has_fast(self) -> bool:
        return any(getattr(type(mix), "FAST", None) is not None for mix in mixers(self.model))


def methods(plain: Any, model: Any, ids: torch.Tensor, values: list, paths: Paths, slow_reps: int, routed: bool) -> list:
    """The calls timed at one prompt length (the baseline first); ``routed=False`` leaves the spec's path out."""
    mid = ids.shape[1] // 2

    def plain_forward():
        with torch.no_grad():
            return plain(ids)

    def trace_nothing():
        with torch.no_grad(), model.trace(ids):
            pass

    def read(value):
        def run():
            out = []
            with torch.no_grad(), model.trace(ids):
                for part in (model.layers if value == "layer_output" else mixers(model)):
                    out.append(getattr(part, value).save())
            return out

        return run

    def write():
        with torch.no_grad(), model.trace(ids):
            for mix, value in zip(mixers(model), values):
                mix.set_state_after(mid, value)
            logits = model.logits.save()
        return logits

    found = [
        Method("plain forward", plain_forward),
        Method("nnsight trace, reading nothing", trace_nothing),
        Method("layer_output of every layer", read("layer_output")),
        Method("state_output of every recurrent layer", read("state_output")),
    ]
    if routed:
        found += [
            Method("states, routed", read("states"), reps=slow_reps, setup=paths.routed, teardown=paths.default),
            Method("set_state_after(mid), routed", write, reps=slow_reps, setup=paths.routed, teardown=paths.default),
        ]
    if paths.has_fast:
        captured = arguments(model, ids, paths)

        def alone():
            with torch.no_grad():
                return [type(mix).FAST.compute(named, None) for mix, named in zip(mixers(model), captured)]

        found += [
            Method("states, fast path", read("states"), setup=paths.fast, teardown=paths.default),
            Method("set_state_after(mid), fast path", write, setup=paths.fast, teardown=paths.default),
            Method("fast states computed alone from captured kernel arguments", alone),
        ]
    return found


def arguments(model: Any, ids: torch.Tensor, paths: Paths) -> list:
    """Each recurrent layer's prompt kernel arguments by name, as the fast path reads them."""
    captured = []
    paths.fast()
    try:
        with torch.no_grad(), model.trace(ids):
            for mix in mixers(model):
                # The strategy's own record of the call: its arguments by the signature table's names.
                captured.append(FROM_ARGUMENTS.record(mix, "states").strategy["named"])
    finally:
        paths.default()
    return captured


def generate_methods(plain: Any, model: Any, ids: torch.Tensor) -> list:
    """``generate`` of `GENERATE` tokens: plain, through nnsight reading nothing, and reading every state_output each step."""
    settings = dict(max_new_tokens=GENERATE, min_new_tokens=GENERATE, do_sample=False)

    def plain_generate():
        with torch.no_grad():
            return plain.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=plain.config.eos_token_id, **settings)

    def nnsight_generate():
        with torch.no_grad(), model.generate(ids, **settings):
            pass

    def reading_generate():
        out = []
        with torch.no_grad(), model.generate(ids, **settings) as tracer:
            for _ in tracer.iter[:GENERATE]:
                for mix in mixers(model):
                    out.append(mix.state_output.save())
        return out

    return [
        Method("generate, plain", plain_generate),
        Method("generate, nnsight reading nothing", nnsight_generate),
        Method("generate, state_output of every recurrent layer at every step", reading_generate),
    ]


def checks(model: Any, ids: torch.Tensor, values: list, paths: Paths, routed: bool) -> dict:
    """What the timed calls must agree on (fast vs routed states and writes), the states' size and peak memory."""
    from .timing import peak_rss

    found: dict = {}

    def states():
        out = []
        with torch.no_grad(), model.trace(ids):
            for mix in mixers(model):
                out.append(mix.states.save())
        return out

    def write():
        with torch.no_grad(), model.trace(ids):
            for mix, value in zip(mixers(model), values):
                mix.set_state_after(ids.shape[1] // 2, value)
            logits = model.logits.save()
        return logits

    reference = None
    if routed:
        empty_cache()
        paths.routed()
        try:
            found["peak_rss_routed"], reference = peak_rss(states)
            reference_logits = write()
        finally:
            paths.default()
        found["states_bytes"] = sum(s.numel() * s.element_size() for s in reference)
    if paths.has_fast:
        empty_cache()  # measure a fresh allocation, not the cache of earlier calls
        paths.fast()
        try:
            found["peak_rss_fast"], fast = peak_rss(states)
            fast_logits = write()
        finally:
            paths.default()
        found["states_bytes"] = sum(s.numel() * s.element_size() for s in fast)
        if reference is not None:
            scale = max(max(s.abs().max().item() for s in reference), 1.0)
            found["states_fast_vs_routed"] = max((f - r).abs().max().item() for f, r in zip(fast, reference)) / scale
            found["write_fast_vs_routed"] = (fast_logits - reference_logits).abs().max().item()
        del fast
    del reference
    empty_cache()
    return found
