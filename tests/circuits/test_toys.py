"""Circuits on the trained toys: a small circuit recovers the recall, and its retrieving edge is where knockout finds it.

Oracles: each sample's own ground truth (the queried pair's positions, the answer), the plain metric on the
clean and corrupt prompts (faithfulness is measured by running the circuit, not by its scores), and
`nnterp.knockout_sweep`, a different intervention (one (layer, source) term of the effective attention removed).
"""

from __future__ import annotations

import random

import pytest
import torch

import nnterp
from nnterp import StandardizedTransformer, circuits
from nnterp.recurrent.no_cache import run_kwargs
from nnterp.testing import recall, toy_checkpoint, toy_task

PAIRS, QUERIED, SAMPLES = 6, 2, 8


@pytest.fixture(scope="module")
def toys():
    cache: dict = {}

    def get(name):
        if name not in cache:
            cache[name] = StandardizedTransformer(str(toy_checkpoint(name)), dispatch=True, device="cpu", enable_attention_probs=True)
        return cache[name]

    return get


def _recall(model, name: str, seed: int = 0):
    """Samples asking for the same pair (so positions align), the same prompts with that value changed, and the
    metric logit(clean answer) − logit(corrupt answer)."""
    task, rng = toy_task(name), random.Random(seed)
    samples = [task.sample(rng, n_pairs=PAIRS, queried=QUERIED) for _ in range(SAMPLES)]
    corrupt = [recall.corrupt_value(sample, rng) for sample in samples]
    good = recall.answer_ids(model, samples)
    bad = torch.tensor(model.tokenizer.convert_tokens_to_ids([value for _, value in corrupt]))
    return samples, [s.prompt for s in samples], [prompt for prompt, _ in corrupt], circuits.logit_difference(good, bad)


@pytest.mark.parametrize("name, layer", [("hybrid", 0), ("deltanet", 1)])
def test_a_tenth_of_the_positional_edges_recovers_the_recall_and_its_top_edge_is_the_knockouts_cell(name, layer, toys):
    model = toys(name)
    samples, clean, corrupt, metric = _recall(model, name)
    graph = circuits.edge_attribution(model, clean, corrupt, metric, positional=True, method="eap-ig", steps=5, progress=False)
    assert graph.clean > 5 and graph.corrupt < -5  # the toy recalls; the changed value flips it
    result = circuits.faithfulness(model, graph.circuit(fraction=0.1), clean, corrupt, metric)
    print(f"{name}: {result.edges} of {len(graph.edges)} edges recover {result.recovered:.3f}")
    assert result.edges <= 0.1 * len(graph.edges) and result.recovered >= 0.9
    # The retrieving edge: the head edge of largest score, a recurrent head's term of key + 2 (the next pair's key,
    # where the width-4 convolution brings key and value to the recurrence together).
    heads = graph.nodes.heads_of()
    source, _, position, _ = next(edge for edge in graph.top(k=len(graph.edges)) if edge[0] in heads)
    key = samples[0].key_positions[QUERIED]
    assert (graph.nodes.layers[source], position) == (layer, key + 2)
    agree = 0
    for sample in samples:
        answer = model.tokenizer.convert_tokens_to_ids(sample.answer)
        sweep = nnterp.knockout_sweep(model, sample.prompt, lambda logits, answer=answer: logits[-1].softmax(-1)[answer], progress=False, **run_kwargs(model))
        row, column = divmod(int(sweep.effects.argmin()), len(sweep.positions))
        agree += (sweep.layers[row], sweep.positions[column]) == (layer, key + 2)
    print(f"{name}: knockout's top cell is the circuit's in {agree} of {len(samples)} samples")
    assert agree >= 0.75 * len(samples)
