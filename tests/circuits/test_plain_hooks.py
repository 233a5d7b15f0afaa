"""The plain-hook oracle is itself checked against transformers: every edge patched is the corrupt forward, none the clean one."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from nnterp.testing import tiny_checkpoint

from .plain_hooks import PlainEdges


def _pair(hf, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, hf.config.vocab_size, (2, 7), generator=generator) for _ in range(2)]


def test_every_edge_patched_is_the_corrupt_forward_and_none_the_clean_one():
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3")).eval()
    edges = PlainEdges(hf)
    clean, corrupt = _pair(hf, 0)
    with torch.no_grad():
        clean_logits, _ = edges.outputs(clean)
        corrupt_logits, corrupt_out = edges.outputs(corrupt)
        every = {v: {u for u in edges.sources() if edges.upstream(u, v)} for v in edges.destinations()}
        torch.testing.assert_close(edges.outputs(clean, every, corrupt_out)[0], corrupt_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(edges.outputs(clean, {}, corrupt_out)[0], clean_logits, rtol=0, atol=0)
        # one edge left out and the run is no longer the corrupt one (only an edge into the logits shows: every
        # part read the corrupt residual, so only the embeddings still differ from the corrupt run)
        every["logits"] = every["logits"] - {"embed"}
        assert not torch.allclose(edges.outputs(clean, every, corrupt_out)[0], corrupt_logits, rtol=1e-4, atol=1e-4)


def test_a_single_edge_changes_only_its_destination():
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3")).eval()
    edges = PlainEdges(hf)
    clean, corrupt = _pair(hf, 1)
    with torch.no_grad():
        clean_logits, clean_out = edges.outputs(clean)
        _, corrupt_out = edges.outputs(corrupt)
        # embed -> logits alone: the final norm reads clean residual + the embeddings' change, no layer sees it
        logits, out = edges.outputs(clean, {"logits": {"embed"}}, corrupt_out)
        for name in edges.sources():
            torch.testing.assert_close(out[name], clean_out[name], rtol=0, atol=0)
        residual = sum(clean_out.values()) + corrupt_out["embed"] - clean_out["embed"]
        torch.testing.assert_close(logits, hf.lm_head(hf.model.norm(residual)), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logits, clean_logits)
