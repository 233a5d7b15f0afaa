"""`StateContract`: what every recurrent mixer kind's state does, checked against the plain model's own state.

Each kind's suite (``tests/components/test_<kind>.py``) subclasses it, names
the adapter of its cache layout (`tests.suites.caches`) and the few numbers
that differ (which layers, which tokens, the tolerances), and adds the kind's
own cases; a family's test file subclasses that suite and names its
``MODEL_TYPE``. The oracles are the plain transformers model's: its logits and
its state after a plain forward over each prefix, a forward whose state was
replaced after a token and continued one token at a time, and a greedy loop
whose state was replaced before a decode step. A family whose mixer has a
fast path (a ``FAST`` spec) runs the reads and writes twice: on the mixer's
own strategy and under `nnterp.fast_states`.

Layers are named by their place among the recurrent blocks (``0`` is the
first block with a ``linear_attn``), so a hybrid's attention blocks are skipped.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import nnterp
from nnterp.families import REGISTRY, absent
from tests.suites.caches import Cache
from tests.suites.checkpoint import OTHER, PROMPT, CheckpointFixtures
from tests.suites.knockout import KnockoutContract

NEW = 4
LONG = PROMPT + " " + OTHER + " " + PROMPT  # several of Mamba-2's 8-token chunks, for the fast path


def paths(model_type: str) -> tuple:
    """How a family's reads run: its mixer's own strategy, and `nnterp.fast_states` where the mixer has a ``FAST`` spec."""
    fast = absent(model_type) is None and getattr(REGISTRY[model_type].MIXER, "FAST", None) is not None
    return ("own", "fast") if fast else ("own",)


def fast_tol(expected) -> dict:
    """The fast path's arithmetic is the kernel's, regrouped: float32 rounding of the largest entry."""
    top = max(x.abs().max().item() for x in (expected if isinstance(expected, tuple) else (expected,)))
    return {"rtol": 1e-4, "atol": 1e-5 * max(1.0, top)}


def note(text: str):
    """An ``assert_close`` message that keeps torch's mismatch report after ``text``."""
    return lambda report: f"{text}\n{report}"


def recurrent_layers(model) -> list[int]:
    """Indices of the blocks with a ``linear_attn``."""
    return [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]


class StateContract(KnockoutContract, CheckpointFixtures):
    """Set ``MODEL_TYPE`` (in the family's file) and ``CACHE`` (in the kind's suite)."""

    CACHE: Cache = Cache()
    STATE_TOL = dict(rtol=1e-4, atol=1e-5)  # states against the cache
    LOGIT_TOL = dict(rtol=1e-4, atol=1e-5)  # logits against a plain forward
    PROB_TOL = dict(rtol=1e-4, atol=1e-6)  # the last token's next-token probabilities against a plain forward
    CONTINUED_TOL: dict | None = None  # the states after a write against the continued forward's (STATE_TOL when None)
    DECODE_TOL: dict | None = None  # decode-step states against the greedy loop's cache (STATE_TOL when None)
    FINAL_IS_LAST = True  # ``state_output`` is ``states[:, -1]`` exactly (else: close)
    STATE_LAYERS = (0, 1)
    WRITE_LAYER = 1
    WRITE_AT = (2, 5)
    WRITE_SCALE = 3.0
    CHANGE_ATOL: float | None = None  # a write moves the last logits by more than this (None: not checked)
    CHANGE_PROB_ATOL: float | None = None  # ... and the last probabilities by more than this
    DECODE_LAYERS = (0, 1)
    #: ``(how, step)``: a write on generate's step ``step`` (0 the prompt) by ``state_input``, ``conv_state_input``,
    #: ``state_output`` or ``set_state_after(-1, ...)``.
    DECODE_WRITES = (("state_input", 1),)
    DECODE_WRITE_LAYERS: tuple | None = (0,)  # None: every recurrent block
    DECODE_SCALE = 30.0
    DECODE_STATES = False  # ``states`` on a decode step is checked too (one token, its last ``state_output``)

    def pytest_generate_tests(self, metafunc):
        params = {
            "nth": [pytest.param(n, id=f"layer{n}") for n in self.STATE_LAYERS],
            "T": [pytest.param(t, id=f"T={t}") for t in self.WRITE_AT],
            "decode_nth": [pytest.param(n, id=f"layer{n}") for n in self.DECODE_LAYERS],
            "write": [pytest.param(w, id=f"{w[0]}-step{w[1]}") for w in self.DECODE_WRITES],
            "path": [pytest.param(p, id=p) for p in paths(self.MODEL_TYPE)],
        }
        for name, values in params.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, values)

    # -- what a kind's suite may change ------------------------------------------------

    def reading(self, model):
        """The setting a per-token read needs (DeltaNet: routed kernels; Mamba-2: ``chunk_per_token``)."""
        return contextlib.nullcontext()

    @pytest.fixture
    def reader(self, model, path):
        """The model, its per-token reads running on ``path``: its own strategy, or the fast path."""
        with nnterp.fast_states(model) if path == "fast" else self.reading(model):
            yield model

    @pytest.fixture
    def prompt(self, model, ids, path):
        return model.tokenizer(LONG, return_tensors="pt").input_ids if path == "fast" else ids

    def regrouped(self, path) -> bool:
        """Whether reads on ``path`` run `FromArguments`, whose calls regroup the kernel's sums: the fast path, or the
        own strategy of a kind that declares it so (``STATES_FROM_ARGUMENTS`` with a ``FAST`` spec: the mLSTM)."""
        mixer = REGISTRY[self.MODEL_TYPE].MIXER
        return path == "fast" or (getattr(mixer, "STATES_FROM_ARGUMENTS", False) and mixer.FAST is not None)

    def tol(self, path, expected, own: dict) -> dict:
        return fast_tol(expected) if self.regrouped(path) else own

    def same(self, path, got, expected, msg: str = "") -> None:
        """Equal on the mixer's own strategy; on the fast path, whose calls regroup their sums, within `fast_tol`."""
        if self.regrouped(path):
            torch.testing.assert_close(got, expected, **fast_tol(expected), msg=note(msg))
        else:
            assert torch.equal(got, expected), msg

    def donor(self, model, plain, layer: int, scale: float, seed: int = 0):
        """A value to write: random, shaped as the layer's state (a kind with a structured state gives a real one)."""
        _, cache = self.CACHE.prefill(plain, model.tokenizer(PROMPT, return_tensors="pt").input_ids)
        like = self.CACHE.read(cache, layer)
        return scale * torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)

    def check_write(self, donor, later) -> None:
        """A kind's own check of the state one token after a write (the convolution shifts the written window)."""

    def _final(self, states, final):
        if self.FINAL_IS_LAST:
            assert torch.equal(states[:, -1], final)
        else:
            torch.testing.assert_close(states[:, -1], final, rtol=1e-5, atol=1e-6)

    # -- the state after every token ---------------------------------------------------

    def test_states_equal_the_cache_after_each_prefix(self, reader, plain, prompt, path, nth):
        layer = recurrent_layers(reader)[nth]
        mix = reader.layers[layer].linear_attn
        with torch.no_grad(), reader.trace(prompt):
            states = mix.states.save()
            final = mix.state_output.save()
        expected = self.CACHE.prefix_states(plain, prompt, layer)
        tol = self.tol(path, expected, self.STATE_TOL)
        torch.testing.assert_close(self.CACHE.served(states), expected, **tol, msg=note(f"layer {layer}: states vs the cache per prefix"))
        self._final(states, final)

    def test_state_after_and_states_of_are_the_states(self, reader, prompt, path):
        mix = reader.layers[recurrent_layers(reader)[self.WRITE_LAYER]].linear_attn
        with torch.no_grad(), reader.trace(prompt):
            early = mix.state_after(2).save()
            late = mix.state_after(-1).save()
        with torch.no_grad(), reader.trace(prompt):
            some = mix.states_of([5, -1, 2, 5]).save()
        with torch.no_grad(), reader.trace(prompt):
            states = mix.states.save()
        self.same(path, early, states[:, 2])
        self.same(path, late, states[:, -1])
        self.same(path, some, states[:, [5, -1, 2, 5]])

    def test_reading_every_layers_states_keeps_the_plain_forward(self, reader, plain, prompt, path):
        """The one pass: with every block's states read, the logits and the states leaving the call are the plain model's."""
        layers, states = recurrent_layers(reader), []
        with torch.no_grad(), reader.trace(prompt):
            for layer in layers:
                states.append(reader.layers[layer].linear_attn.states.save())
            logits = reader.logits.save()
        expected, cache = self.CACHE.prefill(plain, prompt)
        torch.testing.assert_close(logits, expected, **self.tol(path, expected, self.LOGIT_TOL), msg=note("logits"))
        for layer, read in zip(layers, states):
            last = self.CACHE.read(cache, layer)
            torch.testing.assert_close(self.CACHE.served(read[:, -1]), last, **self.tol(path, last, self.STATE_TOL), msg=note(f"layer {layer}"))

    # -- writing the state inside a prompt --------------------------------------------

    def test_set_state_after_continues_like_a_replaced_cache(self, reader, plain, prompt, path, T):
        layer = recurrent_layers(reader)[self.WRITE_LAYER]
        mix, donor = reader.layers[layer].linear_attn, self.donor(reader, plain, layer, self.WRITE_SCALE)
        n = prompt.shape[1]
        position = T % n
        before = later = None  # a None bound inside a trace would not survive it
        with torch.no_grad(), reader.trace(prompt):
            if position:
                before = mix.state_after(position - 1).save()
            mix.set_state_after(T, donor)
            after = mix.state_after(T).save()
            if position + 1 < n:
                later = mix.state_after(position + 1).save()
            final = mix.state_output.save()
            logits = reader.logits.save()
        expected, states = self.CACHE.continue_from(plain, prompt, position, layer, donor)
        with torch.no_grad():
            clean = plain(prompt).logits
        assert torch.equal(after, donor)
        if before is not None:
            expected_before = self._prefix_end(plain, prompt[:, :position], layer)
            torch.testing.assert_close(self.CACHE.served(before), expected_before, **self.tol(path, expected_before, self.STATE_TOL))
        # Token T's own output read the state it computed: the logits up to T are the clean run's.
        torch.testing.assert_close(logits[:, : position + 1], clean[:, : position + 1], **self.tol(path, clean, self.LOGIT_TOL), msg=note("tokens up to T"))
        if expected is None:
            assert torch.equal(final, donor), "a write after the last token is the state leaving the call"
            return
        torch.testing.assert_close(logits[:, position + 1 :], expected, **self.tol(path, expected, self.LOGIT_TOL), msg=note("tokens after T"))
        torch.testing.assert_close(logits[:, -1].softmax(-1), expected[:, -1].softmax(-1), **self.PROB_TOL)
        tol = self.tol(path, states, self.CONTINUED_TOL or self.STATE_TOL)
        torch.testing.assert_close(self.CACHE.served(later), self._first(states), **tol, msg=note("the state after T + 1"))
        torch.testing.assert_close(self.CACHE.served(final), self._last(states), **tol, msg=note("the state leaving the call"))
        self.check_write(donor, later)
        if self.CHANGE_ATOL is not None:
            assert not torch.allclose(logits[:, -1], clean[:, -1], atol=self.CHANGE_ATOL), "the write changes the prediction"
        if self.CHANGE_PROB_ATOL is not None:
            assert not torch.allclose(logits[:, -1].softmax(-1), clean[:, -1].softmax(-1), rtol=0, atol=self.CHANGE_PROB_ATOL)

    def _prefix_end(self, plain, ids, layer):
        _, cache = self.CACHE.prefill(plain, ids)
        return self.CACHE.read(cache, layer)

    @staticmethod
    def _first(states):
        return tuple(s[:, 0] for s in states) if isinstance(states, tuple) else states[:, 0]

    @staticmethod
    def _last(states):
        return tuple(s[:, -1] for s in states) if isinstance(states, tuple) else states[:, -1]

    # -- decode steps against a plain greedy loop --------------------------------------

    def test_decode_state_input_and_output_are_the_cache_before_and_after(self, model, plain, ids, decode_nth):
        layer = recurrent_layers(model)[decode_nth]
        mix = model.layers[layer].linear_attn
        entering, leaving, states = [], [], []
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[:NEW]:
                state = mix.state_input
                entering.append(state.save() if state is not None else None)
                if self.DECODE_STATES:
                    states.append(mix.states.save())
                leaving.append(mix.state_output.save())
            generated = tracer.result.save()
        before = {}
        expected = self.CACHE.greedy(plain, ids, NEW, patch=lambda step, cache: before.__setitem__(step, self.CACHE.read(cache, layer)))
        assert torch.equal(generated, expected)
        assert entering[0] is None, "nothing enters the prompt"
        tol = self.DECODE_TOL or self.STATE_TOL
        for step in range(1, NEW):
            torch.testing.assert_close(self.CACHE.served(entering[step]), before[step], **tol, msg=note(f"state entering step {step}"))
            torch.testing.assert_close(self.CACHE.served(leaving[step - 1]), before[step], **tol, msg=note(f"state leaving step {step - 1}"))
            assert torch.equal(entering[step], leaving[step - 1]), f"step {step} enters from step {step - 1}'s state"
            if self.DECODE_STATES:
                assert states[step].shape[1] == 1 and torch.equal(states[step][:, 0], leaving[step]), f"states on step {step}"

    def test_a_decode_step_write_generates_like_the_plain_loop(self, model, plain, ids, write):
        how, step = write
        chosen = recurrent_layers(model)
        layers = chosen if self.DECODE_WRITE_LAYERS is None else [chosen[n] for n in self.DECODE_WRITE_LAYERS]
        donors = {layer: self.donor(model, plain, layer, self.DECODE_SCALE, seed=layer) for layer in layers}
        entering = []
        with torch.no_grad(), model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False) as tracer:
            for _ in tracer.iter[step]:
                for layer, value in donors.items():
                    mix = model.layers[layer].linear_attn
                    if how == "set_state_after":
                        mix.set_state_after(-1, value)  # the step's last token keeps its output
                    else:
                        setattr(mix, how, value)
            if how == "state_output":
                for _ in tracer.iter[step + 1]:
                    entering.append(model.layers[layers[0]].linear_attn.state_input.save())
            patched = tracer.result.save()
        at = step + 1 if how in ("state_output", "set_state_after") else step  # entering the step, or leaving it (entering the next)

        def patch(s, cache):
            if s == at:
                for layer, value in donors.items():
                    self.CACHE.write(cache, layer, value)

        assert torch.equal(patched, self.CACHE.greedy(plain, ids, NEW, patch=patch))
        assert not torch.equal(patched, self.CACHE.greedy(plain, ids, NEW)), "the write changes the continuation"
        if how == "state_output":
            assert torch.equal(entering[0], donors[layers[0]]), "the next step starts from the written state"


class PaddedBatch:
    """Mixed into a kind's suite whose states of a left-padded batch are each prompt's: set ``PADDED_LAYER``."""

    PADDED_LAYER = 1

    def test_states_of_a_left_padded_batch_are_each_prompts(self, reader, plain, path):
        layer = recurrent_layers(reader)[self.PADDED_LAYER]
        mix = reader.layers[layer].linear_attn
        with torch.no_grad(), reader.trace([PROMPT, OTHER]):
            batch = mix.states.save()
        with torch.no_grad(), reader.trace() as tracer:
            with tracer.invoke(PROMPT):
                first = mix.states.save()
            with tracer.invoke(OTHER):
                second = mix.states.save()
        self.same(path, first[0], batch[0], "one invoke each, one row each")
        self.same(path, second[0], batch[1], "one invoke each, one row each")
        width = batch.shape[1]
        for row, prompt in enumerate((PROMPT, OTHER)):
            row_ids = reader.tokenizer(prompt, return_tensors="pt").input_ids
            pad = width - row_ids.shape[1]
            expected = self.CACHE.prefix_states(plain, row_ids, layer)[0]
            torch.testing.assert_close(batch[row, pad:], expected, **self.tol(path, expected, self.STATE_TOL), msg=note(f"row {row}"))
            assert torch.count_nonzero(batch[row, :pad]) == 0, "a padding position carries no state"
        assert width > len(reader.tokenizer(OTHER).input_ids), "the second prompt is the padded one"

    def test_a_knockout_on_a_left_padded_batch_is_each_prompt_alone(self, model):
        """Positions are the padded sequence's: a row's source ``s`` is its prompt's ``s - pad`` (`tests.suites.knockout`)."""
        mix = model.layers[recurrent_layers(model)[self.PADDED_LAYER]].linear_attn
        prompts = [PROMPT, OTHER]
        batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
        pads = [int((row == 0).sum()) for row in batch.attention_mask]
        source = max(pads) + 1
        with torch.no_grad(), model.trace(prompts):
            mix.knockout(source, targets=[source, -1])
            got = model.logits.save()
        for row, prompt in enumerate(prompts):
            with torch.no_grad(), model.trace(prompt):
                mix.knockout(source - pads[row], targets=[source - pads[row], -1])
                alone = model.logits.save()
            torch.testing.assert_close(got[row, pads[row]:], alone[0], rtol=1e-4, atol=1e-4, msg=f"row {row}")
