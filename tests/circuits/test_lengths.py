"""`nnterp.circuits` on prompt pairs of different lengths (`nnterp.circuits.pairs`).

Oracles: the calls on each length apart (a mixed dataset's scores are the pair-weighted average of the runs of
each length; a mixed batch's patches and faithfulness are each pair's own run), and plain transformers forwards
(no edge patched is each clean prompt's forward, every edge its corrupt prompt's).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnterp import ShapeError, circuits
from nnterp.circuits.pairs import group_pairs
from nnterp.components.gated_deltanet import LinearAttention
from nnterp.recurrent.no_cache import run_kwargs

from .kinds import BY_KIND, PLAIN

HYBRID = BY_KIND[LinearAttention]
LENGTHS = [5, 7, 5, 6, 7, 5]


def _dataset(seed: int = 0) -> tuple:
    """Pairs of the lengths ``LENGTHS`` as lists of token ids (each pair's corrupt differs at two tokens), and a
    token pair per prompt pair for the logit difference."""
    generator = torch.Generator().manual_seed(seed)
    clean, corrupt = [], []
    for length in LENGTHS:
        row = torch.randint(3, 200, (length,), generator=generator)
        other = row.clone()
        other[[1, length - 2]] = torch.randint(3, 200, (2,), generator=generator)
        clean.append(row.tolist())
        corrupt.append(other.tolist())
    good, bad = torch.randint(3, 200, (len(LENGTHS),), generator=generator), torch.randint(3, 200, (len(LENGTHS),), generator=generator)
    return clean, corrupt, good, bad


def _by_length(clean: list, corrupt: list) -> dict:
    """``{length: (indices, clean [k, length], corrupt [k, length])}``, built here from the lists."""
    out = {}
    for length in sorted(set(LENGTHS)):
        index = [i for i, row in enumerate(clean) if len(row) == length]
        out[length] = (torch.tensor(index), torch.tensor([clean[i] for i in index]), torch.tensor([corrupt[i] for i in index]))
    return out


@pytest.mark.parametrize("model_type, method", [(PLAIN, "eap"), (HYBRID, "eap"), (HYBRID, "eap-ig")])
def test_mixed_lengths_score_as_the_pair_weighted_average_of_each_length(model_type, method, load):
    model = load(model_type)
    clean, corrupt, good, bad = _dataset()
    mixed = circuits.edge_attribution(model, clean, corrupt, circuits.logit_difference(good, bad), method=method, batch_size=2, progress=False)
    scores, clean_value, corrupt_value = 0, 0.0, 0.0
    for index, clean_ids, corrupt_ids in _by_length(clean, corrupt).values():
        alone = circuits.edge_attribution(model, clean_ids, corrupt_ids, circuits.logit_difference(good[index], bad[index]), method=method, progress=False)
        share = len(index) / len(LENGTHS)
        scores, clean_value, corrupt_value = scores + share * alone.scores, clean_value + share * alone.clean, corrupt_value + share * alone.corrupt
    torch.testing.assert_close(mixed.scores, scores, atol=1e-5, rtol=1e-4)
    assert mixed.clean == pytest.approx(clean_value, abs=1e-5) and mixed.corrupt == pytest.approx(corrupt_value, abs=1e-5)
    assert mixed.scores.abs().max() > 1e-2 and mixed.seq is None


@pytest.mark.parametrize("model_type", [PLAIN, HYBRID])
def test_a_mixed_batch_patches_as_each_pair_alone_and_as_the_plain_forwards(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    clean, corrupt, _, _ = _dataset(1)
    graph = circuits.node_map(model)
    none, every = circuits.patch_edges(model, clean, corrupt, []), circuits.patch_edges(model, clean, corrupt, graph.edges)
    chosen = graph.edges[::4]
    some = circuits.patch_edges(model, clean, corrupt, chosen)
    assert isinstance(some, list) and [row.shape[0] for row in some] == LENGTHS
    kwargs = run_kwargs(model)
    for i, (a, b) in enumerate(zip(clean, corrupt)):
        with torch.no_grad():
            want_clean, want_corrupt = plain(torch.tensor([a]), **kwargs).logits[0], plain(torch.tensor([b]), **kwargs).logits[0]
        torch.testing.assert_close(none[i], want_clean, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(every[i], want_corrupt, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(some[i], circuits.patch_edges(model, [a], [b], chosen)[0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(some[i], none[i], atol=1e-3)
    # Mean ablation: each clean prompt takes the mean over the corrupt prompts of its own length.
    mean = circuits.patch_edges(model, clean, corrupt, chosen, ablation="mean")
    for index, clean_ids, corrupt_ids in _by_length(clean, corrupt).values():
        alone = circuits.patch_edges(model, clean_ids, corrupt_ids, chosen, ablation="mean")
        torch.testing.assert_close(torch.stack([mean[i] for i in index.tolist()]), alone, atol=1e-5, rtol=1e-5)
    # ... so where the corrupt prompts of each length are copies of one, the mean is each pair's own corrupt prompt.
    first = {len(row): row for row in reversed(corrupt)}
    same = [first[len(row)] for row in clean]
    copies, paired = circuits.patch_edges(model, clean, same, chosen, ablation="mean"), circuits.patch_edges(model, clean, same, chosen)
    for i in range(len(clean)):
        torch.testing.assert_close(copies[i], paired[i], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mean[0], paired[0], atol=1e-3)


@pytest.mark.parametrize("model_type", [PLAIN, HYBRID])
def test_faithfulness_on_mixed_lengths_is_the_average_of_each_pair_and_each_length(model_type, load, plains):
    model, plain = load(model_type), plains(model_type)
    clean, corrupt, good, bad = _dataset(2)
    metric = circuits.logit_difference(good, bad)
    graph = circuits.edge_attribution(model, clean, corrupt, metric, progress=False)
    circuit = graph.circuit(fraction=0.2)
    mixed = circuits.faithfulness(model, circuit, clean, corrupt, metric, batch_size=2)
    kwargs, want = run_kwargs(model), {"clean": 0.0, "empty": 0.0, "circuit": 0.0}
    for i, (a, b) in enumerate(zip(clean, corrupt)):
        one = circuits.faithfulness(model, circuit, [a], [b], circuits.logit_difference(good[i], bad[i]))
        with torch.no_grad():
            plain_clean = float(metric(plain(torch.tensor([a]), **kwargs).logits, torch.tensor([i]))[0])
            plain_corrupt = float(metric(plain(torch.tensor([b]), **kwargs).logits, torch.tensor([i]))[0])
        assert one.clean == pytest.approx(plain_clean, abs=1e-4) and one.empty == pytest.approx(plain_corrupt, abs=1e-4)
        for key in want:
            want[key] += getattr(one, key) / len(LENGTHS)
    assert (mixed.clean, mixed.empty, mixed.circuit) == pytest.approx((want["clean"], want["empty"], want["circuit"]), abs=1e-5)
    assert abs(mixed.circuit - mixed.clean) > 1e-3 and abs(mixed.circuit - mixed.empty) > 1e-3  # the circuit is neither end
    # Mean ablation: the pair-weighted average of each length's own run.
    mean = circuits.faithfulness(model, circuit, clean, corrupt, metric, ablation="mean")
    want = {"clean": 0.0, "empty": 0.0, "circuit": 0.0}
    for index, clean_ids, corrupt_ids in _by_length(clean, corrupt).values():
        alone = circuits.faithfulness(model, circuit, clean_ids, corrupt_ids, circuits.logit_difference(good[index], bad[index]), ablation="mean")
        for key in want:
            want[key] += getattr(alone, key) * len(index) / len(LENGTHS)
    assert (mean.clean, mean.empty, mean.circuit) == pytest.approx((want["clean"], want["empty"], want["circuit"]), abs=1e-5)
    curve = circuits.faithfulness_curve(model, graph, clean, corrupt, metric, fractions=(0.0, 0.2, 1.0), progress=False)
    assert curve.recovered == pytest.approx([0.0, mixed.recovered, 1.0], abs=1e-5)


def test_strings_of_different_lengths_run_and_a_pair_of_two_lengths_says_what_to_pass(load, eager_models):
    model = load(HYBRID)
    clean, corrupt = ["a b c d e f", "x y"], ["a b d d e f", "y y"]
    graph = circuits.edge_attribution(model, clean, corrupt, circuits.logit_difference(5, 7), progress=False)
    ids = [model.tokenizer(p).input_ids for p in clean + corrupt]
    alone = circuits.edge_attribution(model, ids[:2], ids[2:], circuits.logit_difference(5, 7), progress=False)
    assert len(ids[0]) == len(ids[2]) != len(ids[1]) == len(ids[3])
    torch.testing.assert_close(graph.scores, alone.scores)
    assert [row.shape[0] for row in circuits.patch_edges(model, clean, corrupt, [])] == [len(row) for row in ids[:2]]
    metric = circuits.logit_difference(5, 7)
    with pytest.raises(ValueError, match="pair 0: the clean prompt is 2 tokens long and the corrupt one 6.*pairs of prompts of one length"):
        circuits.edge_attribution(model, clean[::-1], corrupt, metric, progress=False)
    with pytest.raises(ShapeError, match="pair 0"):
        circuits.faithfulness(model, graph.circuit(k=3), [[5, 6, 7]], [[5, 6]], metric)
    with pytest.raises(ShapeError, match="no corrupt prompt is 3 tokens long"):
        circuits.patch_edges(model, [[5, 6, 7], [5, 6]], [[5, 7]], [], ablation="mean")
    # Positional edges name positions of one length: mixed lengths raise with the fix.
    eager = eager_models(HYBRID)
    with pytest.raises(ShapeError, match="one call per length"):
        circuits.edge_attribution(eager, clean, corrupt, metric, positional=True, progress=False)
    split = circuits.edge_attribution(eager, clean[:1], corrupt[:1], metric, positional=True, progress=False)
    with pytest.raises(ShapeError, match="one call per length"):
        circuits.patch_edges(eager, clean, corrupt, [split.edges[-2]])
    with pytest.raises(ShapeError, match="prompts of 6 tokens"):
        circuits.faithfulness(eager, split.circuit(k=2), clean[1:], corrupt[1:], metric)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=9), st.integers(1, 4))
def test_the_groups_partition_the_pairs_by_length_in_order(lengths, size):
    rows = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
    groups = group_pairs(None, rows, [[x + 1 for x in row] for row in rows])
    assert sorted(i for group in groups for i in group.pairs.tolist()) == list(range(len(rows)))
    assert [group.seq for group in groups] == sorted(set(lengths))
    for group in groups:
        for pairs, clean, corrupt in group.batches(size):
            assert len(pairs) <= size and pairs.tolist() == sorted(pairs.tolist())
            assert clean.tolist() == [rows[i] for i in pairs.tolist()] and (corrupt - clean).eq(1).all()
