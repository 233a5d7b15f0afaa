"""The models and the measured calls of the benchmark runner.

Mental model: one medium, randomly initialized model per family, built from
its config class and saved with ``save_pretrained`` (with nnterp's tiny
tokenizer) under a cache folder, then loaded twice: a plain transformers
model (the baseline every ratio divides by) and a `StandardizedTransformer`
(what nnterp users trace). `methods` returns, per prompt length, the calls
to time; `checks` computes once, untimed, what they are supposed to agree on.
"""

from __future__ import annotations

import hashlib
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

import nnterp
from nnterp import StandardizedTransformer, fast_states
from nnterp.core.errors import NnterpError
from nnterp.families import families
from nnterp.fast import empty_cache
from nnterp.recurrent.per_token import from_arguments
from nnterp.recurrent.per_token.from_arguments import FROM_ARGUMENTS

from .models import configs  # noqa: F401  (the runner's `cases.configs`)
from .timing import Method

GENERATE = 32
#: The fast path measured both ways (issue 17: keep the faster): `states, fast path` is the default, one pass.
TWO_PASSES = "fast path with one_pass off: the kernel, then a states pass"
#: The same, on the own strategies with a one pass (its switch per component).
#: Cells in the knockout-sweep row: its time over the plain forward's, divided by this, is the cost of one cell.
SWEEP_CELLS = 8
SWEEP_ROW = f"knockout_sweep, {SWEEP_CELLS} cells of one layer (a batch row per source, targets=-1)"
#: The prompt length a full run times the sweep rows at (issue 25's target is per cell at 512 tokens).
SWEEP_LENGTH = 512
#: The sweep row's batch with nothing knocked out: what batching the prompt costs on its own.
SWEEP_BATCH_ROW = f"{SWEEP_CELLS} invokes of the prompt, nothing knocked out (the sweep's batch alone)"
OWN_TWO_PASSES = "own strategy with one_pass off: the forward's own recurrence, then a states pass"


#: ``{mixer component: the module of its one-pass switch}``, for every registered recurrent kind timed on its own
#: strategy (no fast path) whose own strategy has a one pass (lightning attention's); every one pass is
#: switched by `from_arguments.ONE_PASS` (a kind with a fast path is timed with it: ``TWO_PASSES``).
OWN_ONE_PASSES = {
    kind: from_arguments
    for kind in dict.fromkeys(family.MIXER for family in families() if family.MIXER is not None)
    if kind.FAST is None and kind.OWN_ONE_PASS is not None
}


def build(name: str, config: Any, cache_dir: Path) -> Path:
    """Save a seeded random-init model of ``config`` with the tiny tokenizer; reused when already there."""
    from transformers import AutoModelForCausalLM

    from nnterp.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config.eos_token_id = config.pad_token_id = config.bos_token_id = tokenizer.eos_token_id
    folder = cache_dir / folder_name(name, config)
    if not folder.is_dir():  # written aside, then renamed: a run stopped while saving leaves no half folder behind
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(folder)
    return folder


def folder_name(name: str, config: Any) -> str:
    """``name-<digest of the config>``: a digest, not ``hash()`` (salted per process: a new folder and a rebuild every run)."""
    return f"{name}-{hashlib.sha256(config.to_json_string().encode()).hexdigest()[:12]}"


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
    """The ways a family serves per-token states, switched outside timing.

    ``routed``: the spec's per-token path (routing; Mamba-2: a chunk size of
    one); ``fast``: ``fast_states``; ``own``: the kinds whose ``states`` need
    no setting (`support()` says available) and that have no fast path, or
    whose own strategy is the fast path's (the mLSTM), timed as they are
    (their own strategy: the forward's token loop, or states computed from
    the call's arguments).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.kind = model.family.NAME
        self.stack = ExitStack()
        self.has_fast = any(getattr(type(mix), "FAST", None) is not None for mix in mixers(model))
        # A kind whose own strategy is the fast path's (``STATES_FROM_ARGUMENTS``: the mLSTM) has no routed path.
        own_is_fast = self.has_fast and all(getattr(type(mix), "STATES_FROM_ARGUMENTS", False) for mix in mixers(model))
        self.own = (own_is_fast or not self.has_fast) and all(_states_value(mix).reason(mix) is None for mix in mixers(model))
        self.one_pass = next((switch for kind, switch in OWN_ONE_PASSES.items() if any(isinstance(mix, kind) for mix in mixers(model))), None)

    def routed(self) -> None:
        self.stack.close()
        self.stack = ExitStack()
        mixer = self.model.family.MIXER
        if mixer.CHUNKED_SCAN:  # Mamba-2: its chunk scan with every token a chunk boundary
            self.stack.enter_context(nnterp.chunk_per_token(self.model))
        elif not mixer.ONE_STEP_DECODE:  # Mamba-1's (and a short convolution's) pure-torch prompt kernel already loops
            self.stack.enter_context(nnterp.route_kernels(self.model.family, "torch"))

    def fast(self) -> None:
        self.stack.close()
        self.stack = ExitStack()
        self.stack.enter_context(fast_states(self.model))

    def two_passes(self) -> None:
        """The fast path with `from_arguments.ONE_PASS` off: the kernel runs, then the states are a second pass."""
        self.fast()
        from_arguments.ONE_PASS = False
        self.stack.callback(setattr, from_arguments, "ONE_PASS", True)

    def own_two_passes(self) -> None:
        """The own strategy with its one pass off: the forward computes its recurrence, then the states a second pass."""
        self.default()
        self.one_pass.ONE_PASS = False
        self.stack.callback(setattr, self.one_pass, "ONE_PASS", True)

    def default(self) -> None:
        self.stack.close()
        self.stack = ExitStack()


def _states_value(mix: Any) -> Any:
    return type(mix).values()["states"]


def notes(model: Any, paths: Paths) -> list:
    """Why rows are absent on this family, in nnterp's own words (its refusal, the value's own description)."""
    found = []
    if not paths.has_fast:
        try:
            with fast_states(model):
                pass
        except NnterpError as error:
            found.append(f"No fast path: `nnterp.fast_states(model)` says: {error}")
    if paths.own:
        mix = mixers(model)[0]
        found.append(
            f"No routed rows: `linear_attn.states` needs no setting on {type(mix).__name__} (`support()`: available). "
            f"Own strategy: {_states_value(mix).description}."
        )
    return found


def methods(plain: Any, model: Any, ids: torch.Tensor, values: list, paths: Paths, slow_reps: int, routed: bool, sweep: bool = True) -> list:
    """The calls timed at one prompt length (the baseline first); ``routed=False`` leaves the spec's path out,
    ``sweep=False`` the knockout sweep's two rows (eight forwards each: a full run times them at `SWEEP_LENGTH` only)."""
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

    def knockout(targets):
        def run():
            with torch.no_grad(), model.trace(ids):
                for mix in mixers(model):
                    mix.knockout(mid, targets=targets)
                logits = model.logits.save()
            return logits

        return run

    def sweep_cells():
        # One layer's cells of `nnterp.knockout_sweep`, as it runs them: a batch row (an invoke) per source.
        mix, logits = mixers(model)[0], []
        with torch.no_grad(), model.trace() as tracer:
            for source in [(mid - 1 - i) % ids.shape[1] for i in range(SWEEP_CELLS)]:
                with tracer.invoke(ids):
                    mix.knockout(source, targets=-1)
                    logits.append(model.logits.save())
        return logits

    def sweep_batch():
        logits = []
        with torch.no_grad(), model.trace() as tracer:
            for _ in range(SWEEP_CELLS):
                with tracer.invoke(ids):
                    logits.append(model.logits.save())
        return logits

    found = [
        Method("plain forward", plain_forward),
        Method("nnsight trace, reading nothing", trace_nothing),
        Method("layer_output of every layer", read("layer_output")),
        Method("state_output of every recurrent layer", read("state_output")),
        Method("knockout(mid) of every recurrent layer, every target", knockout(None)),
        Method("knockout(mid, targets=-1) of every recurrent layer", knockout(-1)),
    ]
    if sweep:
        found += [Method(SWEEP_ROW, sweep_cells), Method(SWEEP_BATCH_ROW, sweep_batch)]
    if routed:
        found += [
            Method("states, routed", read("states"), reps=slow_reps, setup=paths.routed, teardown=paths.default),
            Method("set_state_after(mid), routed", write, reps=slow_reps, setup=paths.routed, teardown=paths.default),
        ]
    if paths.own:
        found += [Method("states, own strategy", read("states"))]
        if paths.one_pass is not None:
            found += [Method(OWN_TWO_PASSES, read("states"), setup=paths.own_two_passes, teardown=paths.default)]
        found += [Method("set_state_after(mid), own strategy", write)]
    if paths.has_fast:
        captured = arguments(model, ids, paths)

        def alone():
            with torch.no_grad():
                return [type(mix).FAST.compute(named, None) for mix, named in zip(mixers(model), captured)]

        found += [
            Method("states, fast path", read("states"), setup=paths.fast, teardown=paths.default),
            Method(TWO_PASSES, read("states"), setup=paths.two_passes, teardown=paths.default),
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


def checks(model: Any, ids: torch.Tensor, values: list, paths: Paths, routed: bool, plain: Any = None) -> dict:
    """What the timed calls must agree on (fast vs routed states and writes; own states' last vs state_output), the states' size and peak memory."""
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

    def logits_reading_states():
        # Every layer's states read: on the fast path the kernel calls are skipped with the one pass's outputs.
        with torch.no_grad(), model.trace(ids):
            for mix in mixers(model):
                mix.states.save()
            logits = model.logits.save()
        return logits

    if paths.own:
        empty_cache()

        def own():
            out = []
            with torch.no_grad(), model.trace(ids):
                for mix in mixers(model):
                    out.append((mix.states.save(), mix.state_output.save()))
            return out

        found["peak_rss_own"], read = peak_rss(own)
        found["states_bytes"] = sum(s.numel() * s.element_size() for s, _ in read)
        found["own_last_vs_state_output"] = max((s[:, -1] - last).abs().max().item() for s, last in read)
        del read
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
            one_pass = logits_reading_states()
        finally:
            paths.default()
        if plain is not None:
            with torch.no_grad():
                expected = plain(ids).logits
            found["one_pass_logits_vs_plain"] = (one_pass - expected).abs().max().item() / max(expected.abs().max().item(), 1.0)
        found["states_bytes"] = sum(s.numel() * s.element_size() for s in fast)
        if reference is not None:
            scale = max(max(s.abs().max().item() for s in reference), 1.0)
            found["states_fast_vs_routed"] = max((f - r).abs().max().item() for f, r in zip(fast, reference)) / scale
            found["write_fast_vs_routed"] = (fast_logits - reference_logits).abs().max().item()
        del fast
    del reference
    empty_cache()
    return found
