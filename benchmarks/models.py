"""The benchmark's model configs: one medium random-weight model per recurrent mixer kind (tiny ones for the smoke test).

Medium sizes follow each kind's published checkpoint where it matters to the
per-token states' cost (head count and head sizes, the state's layout),
shrunk to a hidden size of 768-1024 and 4 blocks; the hybrids keep their
softmax block (3 recurrent blocks, then 1 attention block). The tiny configs
of the kinds added after the first three are their families' own
(`Family.tiny_config`, the test suite's).

`FIRST` names the kinds measured from 512 tokens only (the run's shorter
lengths are left out) and `REPS` those measured with fewer repeats, to keep
the whole run's wall time in bounds (the six kinds after the first three add
about 10 minutes on 2 CPU cores); a longer length whose plain forward is
projected past ``--max-forward-s`` is skipped by the runner and noted on the
page (Kimi delta attention at 2048 tokens: transformers' pure-torch chunked
kernel takes ~22 s per forward there).
"""

from __future__ import annotations

#: Every recurrent mixer kind the runner times, in the page's order: the first three as the page always named them,
#: the others by their nnterp component's file (`nnterp/components/<kind>.py`); each is one medium model (`configs`).
FAMILIES = ("gated_deltanet", "mamba", "mamba2", "kimi_delta_attention", "lightning_attention", "rg_lru", "wkv", "mlstm", "short_convolution")
#: Kinds timed from this length on in a full run (tiny runs time every length given).
FIRST = {name: 512 for name in FAMILIES[3:]}
#: Kinds timed with at most this many repeats at every length and of `generate` in a full run (the run's own otherwise).
REPS = {name: 3 for name in FAMILIES[3:]}


def lengths_for(name: str, lengths: list, tiny: bool) -> list:
    """The prompt lengths ``name`` is timed at: the run's, from `FIRST` on (all of them when that leaves none, or tiny)."""
    if tiny or name not in FIRST:
        return list(lengths)
    return [length for length in lengths if length >= FIRST[name]] or list(lengths)


def reps_for(name: str, reps: int, tiny: bool) -> int:
    """The repeats ``name`` runs where the run asks for ``reps`` (`REPS`' bound in a full run)."""
    return reps if tiny else min(reps, REPS.get(name, reps))


def configs(tiny: bool) -> dict:
    """``{name: config}`` for every kind in `FAMILIES`."""
    from nnterp.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id  # `cases.build` sets the same ids; given here, the config classes do not warn
    tokens = dict(vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    return _tiny(tokens) if tiny else _medium(tokens)


def _tiny(tokens: dict) -> dict:
    from transformers import Mamba2Config, MambaConfig, Qwen3_5TextConfig

    from nnterp.testing import tiny_config

    found = {
        "gated_deltanet": Qwen3_5TextConfig(**tokens, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        "mamba": MambaConfig(**tokens, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2),
        "mamba2": Mamba2Config(**tokens, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16, n_groups=1, chunk_size=8, expand=2),
    }
    # The added kinds' tiny configs are their families' own: the family of the medium config's model_type.
    found.update({name: tiny_config(type(config).model_type) for name, config in _medium(tokens).items() if name not in found})
    return found


def _medium(tokens: dict) -> dict:
    from transformers import (
        KimiLinearConfig,
        Lfm2Config,
        Mamba2Config,
        MambaConfig,
        MiniMaxConfig,
        Qwen3_5TextConfig,
        RecurrentGemmaConfig,
        RwkvConfig,
        xLSTMConfig,
    )

    from nnterp.families.lfm2 import layer_types as lfm2_layer_types

    hybrid = ["linear_attention"] * 3 + ["full_attention"]
    alpha = 3.5565588200778455  # MiniMax-Text-01's residual scale
    return {
        # Qwen3.5-0.8B's linear attention: 16 key heads and 16 value heads of 128; hidden 1024; 3 DeltaNet blocks per attention block.
        "gated_deltanet": Qwen3_5TextConfig(**tokens, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, layer_types=hybrid, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256),
        "mamba": MambaConfig(**tokens, hidden_size=768, num_hidden_layers=4, state_size=16, expand=2),
        "mamba2": Mamba2Config(**tokens, hidden_size=768, num_hidden_layers=4, num_heads=24, head_dim=64, state_size=128, n_groups=1, chunk_size=256, expand=2),
        # Kimi-Linear-48B-A3B's delta attention heads (128 wide; 32 of them at hidden 2304) and MLA shapes, at the DeltaNet's
        # 16 heads and hidden 1024; dense MLPs (the page times the mixers; the released model's are sparse from block 1).
        "kimi_delta_attention": KimiLinearConfig(**tokens, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, layer_types=hybrid, mlp_layer_types=["dense"] * 4, linear_num_heads=16, linear_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
        # MiniMax-Text-01's heads of 128 (64 of them at hidden 6144) and residual scales; 4 experts, 2 per token (32 released).
        "lightning_attention": MiniMaxConfig(**tokens, hidden_size=1024, intermediate_size=1536, num_hidden_layers=4, layer_types=hybrid, num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_local_experts=4, num_experts_per_tok=2, block_size=256, full_attn_alpha_factor=alpha, linear_attn_alpha_factor=alpha, mlp_alpha_factor=alpha),
        # recurrentgemma-2b's block order (recurrent, recurrent, attention), heads of 256, one key/value head, window 2048.
        "rg_lru": RecurrentGemmaConfig(**tokens, hidden_size=1024, lru_width=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, attention_window_size=2048, conv1d_width=4, block_types=["recurrent", "recurrent", "attention"]),
        # rwkv-4-169m-pile's width (768, MLP 3072), 4 of its 12 blocks; a context of 2048 for the longest prompt.
        "wkv": RwkvConfig(**tokens, hidden_size=768, attention_hidden_size=768, intermediate_size=3072, num_hidden_layers=4, context_length=2048, rescale_every=6),
        # xLSTM-7b's 8 heads and key:value factors (0.5, 1.0) at hidden 1024 (heads of 64 and 128: the released state's
        # share of a block's weights), its chunk of 64.
        "mlstm": xLSTMConfig(**tokens, hidden_size=1024, num_hidden_layers=4, num_heads=8, qk_dim_factor=0.5, v_dim_factor=1.0, chunk_size=64),
        # LFM2-350M's sizes (hidden 1024, 16 query and 8 key/value heads, MLP 6656 auto-adjusted, window 3), its first 4 blocks
        # (attention at block 2).
        "short_convolution": Lfm2Config(**tokens, hidden_size=1024, num_hidden_layers=4, layer_types=lfm2_layer_types(4, [2]), num_attention_heads=16, num_key_value_heads=8, intermediate_size=6656, conv_L_cache=3),
    }
