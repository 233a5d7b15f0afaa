"""`nnterp.long_context_profile`: a sequence in chunks, its state norms, decays and effective memory.

Oracles, none of them nnterp: the plain transformers model's own cache after
each prefix (`tests.suites.caches`, the state contract's adapters) for the
norms; the same model run to ``t``, its state and convolution window zeroed
by hand in its cache, then fed one token at a time to ``T`` for the reset
behind effective memory; and, for chunking, the profile of the whole sequence
in one chunk (chunk sizes that divide the length and that do not, and one
shorter than a convolution window), on every recurrent kind, the families
whose chunks nnterp mends included. The families' declarations of whether
transformers' chunked prefill continues exactly (``CHUNKS_DIFFER``) are
checked against transformers both ways.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import nnterp
from nnterp import EmptyPrompt, InvalidArgument, PositionError, StandardizedTransformer, Unavailable, WrongType
from nnterp.chunked_prefill import Carry
from nnterp.components.mlstm import MLSTM
from nnterp.families import REGISTRY, absent, families
from nnterp.testing import toy_checkpoint
from tests.reference import hf_oracles as hf
from tests.reference import rg_lru as rg_lru_ref
from tests.suites.caches import Cache, ConvCache, LinearCache, ModuleState, WKVState, XLSTMCache

N = 24
RECURRENT = [f.NAME for f in families() if f.MIXER is not None and absent(f.NAME) is None]


def _per_component(carrying: bool) -> list[str]:
    """The first family of each recurrent component (registry order) that does (or does not) carry state in chunks."""
    found: dict = {}
    for family in families():
        if family.NAME in RECURRENT and family.continues_chunks() == carrying:
            found.setdefault(family.MIXER.__name__, family.NAME)
    return sorted(found.values())


CARRYING = _per_component(True)  # every kind, with hybrids among them
#: The other Mamba-1 families (CARRYING has Jamba): transformers restarts their state on every chunk, nnterp writes it.
WRITTEN = ["mamba", "falcon_mamba"]
#: How each kind's state sits in the plain model's cache, and whether a reset also zeroes a convolution window there.
ADAPTERS = {
    "LinearAttention": (Cache(), True), "KimiDeltaAttention": (Cache(), True), "StateSpace": (Cache(), True),
    "SelectiveScan": (Cache(), True), "ShortConvolution": (ConvCache(), False), "WKV": (WKVState(), False),
    "LightningAttention": (LinearCache(), False), "RGLRU": (ModuleState(), True), "MLSTM": (XLSTMCache(MLSTM.unpack), False),
}


def _ids(model, n: int = N, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(model.tokenizer.vocab_size, 200), (n,), generator=generator)


def test_the_kinds_cover_every_recurrent_component_and_a_hybrid():
    # RecurrentGemma's chunks are mended from transformers 5.24 only (its family's MENDABLE)
    components = {REGISTRY[name].MIXER.__name__ for name in RECURRENT if REGISTRY[name].continues_chunks()}
    assert {REGISTRY[name].MIXER.__name__ for name in CARRYING} == components
    assert "qwen3_5_text" in CARRYING  # a gated DeltaNet hybrid: attention layers between the recurrent ones


@pytest.mark.parametrize("model_type", CARRYING + WRITTEN)
def test_chunked_profile_equals_the_unchunked_one(model_type, load):
    model = load(model_type)
    ids = _ids(model)
    kwargs = dict(memory_at=[9, N - 1], lags=[0, 1, 3, 8], progress=False)
    whole = nnterp.long_context_profile(model, ids, chunk_size=N, **kwargs)
    assert set(whole.state_norm) == set(whole.memory) and whole.memory_all.shape == (2, 4)
    for chunk_size in (8, 6, 5, 7, 2):  # dividing the length, and not; shorter than a convolution window
        chunked = nnterp.long_context_profile(model, ids, chunk_size=chunk_size, **kwargs)
        for layer, norm in whole.state_norm.items():
            assert norm.shape[0] == N and norm.dim() == 2
            # Float32 rounding: the chunk kernels sum in another order than one call over the whole sequence.
            torch.testing.assert_close(chunked.state_norm[layer], norm, rtol=1e-5, atol=1e-6)
        for layer, decay in whole.decay.items():
            torch.testing.assert_close(chunked.decay[layer], decay, rtol=1e-5, atol=1e-6)
        for layer, memory in whole.memory.items():
            torch.testing.assert_close(chunked.memory[layer], memory, rtol=1e-4, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(chunked.memory_all, whole.memory_all, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert whole.memory_all[:, 0].gt(0).any()  # resetting everything before T changes the prediction at T


def _head_norms(state, kind: str) -> torch.Tensor:
    """One state from the plain model's cache, ``[1, heads, ...]`` (RWKV-4: ``[1, parts, channels]``; the xLSTM:
    ``(C, n, m)``, packed as nnterp serves it), as the norm per head (channel) ``[heads]``."""
    if kind == "WKV":
        state = state.transpose(1, 2)
    if kind == "MLSTM":
        c, n, m = state
        state = MLSTM.pack(c, n, m[..., None])
    return state[0].float().reshape(state.shape[1], -1).norm(dim=-1)


@pytest.mark.parametrize("model_type", CARRYING)
def test_norms_equal_the_hf_caches_state_after_each_prefix(model_type, load, plains):
    kind = REGISTRY[model_type].MIXER.__name__
    model, plain = load(model_type), plains(model_type)
    adapter, _ = ADAPTERS[kind]
    ids = _ids(model, 14)
    chunk = 5 if model.family.continues_chunks() else 14
    profile = nnterp.long_context_profile(model, ids, chunk_size=chunk, every=2, memory_at=[], progress=False)
    assert profile.positions.tolist() == list(range(0, 14, 2))
    for layer, norms in profile.state_norm.items():
        for row, position in ((0, 0), (3, 6), (6, 12)):
            _, cache = adapter.prefill(plain, ids[None, : position + 1])
            torch.testing.assert_close(norms[row], _head_norms(adapter.read(cache, layer), kind), rtol=1e-4, atol=1e-5, msg=lambda text, at=(layer, position): f"{text} (layer, position) {at}")


def _zero_by_hand(adapter, cache, layer: int, kind: str, conv: bool) -> None:
    """The plain model's state (and convolution window) of ``layer`` zeroed in its own cache."""
    if kind == "WKV":
        for part in (0, 1, 2, 3, 4):  # the channel mix's and the time mix's token shifts, the WKV numerator, denominator, maximum
            cache[part][:, :, layer] = 0
        return
    state = adapter.read(cache, layer)
    if kind == "MLSTM":
        c, n, m = state
        state = MLSTM.pack(c, n, m[..., None])  # the adapter writes nnterp's packed layout
    adapter.write(cache, layer, torch.zeros_like(state))
    if conv and kind == "RGLRU":  # the window on the block's module
        block = rg_lru_ref.block(cache[0], layer)
        block.conv1d_state = torch.zeros_like(block.conv1d_state)
    elif conv:
        hf.set_conv_state(cache, layer, torch.zeros_like(hf.conv_state(cache, layer)))


def _reset_by_hand(plain, adapter, ids: torch.Tensor, t: int, T: int, layers: list[int], kind: str, conv: bool) -> torch.Tensor:
    _, cache = adapter.prefill(plain, ids[None, :t])
    for layer in layers:
        _zero_by_hand(adapter, cache, layer, kind, conv)
    for position in range(t, T + 1):
        logits, cache = adapter.step(plain, ids[None, position : position + 1], position, cache)
    return F.log_softmax(logits[0, -1].float(), -1)


@pytest.mark.parametrize("model_type", CARRYING)
def test_a_reset_at_t_equals_a_hf_forward_whose_cache_is_zeroed_at_t_by_hand(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    adapter, conv = ADAPTERS[REGISTRY[model_type].MIXER.__name__]
    kind = REGISTRY[model_type].MIXER.__name__
    ids = _ids(model, 16, seed=1)
    T, lags = 14, [1, 4, 9]
    profile = nnterp.long_context_profile(model, ids, chunk_size=6, memory_at=[T], lags=lags, progress=False)
    with torch.no_grad():
        full = F.log_softmax(plain(ids[None, : T + 1]).logits[0, -1].float(), -1)
    recurrent = sorted(profile.state_norm)
    for j, lag in enumerate(lags):
        t = T - lag
        for layer in recurrent[:2]:
            reset = _reset_by_hand(plain, adapter, ids, t, T, [layer], kind, conv)
            expected = float((full.exp() * (full - reset)).sum())
            assert profile.memory[layer][0, j].item() == pytest.approx(expected, rel=1e-4, abs=1e-5), (layer, t)
        reset = _reset_by_hand(plain, adapter, ids, t, T, recurrent, kind, conv)
        expected = float((full.exp() * (full - reset)).sum())
        assert profile.memory_all[0, j].item() == pytest.approx(expected, rel=1e-4, abs=1e-5), t


def _chunked_logits(plain, ids: torch.Tensor, size: int, argument: str, hybrid: bool) -> torch.Tensor:
    """transformers alone: the sequence in chunks, each passed the cache the one before returned, and on a
    ``hybrid`` the attention mask over every token so far, as generate passes them."""
    parameters = inspect.signature(plain.forward).parameters
    # transformers 5.24 renamed the cache's keyword and the output's field to ``cache`` (before: past_key_values,
    # Mamba's cache_params); a name the forward lacks is swallowed by its **kwargs and the cache silently dropped.
    argument = next((name for name in ("cache", argument, "cache_params", "past_key_values") if name in parameters), argument)
    cache, parts = None, []
    for start in range(0, ids.shape[1], size):
        end = min(start + size, ids.shape[1])
        kwargs: dict = {"use_cache": True}
        if hybrid:
            kwargs["attention_mask"] = torch.ones(1, end, dtype=torch.long)
        if cache is not None:
            kwargs[argument] = cache
        if "cache_position" in parameters:
            kwargs["cache_position"] = torch.arange(start, end)
        if "position_ids" in parameters:
            kwargs["position_ids"] = torch.arange(start, end)[None]
        out = plain(ids[:, start:end], **kwargs)
        cache = getattr(out, argument, None)
        parts.append(out.logits)
    return torch.cat(parts, 1)


@pytest.mark.parametrize("model_type", RECURRENT)
def test_each_familys_chunks_differ_declaration_matches_transformers(model_type, plains):
    plain, family = plains(model_type), REGISTRY[model_type]
    ids = torch.randint(3, 200, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hybrid = any("self_attn" in parts for parts in family.layer_parts(plain.config))
        gap = (plain(ids).logits - _chunked_logits(plain, ids, 5, family.CACHE_ARGUMENT, hybrid)).abs().max().item()
    if family.CHUNKS_DIFFER is None:
        assert gap < 1e-4, f"{model_type}: a chunked prefill is {gap} off: declare CHUNKS_DIFFER"
    else:
        assert gap > 1e-3, f"{model_type}: transformers now continues chunks exactly ({gap}): drop CHUNKS_DIFFER"


def test_a_family_whose_chunks_nothing_mends_runs_in_one_chunk_and_says_why_otherwise(load, monkeypatch):
    """Every registered family's chunks continue now; one whose forward differs with nothing declared to mend it
    (RecurrentGemma without its declarations) is refused."""
    model = load("recurrent_gemma")
    for name in ("CHUNK_STATE_INPUT", "CHUNK_WINDOW_INPUT"):
        monkeypatch.setattr(model.family, name, False)
    ids = _ids(model, 12)
    profile = nnterp.long_context_profile(model, ids, chunk_size=12, progress=False)
    assert profile.memory_at == [] and all(norm.shape[0] == 12 for norm in profile.state_norm.values())
    with pytest.raises(Unavailable, match=r"chunk_size >= len\(ids\) \(12\)"):
        nnterp.long_context_profile(model, ids, chunk_size=5, progress=False)
    with pytest.raises(Unavailable, match="memory_at=\\[\\]"):
        nnterp.long_context_profile(model, ids, chunk_size=12, memory_at=[5], progress=False)


def test_bad_inputs_raise_the_taxonomys_errors_naming_the_fix(load):
    model = load("qwen3_5_text")
    ids = _ids(model, 8)
    attention = next(i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is None)
    cases = [
        (dict(ids=ids[None].expand(2, -1)), InvalidArgument, r"\[seq\] or \[1, seq\].*one sequence per call"),
        (dict(ids=torch.zeros(2, 3, 4, dtype=torch.long)), InvalidArgument, "one sequence per call"),
        (dict(ids=ids.float()), InvalidArgument, "integers"),
        (dict(ids="some text"), WrongType, "tokenizer"),
        (dict(ids=ids[:0]), EmptyPrompt, "no tokens"),
        (dict(ids=ids, chunk_size=0), InvalidArgument, "chunk_size is a positive int"),
        (dict(ids=ids, chunk_size=2.5), InvalidArgument, "chunk_size is a positive int"),
        (dict(ids=ids, every=0), InvalidArgument, "every is a positive int"),
        (dict(ids=ids, layers=[attention]), InvalidArgument, f"layer\\(s\\) \\[{attention}\\].*no recurrent mixer; pass some of"),
        (dict(ids=ids, layers=[99]), PositionError, ""),
        (dict(ids=ids, memory_at=[8]), InvalidArgument, "memory_at holds positions"),
        (dict(ids=ids, lags=[-1]), InvalidArgument, "lags are distances"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            nnterp.long_context_profile(model, progress=False, **kwargs)
    with pytest.raises(InvalidArgument, match="no recurrent mixer on any layer"):
        nnterp.long_context_profile(load("llama"), ids, progress=False)
    every_layer_linear = StandardizedTransformer(str(toy_checkpoint("deltanet")), dispatch=True, device="cpu")
    with pytest.raises(Unavailable, match="continues the cache.*cannot run such a model with a cache"):
        nnterp.long_context_profile(every_layer_linear, ids, chunk_size=4, progress=False)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Carry):  # what a chunk hands the next (its cache is the model's own object)
        yield from _tensors(vars(value))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


@pytest.mark.parametrize("model_type", ["rwkv", "mamba"])  # the cache carries the state; nnterp writes it
def test_a_long_sequence_runs_in_small_chunks_holding_a_chunk_and_the_profiles_rows(model_type, load, monkeypatch):
    """16k tokens on a recurrent-only model in chunks of 512: after every chunk, each tensor the run holds (the
    cache, the states carried to the next chunk, the rows kept so far, the pending probes) has no axis longer than
    a chunk, and the rows kept add up to the output's (``n / every`` per layer), never the sequence's."""
    from nnterp.long_context import ProfileRun

    model = load(model_type)
    n, every, chunk_size = 16384, 64, 512
    held: list[tuple[int, int]] = []
    original = ProfileRun.chunk

    def chunk(run, start, end):
        original(run, start, end)
        tensors = list(_tensors(vars(run)))
        rows = sum(part.shape[0] for parts in run.norms.values() for part in parts)
        held.append((max(max(t.shape, default=0) for t in tensors if t is not run.ids), rows))

    monkeypatch.setattr(ProfileRun, "chunk", chunk)
    profile = nnterp.long_context_profile(model, _ids(model, n), chunk_size=chunk_size, every=every, memory_at=[n - 1], lags=[0, 8], progress=False)
    layers = len(profile.state_norm)
    assert len(held) >= n // chunk_size
    assert max(longest for longest, _ in held) <= chunk_size  # the vocabulary of the tiny model is smaller than a chunk
    assert held[-1][1] == layers * n // every
    for layer in profile.state_norm:
        assert profile.state_norm[layer].shape[0] == n // every and profile.decay[layer].shape[0] == n // every
        assert torch.isfinite(profile.state_norm[layer]).all()
    assert torch.isfinite(profile.memory_all).all()


def test_the_plot_draws_one_layer(load):
    pytest.importorskip("matplotlib")
    model = load("rwkv")
    profile = nnterp.long_context_profile(model, _ids(model, 16), chunk_size=5, memory_at=[15], lags=[0, 2, 8], progress=False)
    figure = profile.plot()
    assert len(figure.axes) == 3 and figure.axes[2].get_lines()


def test_the_benchmark_page_keeps_the_long_context_section(tmp_path):
    """`benchmarks/long_context.py` replaces its own section in place, and `benchmarks/run.py` keeps it when it
    rewrites the page without one."""
    from benchmarks import long_context, run

    rows = [{"length": 4096, "loaded_kib": 1000, "peak_kib": 1024, "seconds": 1.0, "layers": 2},
            {"length": 8192, "loaded_kib": 1000, "peak_kib": 1200, "seconds": 2.0, "layers": 2}]
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nintro\n\n" + long_context.BEGIN + "\nold\n" + long_context.END + "\n\n## After\n")
    page.write_text(long_context.with_section(page.read_text(), long_context.render(rows, 2048)))
    text = page.read_text()
    assert "old" not in text and text.count(long_context.BEGIN) == 1 and text.index("## After") > text.index(long_context.END)
    assert "| 1.172 |" in text and "8,192 tokens ≤ 1.1x the peak at 4,096: 1.172x, missed" in text  # 1200 / 1024
    run.write(str(page), "# Performance\n\nrewritten\n")
    kept = page.read_text()
    assert "rewritten" in kept and long_context.SECTION.search(kept).group(0) == long_context.SECTION.search(text).group(0)
