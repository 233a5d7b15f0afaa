"""Benchmark row of `nnterp.circuits.edge_attribution` (issue 27): its cost per prompt pair against a forward.

    python benchmarks/circuits.py                            # the hybrid toy, 8 pairs, EAP and EAP-IG (5 steps)
    taskset -c 1 python benchmarks/circuits.py --page docs/performance.md   # the page's "Circuits" section

Mental model: `edge_attribution` runs, per batch of prompt pairs, a corrupt forward that reads every node's
output, then (EAP) a clean forward and backward, or (EAP-IG) a clean forward and ``steps`` forwards and
backwards; positional edges add the per-source terms of every head. Its time divided by the time of one plain
forward of the same clean batch is the row's ratio; divided by the number of pairs, its cost per pair.
`edge_attribution_cost` is the function the benchmark page calls: interleaved repeats (`benchmarks.timing`),
medians and the paired ``[min, max]`` of the ratio. ``--page`` replaces the page's section between the markers
`SECTION` and `END` (`benchmarks/run.py` keeps it); without it the section is printed.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.store import replace_section  # noqa: E402
from benchmarks.timing import Method, interleave, summary  # noqa: E402

SECTION = "<!-- circuits: made by benchmarks/circuits.py; do not edit by hand -->"
END = "<!-- /circuits -->"


def edge_attribution_cost(
    model: Any, clean: Any, corrupt: Any, metric: Any, *, method: str = "eap", steps: int = 5, positional: bool = False,
    batch_size: int | None = None, repeats: int = 3, log: Any = print,
) -> dict:
    """``{"row", "pairs", "forward_s", "attribution_s", "per_pair_s", "ratio", "ratio_range"}`` of one
    `edge_attribution` call against a plain forward of the clean prompts (the same batch), medians over ``repeats``."""
    from nnterp import circuits
    from nnterp.circuits.pairs import prompt_rows
    from nnterp.recurrent.no_cache import run_kwargs

    ids = torch.stack(prompt_rows(model, clean, "clean"))  # the benchmark's prompts are of one length
    run = run_kwargs(model)

    def forward() -> Any:  # the plain transformers module under the wrapper: no trace
        with torch.no_grad():
            return model._model(ids, **run).logits

    def attribute() -> Any:
        return circuits.edge_attribution(
            model, clean, corrupt, metric, method=method, steps=steps, positional=positional, batch_size=batch_size, progress=False
        )

    base = Method("forward", forward)
    timed = Method(f"edge_attribution({method})", attribute)
    interleave([base, timed], repeats, log=log)
    row = summary(timed, base)
    pairs = ids.shape[0]
    return {
        "row": f"edge_attribution, method={method!r}{f', steps={steps}' if method.startswith('eap-ig') else ''}{', positional' if positional else ''}",
        "pairs": pairs,
        "forward_s": row["median_s"] / row["ratio"],
        "attribution_s": row["median_s"],
        "per_pair_s": row["median_s"] / pairs,
        "ratio": row["ratio"],
        "ratio_range": (row["min"], row["max"]),
    }


def _recall(model: Any, pairs: int) -> tuple:
    from nnterp import circuits
    from nnterp.testing import recall, toy_task

    rng = random.Random(0)
    samples = [toy_task("hybrid").sample(rng, n_pairs=6, queried=2) for _ in range(pairs)]
    corrupted = [recall.corrupt_value(sample, rng) for sample in samples]
    good = recall.answer_ids(model, samples)
    bad = torch.tensor(model.tokenizer.convert_tokens_to_ids([value for _, value in corrupted]))
    return [s.prompt for s in samples], [p for p, _ in corrupted], circuits.logit_difference(good, bad)


def main(argv: list | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--page", help="a performance page whose circuits section this run replaces")
    args = parser.parse_args(argv)
    import datetime

    from nnterp import StandardizedTransformer
    from nnterp.testing import toy_checkpoint

    model = StandardizedTransformer(str(toy_checkpoint("hybrid")), dispatch=True, device="cpu", enable_attention_probs=True)
    clean, corrupt, metric = _recall(model, args.pairs)
    length = len(model.tokenizer(clean[0]).input_ids)
    rows = []
    for method, positional in (("eap", False), ("eap-ig", False), ("eap-ig", True), ("eap-ig-activations", False)):
        cost = edge_attribution_cost(model, clean, corrupt, metric, method=method, steps=args.steps, positional=positional, repeats=args.reps, log=lambda _: None)
        low, high = cost["ratio_range"]
        rows.append(f"| `{cost['row']}` | {cost['pairs']} | {cost['per_pair_s'] * 1e3:.1f} ms | {cost['ratio']:.1f}x [{low:.1f}, {high:.1f}] |")
    text = "\n".join([
        SECTION,
        "## Circuits",
        "",
        f"`nnterp.circuits.edge_attribution` on the `hybrid` toy (a gated DeltaNet layer, then an attention layer), "
        f"{args.pairs} recall prompt pairs of {length} tokens (the queried pair's value corrupted), every edge scored; "
        f"run of {datetime.date.today().isoformat()}, CPU, {torch.get_num_threads()} torch thread(s). The time per pair, and "
        f"against one plain forward of the same clean batch: medians of {args.reps} interleaved repeats, `[min, max]` of the "
        "paired ratios (`python benchmarks/circuits.py --page docs/performance.md`). EAP is one corrupt forward, one "
        "clean forward and one backward; EAP-IG adds a forward and a backward per step; positional edges add every "
        "head's per-source terms; EAP-IG-activations runs a forward and a backward per step and per destination.",
        "",
        "| call | pairs | per pair | vs a forward |",
        "|---|---|---|---|",
        *rows,
        END,
        "",
    ])
    if args.page:
        replace_section(Path(args.page), text, SECTION, END)
    else:
        print(text)
    return text


if __name__ == "__main__":
    main()
