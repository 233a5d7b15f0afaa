"""The command line: ``nnterp demo`` and ``nnterp support`` (also ``python -m nnterp``).

``nnterp demo [--out DIR]`` runs on the trained toys shipped in the package
(`nnterp.testing.toy_checkpoint`, `nnterp.testing.toy_demo`): associative recall on a
recurrent-only toy and on a hybrid, the state after every token, effective
attention, and a swap of the context's memory for a donor context's that
changes the recalled value, with plots in ``--out``.
``nnterp demo --model ID_OR_PATH`` (or a tiny checkpoint's name, ``--family``)
walks the DeltaNet recipe on that model instead: the support table, the state
leaving a prompt, the state after every token, a patch of another prompt's
state into the middle of the prompt and its effect on the next token, then
writes PNG plots into ``--out``.

``nnterp support ID_OR_PATH`` prints which value each layer serves, and why
not, from the model's config alone: the model is built on the meta device
(``StandardizedTransformer(..., dispatch=False)``), no weights are loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "toys"  # the trained toys of nnterp.testing (nnterp.testing.toy_demo)
TINY_HYBRID = "qwen3_5_text"  # the embedded tiny random-weight hybrid, by nnterp.testing's name
PROMPT = "The Eiffel Tower is in the city of"
DONOR = "My favourite food is pizza with"

SERVED, ABSENT = "+", "-"
CODES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


# -- the support table ---------------------------------------------------------


def format_support(model: Any, title: str = "") -> str:
    """``model.support()`` as a compact table: one row per value, one column per layer.

    A cell is ``+`` (served), ``-`` (the layer has no such part) or a letter
    naming the reason, listed under the table, why the layer cannot serve it.
    """
    table = model.support()
    n = len(model.layers)
    reasons: dict[str, str] = {}

    def cell(reason: str | None) -> str:
        if reason is None:
            return SERVED
        return reasons.setdefault(reason, CODES[len(reasons) % len(CODES)])

    rows = []
    for key, entry in table.items():
        if key.startswith(("model.", "circuits.")):  # model-wide rows: listed under the table
            continue
        if entry is None:
            present = _present(model, key)
            cells = [SERVED if i in present else ABSENT for i in range(n)]
        elif isinstance(entry, dict):
            cells = [cell(entry[i]) if i in entry else ABSENT for i in range(n)]
        else:
            cells = [cell(reason) for reason in entry]
        rows.append((key, cells))
    width = len(str(n - 1)) + 1
    label = max([len(key) for key, _ in rows] + [len("value / layer")]) + 2
    lines = [title] if title else []
    digits = [str(i).rjust(width - 1) for i in range(n)]
    for d in range(width - 1):  # layer numbers, one digit per header line
        head = "value / layer" if width == 2 else "value" if d == width - 2 else "layer" if d == 0 else ""
        lines.append(head.ljust(label) + "".join(number[d].rjust(width) for number in digits))
    for key, cells in rows:
        lines.append(key.ljust(label) + "".join(c.rjust(width) for c in cells))
    model_values = [key[len("model."):] for key, entry in table.items() if key.startswith("model.") and entry is None]
    if model_values:
        lines.append(f"model: {', '.join(model_values)} served")
    circuit_rows = {key[len("circuits."):]: entry for key, entry in table.items() if key.startswith("circuits.")}
    if circuit_rows:
        lines.append("circuits: " + ", ".join(f"{name} {cell(entry)}" for name, entry in circuit_rows.items()))
    lines.append(f"{SERVED} served   {ABSENT} the layer has no such part" + ("   letter: not served, because" if reasons else ""))
    for reason, code in reasons.items():
        lines.append(f"  {code}: {reason}")
    return "\n".join(lines)


def _present(model: Any, key: str) -> set:
    """The layers that have the component a ``"<component>.<value>"`` key names."""
    kind = key.split(".", 1)[0]
    if kind == "layer":
        return set(range(len(model.layers)))
    return {i for i, layer in enumerate(model.layers) if getattr(layer, kind, None) is not None}


def _resolve(model: str) -> str:
    """A tiny checkpoint's name (``qwen3_5_text``, ``mamba``, ...) becomes its local path."""
    from .testing import MODEL_TYPES, tiny_checkpoint

    if model in MODEL_TYPES and not os.path.exists(model):
        return str(tiny_checkpoint(model))
    return model


def _load(model: str, *, weights: bool, device: str = "cpu") -> Any:
    from . import NnterpError, StandardizedTransformer

    path = _resolve(model)
    if weights:
        return StandardizedTransformer(path, dispatch=True, device=device)
    try:
        return StandardizedTransformer(path)
    except NnterpError:
        raise  # the config itself is wrong (or the model unsupported): a stand-in tokenizer would not help
    except (OSError, ValueError):
        # A folder with a config and no tokenizer: the table needs no tokenizer, lend a stand-in.
        from .testing import tiny_tokenizer

        return StandardizedTransformer(path, tokenizer=tiny_tokenizer())


def support_command(args: argparse.Namespace) -> int:
    from . import route_kernels

    model = _load(args.model, weights=False)
    name = f"{model.family.NAME} ({type(model._module).__name__}), {len(model.layers)} layers"
    if args.routed:
        if getattr(model.family, "MIXER", None) is None:
            print(f"{args.model}: {name} has no recurrent mixer to route", file=sys.stderr)
            return 2
        with route_kernels(model.family, "torch"):
            print(format_support(model, f"{args.model}: {name}, after nnterp.route_kernels(model.family, 'torch')"))
    else:
        print(format_support(model, f"{args.model}: {name}, as loaded"))
        if getattr(model.family, "MIXER", None) is not None:
            print("(--routed: the table after nnterp.route_kernels(model.family, 'torch'))")
    return 0


# -- the demo ------------------------------------------------------------------


def _section(title: str) -> None:
    print(f"\n== {title} ==")


def _top(model: Any, probs: Any, k: int = 5) -> str:
    values, ids = probs.topk(k)
    return "  ".join(f"{model.tokenizer.decode(int(i))!r} {float(v):.3f}" for v, i in zip(values, ids))


def _demo_problem(args: argparse.Namespace) -> str | None:
    """What makes the demo's arguments unusable, checked before it loads anything (``None``: nothing)."""
    import torch

    from .testing import MODEL_TYPES

    if args.family is not None:
        if args.family not in MODEL_TYPES:
            return f"--family {args.family!r} is not a registered model_type: pass one of {', '.join(MODEL_TYPES)}"
        args.model = args.family
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError) as error:
        return f"--device {args.device!r} is not a torch device ({error}): pass cpu, cuda or cuda:N"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {args.device} asks for CUDA, which this torch cannot use (torch.cuda.is_available() is False): pass --device cpu"
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s): pass cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return f"--device {args.device} asks for MPS, which this torch cannot use: pass --device cpu"
    out = Path(args.out).absolute()
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        return f"--out {args.out}: {existing} is a file, so no folder can be made there: pass another --out"
    if not os.access(existing, os.W_OK):
        return f"--out {args.out}: {existing} is not writable: pass another --out"
    return None


def demo_command(args: argparse.Namespace) -> int:
    import torch

    from . import Unavailable
    from .sweep import per_token_states
    from .testing.checkpoints import default_cache_dir

    problem = _demo_problem(args)
    if problem is not None:
        print(f"nnterp demo: {problem}", file=sys.stderr)
        return 2
    # No --model: the toys, whatever the working folder holds; --model toys names a folder of that name if one exists.
    if args.model is None or (args.model == DEFAULT_MODEL and not os.path.exists(args.model)):
        from nnterp.testing import toy_demo

        print("nnterp demo: the trained toys (nnterp.testing.toy_checkpoint), associative recall")
        toy_demo.run(args.out, samples=args.samples, device=args.device)
        return 0
    tiny = args.model == TINY_HYBRID
    path = _resolve(args.model)
    model = _load(path, weights=True, device=args.device)
    recurrent = [i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None) is not None]
    print(f"nnterp demo: {args.model} ({model.family.NAME}, {len(model.layers)} layers, "
          f"recurrent mixers at {recurrent})")
    if tiny:
        print("the embedded tiny hybrid: random weights, so the numbers show the mechanics, not language")
    if path != args.model:
        print(f"the tiny checkpoint is kept at {path} (built once under {default_cache_dir()}; set NNTERP_CACHE "
              "to keep it elsewhere)")
    if recurrent:
        print(f"the plots go to {Path(args.out).resolve()} (--out)")

    _section("what each layer serves (model.support())")
    print(format_support(model))
    if not recurrent:
        print("\nthis model has no recurrent mixer: nothing more to show")
        return 0
    mixes = [model.layers[i].linear_attn for i in recurrent]  # decided outside the trace
    prompt, donor = args.prompt, args.donor
    tokens = model.tokenizer.convert_ids_to_tokens(model.tokenizer(prompt).input_ids)

    _section(f"the state leaving the prompt {prompt!r} (state_output, norm per layer)")
    leaving: list = []  # bound outside the trace, so it survives it
    with torch.no_grad(), model.trace(prompt):
        for mix in mixes:
            leaving.append(mix.state_output.save())
        clean = model.next_token_probs[0].save()
    for index, state in zip(recurrent, leaving):
        print(f"  layer {index:>2}  {tuple(state.shape)}  ‖S‖ = {float(state.norm()):.3f}")
    print(f"  next token: {_top(model, clean)}")

    out = Path(args.out)
    # Per-token states need the token-by-token kernel (and, on Mamba-2, a chunk per token); undone on exit.
    with per_token_states(model):
        _section("the state after every token (states, under nnterp.route_kernels(model.family, 'torch'))")
        states: list = []
        finals: list = []
        try:
            with torch.no_grad(), model.trace(prompt):
                for mix in mixes:  # forward order: a layer's reads before later layers', `states` before `state_output`
                    states.append(mix.states.save())
                    finals.append(mix.state_output.save())
        except Unavailable as error:
            print(f"  {error}")
            return 0
        print("  " + "token".ljust(14) + "".join(f"L{i}".rjust(9) for i in recurrent))
        norms = torch.stack([s[0].flatten(1).norm(dim=-1) for s in states], 1)  # [seq, layers]
        for token, row in zip(tokens, norms):
            print("  " + repr(token).ljust(14) + "".join(f"{float(v):9.3f}" for v in row))
        # Bit for bit where the states are the kernel's own (a token loop); to float rounding where they are
        # computed from the kernel call's arguments (the mLSTM): then the difference is shown.
        same = max(float((s[:, -1] - final).abs().max()) for s, final in zip(states, finals))
        gap = max(float((final - last).abs().max()) for final, last in zip(finals, leaving))
        equal = "True" if same == 0 else f"to {same:.1e} (computed from the kernel call's arguments)"
        print(f"  states[:, -1] == state_output: {equal}; against the chunked kernel's state_output: max |diff| {gap:.1e}")

        n_donor = len(model.tokenizer(donor).input_ids)
        T = min(len(tokens), n_donor) // 2
        _section(f"a patch: every mixer's state after token {T} ({tokens[T]!r}) replaced by the donor's, {donor!r}")
        donors: list = []
        with torch.no_grad(), model.trace(donor):
            for mix in mixes:
                donors.append(mix.state_after(T).save())
        with torch.no_grad(), model.trace(prompt):
            for mix, state in zip(mixes, donors):  # the later layers written after the earlier ones
                mix.set_state_after(T, state)
            patched = model.next_token_probs[0].save()
        target = int(clean.argmax())
        print(f"  clean:   {_top(model, clean)}")
        print(f"  patched: {_top(model, patched)}")
        print(f"  p({model.tokenizer.decode(target)!r}): {float(clean[target]):.3f} -> {float(patched[target]):.3f}; "
              f"total variation {0.5 * float((patched - clean).abs().sum()):.3f}")
        effects = {}
        for index, mix, state in zip(recurrent, mixes, donors):  # one layer at a time
            with torch.no_grad(), model.trace(prompt):
                mix.set_state_after(T, state)
                one = model.next_token_probs[0, target].save()
            effects[index] = float(one) - float(clean[target])
        print("  one layer at a time, Δp: " + "  ".join(f"L{i} {v:+.4f}" for i, v in effects.items()))
        sweep = None
        if not args.no_sweep:
            from .sweep import patch_sweep

            _section("a sweep: every layer × position (nnterp.sweep.patch_sweep)")
            sweep = patch_sweep(model, prompt, donor, target, progress=not args.quiet)
            best = divmod(int(sweep.effect.abs().nan_to_num(0).argmax()), len(sweep.positions))
            layer, position = sweep.layers[best[0]], sweep.positions[best[1]]
            print(f"  {sweep.done} cells; the largest effect: layer {layer}, after token {position} "
                  f"({tokens[position]!r}), Δp = {float(sweep.effect[best]):+.4f}")
    _plots(model, out, recurrent, states, tokens, effects, sweep, target, T)
    return 0


def _plots(model: Any, out: Path, recurrent: list, states: list, tokens: list, effects: dict, sweep: Any, target: int, T: int) -> None:
    _section(f"plots in {out}/")
    try:
        from . import plot

        plot.figure_class()
    except ImportError as error:
        print(f"  skipped: {error}")
        return
    out.mkdir(parents=True, exist_ok=True)
    name = plot.token_label(model.tokenizer.convert_ids_to_tokens(target))
    # A state is one matrix per head, or on Mamba-1 one vector per inner channel.
    unit = "head" if "mixer_heads" in model.layers[recurrent[0]].linear_attn.dims() else "channel"
    last = states[0][:, -1]
    if last.ndim == 2:  # one number per channel (the RG-LRU's state): its norm is its absolute value
        last = last[..., None]
    figures = {
        "state_norms.png": plot.state_norms(dict(zip(recurrent, states)), tokens),
        "head_norms.png": plot.head_norms(
            last, unit=unit, title=f"State norm per {unit}, layer {recurrent[0]}, after {plot.token_label(tokens[-1])!r}"
        ),
        "patch_effect.png": plot.patch_effect(
            effects, label=f"Δ p({name!r})", title=f"One layer's state replaced\nafter {plot.token_label(tokens[T])!r} (token {T})"
        ),
    }
    if sweep is not None:
        figures["patch_sweep.png"] = plot.patch_effect(sweep, label=f"Δ p({name!r})", title="Patch sweep: layer × position")
    for filename, figure in figures.items():
        figure.savefig(out / filename, dpi=110)
        print(f"  {out / filename}")


# -- entry point ---------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="nnterp", description="Read and patch what recurrent and hybrid language models carry forward."
    )
    commands = top.add_subparsers(dest="command", metavar="{demo,support}")
    commands.required = True
    demo = commands.add_parser(
        "demo",
        help="show states, effective attention and memory patches on the trained toys (or a model) and write plots",
        description="By default, on the trained associative-recall toys: the state after every token, effective "
        "attention, and a swap of the context's memory that changes the recalled value. With --model/--family, walk "
        "the DeltaNet recipe on that model: the support table, the state leaving a prompt, the state after every "
        "token, a patch and its effect on the next token. Then write PNG plots.",
    )
    which = demo.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help=f"hub id, local folder, or a tiny checkpoint's name ({TINY_HYBRID}: the embedded tiny random-weight "
                       f"hybrid; default: {DEFAULT_MODEL}, the trained toys)")
    which.add_argument("--family", metavar="MODEL_TYPE",
                       help="the embedded tiny checkpoint of a registered model_type (as --model MODEL_TYPE)")
    demo.add_argument("--out", default="nnterp-demo", help="folder for the PNG plots (default: ./nnterp-demo)")
    demo.add_argument("--prompt", default=PROMPT, help=f"the prompt (default: {PROMPT!r})")
    demo.add_argument("--donor", default=DONOR, help=f"the prompt whose state is patched in (default: {DONOR!r})")
    demo.add_argument("--device", default="cpu", help="where to load the weights (default: cpu)")
    demo.add_argument("--no-sweep", action="store_true", help="skip the layer × position sweep")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--samples", type=int, default=100, help="fresh samples per rate on the toys (default: 100)")
    demo.set_defaults(run=demo_command)
    support = commands.add_parser(
        "support",
        help="print which value each layer serves, and why not, from the config",
        description="Print model.support() as a table, layers × values, with the reasons, building the model on the "
        "meta device from its config (no weights are loaded).",
    )
    support.add_argument("model", metavar="ID_OR_PATH", help="hub id, local folder, or a tiny checkpoint's name")
    support.add_argument("--routed", action="store_true", help="the table after nnterp.route_kernels(model.family, 'torch')")
    support.set_defaults(run=support_command)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    from .core.errors import NnterpError

    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except NnterpError as error:  # a bad path, an unsupported model: say it, without a traceback
        print(f"nnterp {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
