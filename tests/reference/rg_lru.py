"""The RG-LRU written from the Griffin paper (arXiv:2402.19427, section 2.4), and oracles on a plain RecurrentGemma.

Independent of nnterp and of transformers' module: the recurrence from its
equation (``c = 8``, HF's ``recurrent_param`` is Λ with ``a = σ(-Λ)``)

    r_t = σ(W_a x_t + b_a),  i_t = σ(W_x x_t + b_x)     (block-diagonal: one block per head)
    a_t = σ(-Λ)^{c r_t}
    h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t)   (h_t = i_t ⊙ x_t at a reset, position 0)

The oracles drive transformers' ``RecurrentGemmaForCausalLM`` by its own
forward, reading and writing the state it keeps on its modules
(``temporal_block.rg_lru.recurrent_states``, ``temporal_block.conv1d_state``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from tests.reference.hf_oracles import cache_kwarg

C = 8.0


def block_diagonal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x W + b`` per head's block of channels: ``x [b, s, heads*width]``, ``weight [heads, width, width]``."""
    b, s, _ = x.shape
    heads, width, _ = weight.shape
    blocks = x.reshape(b, s, heads, width)
    return (torch.einsum("bshi,hij->bshj", blocks, weight) + bias).reshape(b, s, heads * width)


def gates(x: torch.Tensor, lru: torch.nn.Module) -> dict:
    """The paper's gates of the RG-LRU ``lru`` (its parameters only) on input ``x [b, s, width]``."""
    r = torch.sigmoid(block_diagonal(x, lru.recurrent_gate_weight, lru.recurrent_gate_bias))
    i = torch.sigmoid(block_diagonal(x, lru.input_gate_weight, lru.input_gate_bias))
    log_a = C * r * torch.nn.functional.logsigmoid(-lru.recurrent_param)  # log σ(-Λ)^{c r}
    return {"r": r, "i": i, "log_a": log_a, "a": torch.exp(log_a)}


def scan(u: torch.Tensor, a: torch.Tensor, reset: torch.Tensor, initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """``h_t = ã_t h_{t-1} + u_t`` (``ã_t = 0`` where ``reset``), float32: the state after every token ``[b, s, width]``."""
    h = torch.zeros_like(u[:, 0], dtype=torch.float32) if initial_state is None else initial_state.float()
    out = []
    for t in range(u.shape[1]):
        h = torch.where(reset[:, t], 0.0, a[:, t].float()) * h + u[:, t].float()
        out.append(h)
    return torch.stack(out, 1)


def rg_lru(x: torch.Tensor, lru: torch.nn.Module, positions: torch.Tensor, initial_state: torch.Tensor | None = None) -> tuple:
    """``(states [b, s, width], gates with "u")``: the RG-LRU on ``x`` at ``positions [b, s]`` (reset at 0)."""
    g = gates(x.float(), lru)
    reset = (positions == 0)[..., None]
    norm = torch.where(reset, 1.0, torch.sqrt(1 - g["a"] ** 2))
    g["u"] = norm * g["i"] * x.float()
    return scan(g["u"], g["a"], reset, initial_state), g


# -- oracles on a plain model ---------------------------------------------------------


def block(model, layer: int):
    return model.model.layers[layer].temporal_block


@torch.no_grad()
def prefix_states(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The state the model keeps after each prefix ``ids[:, :t+1]``, ``[b, s, width]``: a plain forward per prefix."""
    out = []
    for t in range(ids.shape[1]):
        model(ids[:, : t + 1], use_cache=True)
        out.append(block(model, layer).rg_lru.recurrent_states.clone())
    return torch.stack(out, 1)


@torch.no_grad()
def prefill(model, ids: torch.Tensor):
    """A plain forward over ``ids`` with a cache: ``(logits, cache)``; the state stays on the modules."""
    cache = DynamicCache(config=model.config)
    model._setup_cache(model.config, ids.shape[0], ids.device, torch.float32)
    out = model(ids, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits, cache


@torch.no_grad()
def step(model, token: torch.Tensor, position: int, cache) -> torch.Tensor:
    """One decode step of ``token [b, 1]`` at ``position``: its logits ``[b, vocab]``."""
    positions = torch.full_like(token, position)
    return model(token, use_cache=True, position_ids=positions, **{cache_kwarg(model): cache}).logits[:, -1]


@torch.no_grad()
def continue_from_state(model, ids: torch.Tensor, T: int, layer: int, state: torch.Tensor) -> torch.Tensor:
    """Run ``ids[:, :T+1]``, replace layer ``layer``'s state by ``state``, feed the rest one token at a time: last logits."""
    logits, cache = prefill(model, ids[:, : T + 1])
    block(model, layer).rg_lru.recurrent_states = state.clone()
    last = logits[:, -1]
    for t in range(T + 1, ids.shape[1]):
        last = step(model, ids[:, t : t + 1], t, cache)
    return last


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new: int, before_step: int, layer: int, state=None, window=None) -> tuple:
    """A plain greedy loop of ``new`` tokens; before decode step ``before_step`` (1 = the first), layer
    ``layer``'s state (and convolution window) are replaced. Returns ``(tokens [b, new], logits of each step)``."""
    logits, cache = prefill(model, ids)
    last, tokens, seen = logits[:, -1], [], [logits[:, -1]]
    position = ids.shape[1]
    for k in range(1, new):
        token = last.argmax(-1, keepdim=True)
        tokens.append(token)
        if k == before_step:
            if state is not None:
                block(model, layer).rg_lru.recurrent_states = state.clone()
            if window is not None:
                block(model, layer).conv1d_state = window.clone()
        last = step(model, token, position, cache)
        seen.append(last)
        position += 1
    tokens.append(last.argmax(-1, keepdim=True))
    return torch.cat(tokens, 1), seen
