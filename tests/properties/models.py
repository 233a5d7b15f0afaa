"""Tiny models of the recurrent families at varied sizes, built once per process, and the checks the property tests share.

`build(model_type, variant)` makes a config with `Family.tiny_config` (the
tokenizer's vocabulary and special ids, as `nnterp.testing` passes them), changes
its sizes (`VARIANTS`, per mixer kind: heads, groups, state sizes, chunk sizes), saves a seeded,
sharpened random init with ``save_pretrained`` into a temporary folder and loads
it twice: as a user does (``StandardizedTransformer(path, dispatch=True)``) and as
a plain transformers model, the oracles' side (tests/reference/hf_oracles.py).
Models are cached by ``(model_type, variant)``, so a run builds at most one per
variant however many examples hypothesis draws.

`STRATEGIES_OF` says how each kind serves the state after every token: routed
(``route_kernels(family, "torch")``), fast (``fast_states(model)``), Mamba-2's
chunk boundaries (``chunk_per_token(model)``), or Mamba-1's own token loop
(``default``, served without routing). `serving` enters one.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import nnterp
from nnterp import StandardizedTransformer
from nnterp.families import REGISTRY, families
from nnterp.testing import tiny_tokenizer
from nnterp.testing.checkpoints import _build_model, _tokens

#: Recurrent kinds these property tests do not draw, and why; each is covered by its own suite.
NOT_COVERED = {
    "RGLRU": (
        "RecurrentGemma keeps its state on its modules, not in the cache object tests/reference/hf_oracles.py reads, "
        "and transformers mixes left padding into its rows (Family.PADDING_DIFFERS): tests/components/test_rg_lru.py tests it "
        "against its own oracles (tests/reference/rg_lru.py)"
    ),
}


def _kinds() -> dict[str, str]:
    """``{mixer component name: model_type}``: each recurrent mixer by the family that introduces it."""
    found = {}
    for family in families():
        mixer, parent = family.MIXER, getattr(family.__mro__[1], "MIXER", None)
        if mixer is not None and mixer is not parent and mixer.__name__ not in NOT_COVERED:
            found[mixer.__name__] = family.NAME
    return found


#: The recurrent kinds under test, ``{component: model_type}``: the gated DeltaNet (`LinearAttention`, Qwen3.5),
#: Kimi delta attention, Mamba-1 (`SelectiveScan`), Mamba-2 (`StateSpace`).
KINDS = _kinds()

#: Size changes from each kind's tiny config; the first is the tiny config itself.
VARIANTS: dict[str, tuple[dict, ...]] = {
    "LinearAttention": (
        {},
        # one key head shared by three value heads, value dim above key dim
        dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=12),
        dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=2),
    ),
    "KimiDeltaAttention": (
        {},
        dict(linear_num_heads=2, linear_head_dim=8),
        dict(linear_num_heads=1, linear_head_dim=32, linear_conv_kernel_dim=2),
    ),
    "SelectiveScan": (
        {},
        dict(state_size=4, expand=1, conv_kernel=2),
        dict(state_size=16, time_step_rank=4),
    ),
    "StateSpace": (
        {},  # 4 heads of 32, one group, state 16, chunks of 8
        dict(num_heads=8, head_dim=16, n_groups=2, state_size=8, chunk_size=4),
        dict(num_heads=2, head_dim=64, n_groups=2, state_size=4, chunk_size=3, conv_kernel=2),
    ),
    "LightningAttention": (
        {},  # 4 heads of 16, blocks of 4
        dict(num_attention_heads=2, head_dim=8, block_size=3),
        dict(num_attention_heads=8, head_dim=4, block_size=1),
    ),
}

#: How each kind serves ``states`` / ``state_after`` / ``set_state_after``.
STRATEGIES_OF: dict[str, tuple[str, ...]] = {
    "LinearAttention": ("routed", "fast"),
    "KimiDeltaAttention": ("routed", "fast"),
    "SelectiveScan": ("default", "routed", "fast"),
    "StateSpace": ("chunks", "fast", "routed+chunks"),
    "LightningAttention": ("default",),  # computed from the call's q, k, v and decays, with no setting
}


#: The model types the property tests run: the kinds with sizes above. A kind not listed there (RWKV's `WKV`,
#: whose model keeps no cache object and ignores padding, which these oracles and batches assume) is tested by
#: its own suite only.
MODEL_TYPES = tuple(model_type for name, model_type in KINDS.items() if name in VARIANTS)


def kind(model_type: str) -> str:
    return REGISTRY[model_type].MIXER.__name__


def variants_of(model_type: str) -> tuple[dict, ...]:
    return VARIANTS[kind(model_type)]


def strategies(model_type: str) -> tuple[str, ...]:
    return STRATEGIES_OF[kind(model_type)]


CASES = [(model_type, strategy) for model_type in MODEL_TYPES for strategy in strategies(model_type)]


def chunk(model_type: str, variant: int) -> int:
    """The length of one chunk of the family's chunked prompt kernel (Mamba-2: the config's; the DeltaNets: 64)."""
    return {**REGISTRY[model_type].tiny_sizes(), **variants_of(model_type)[variant]}.get("chunk_size", 64)


@dataclass
class Built:
    model: StandardizedTransformer
    plain: torch.nn.Module
    path: Path


_ROOT: Path | None = None
_BUILT: dict[tuple[str, int], Built] = {}


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="nnterp-properties-"))
        atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    return _ROOT


def config(model_type: str, variant: int = 0):
    """The family's tiny config with `variants_of(model_type)[variant]`'s sizes (validated by the config class)."""
    tiny = REGISTRY[model_type].tiny_config(model_type, **_tokens())
    changes = variants_of(model_type)[variant]
    return type(tiny).from_dict({**tiny.to_dict(), **changes}) if changes else tiny


def build(model_type: str, variant: int = 0) -> Built:
    """The standardized and the plain model of one variant, built and saved once per process."""
    key = (model_type, variant)
    if key not in _BUILT:
        path = _root() / f"{model_type}-{variant}"
        _build_model(config(model_type, variant)).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        model = StandardizedTransformer(str(path), dispatch=True, device="cpu")
        plain = AutoModelForCausalLM.from_pretrained(path).eval()
        _BUILT[key] = Built(model, plain, path)
    return _BUILT[key]


@contextlib.contextmanager
def serving(model: StandardizedTransformer, strategy: str):
    """Serve the per-token states the way ``strategy`` names (see `STRATEGIES_OF`), undone on exit."""
    with contextlib.ExitStack() as stack:
        if "routed" in strategy:
            stack.enter_context(nnterp.route_kernels(model.family, "torch"))
        if "fast" in strategy:
            stack.enter_context(nnterp.fast_states(model))
        if "chunks" in strategy:
            stack.enter_context(nnterp.chunk_per_token(model))
        yield model


def recurrent_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if layer.linear_attn is not None]


def batch(model, rows: list[list[int]]) -> dict:
    """``rows`` (token ids of different lengths) left-padded with the pad id, as a tokenizer pads them, and their mask."""
    width = max(len(row) for row in rows)
    pad = model.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return {"input_ids": ids, "attention_mask": mask}


# -- invariants -----------------------------------------------------------------------------


def weights_hash(model) -> str:
    """A hash of every parameter and buffer of the model (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    module = model._module
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def kernel_names(family) -> tuple[str, ...]:
    mixer = family.MIXER
    # Lightning attention names none: it computes in its own forward.
    return tuple(name for name in (mixer.CHUNK_FUNCTION, mixer.RECURRENT_FUNCTION, *mixer.CONV_FUNCTIONS) if name)


def bindings(family) -> dict:
    """What the family's modeling module binds each kernel name to now."""
    return {name: family.MODELING.__dict__.get(name) for name in kernel_names(family)}


def snapshot(model) -> dict:
    """Everything a trace must leave as it found it: weights, config, kernel bindings."""
    return {
        "weights": weights_hash(model),
        "config": model._module.config.to_dict(),
        "bindings": bindings(model.family),
    }


def assert_unchanged(model, before: dict, when: str) -> None:
    after = snapshot(model)
    assert after["weights"] == before["weights"], f"{when}: the weights changed"
    assert after["config"] == before["config"], f"{when}: the config changed: " + str(
        {k: (before["config"].get(k), v) for k, v in after["config"].items() if before["config"].get(k) != v}
    )
    changed = [name for name, fn in after["bindings"].items() if fn is not before["bindings"][name]]
    assert not changed, f"{when}: {model.family.NAME}'s kernel bindings changed: {changed}"
