"""Walk a `states` read and a `set_state_after` write with a profiler, on every recurrent kind: calls, files, hops.

    python scripts/walk.py                    # a table: one row per walk, calls / files / hops
    python scripts/walk.py --json             # the same as JSON (and each walk's files)
    python scripts/walk.py mamba2 qwen3_5_text  # only these model types

A walk is what the intervention worker runs inside nnterp for one access, on a
tiny checkpoint and a short prompt (`PROMPT`): ``sys.setprofile`` is set on the worker
(the thread running the trace's body) around ``mix.states`` or
``mix.set_state_after(2, state * 0)`` (after an unprofiled ``state_after(1)``),
and every Python ``call`` event whose code lives under the nnterp package is
kept. Counted as the second architecture review counted them
(``shared/research/architecture-review-2.md``, issue 23):

* ``calls``: those call events;
* ``files``: the distinct nnterp files they enter;
* ``hops``: changes of file between consecutive calls: the jumps a reader
  makes following the code.

The walks run under each kind's own per-token strategy, derived from its
component's flags: ``chunks`` (`nnterp.chunk_per_token`) where the prompt
kernel is a chunked scan, ``plain`` where the pure-torch prompt kernel already
loops over tokens (``ONE_STEP_DECODE``), ``routed`` (``route_kernels(family,
"torch")``) otherwise; and ``fast`` (`nnterp.fast_states`) as well where the
component has a fast path (``FAST``). Each model type's walks run in their own
interpreter, always in the same order (per setting: the write, then the read),
so what another model type imported or cached neither counts nor goes missing
(``--inline`` runs them in this process, for a debugger).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello world there and more"
WHATS = ("states", "set_state_after")


def model_types() -> list:
    """One model type per recurrent kind (component class), the walks' subjects, in registry order.

    A kind's subject is its root family: of the families serving that component, the one nearest the base
    family (the shortest class hierarchy: ``mamba`` for Mamba-1, not the hybrid ``jamba`` built on it).
    """
    from nnterp.families import families

    roots: dict = {}
    for family in families():
        if family.MIXER is not None and (family.MIXER not in roots or len(family.__mro__) < len(roots[family.MIXER].__mro__)):
            roots[family.MIXER] = family
    return [family.NAME for family in roots.values()]


def settings_of(model_type: str) -> list:
    """The per-token settings a kind's walks run under: its own strategy, then ``fast`` where it has one."""
    from nnterp.families import REGISTRY

    mixer = REGISTRY[model_type].MIXER
    if getattr(mixer, "STATES_FROM_ARGUMENTS", False) and mixer.FAST is not None:
        return ["fast"]  # its own strategy is the fast path's (the mLSTM's): one walk, the same code under any setting
    own = "chunks" if mixer.CHUNKED_SCAN else "plain" if mixer.ONE_STEP_DECODE else "routed"
    return [own] + (["fast"] if mixer.FAST is not None else [])


def _setting(model, name: str):
    import nnterp

    if name == "plain":
        return contextlib.nullcontext()
    if name == "routed":
        return nnterp.route_kernels(model.family, "torch")
    return {"chunks": nnterp.chunk_per_token, "fast": nnterp.fast_states}[name](model)


def _count(events: list) -> dict:
    hops = sum(1 for before, after in zip(events, events[1:]) if before != after)
    return {"calls": len(events), "files": sorted(set(events)), "hops": hops}


def walks_of(model_type: str, settings: list | None = None) -> list:
    """Every walk of one model type, in this process: ``[{model_type, setting, what, calls, files, hops}]``."""
    import torch

    import nnterp
    from nnterp import StandardizedTransformer
    from nnterp.testing import tiny_checkpoint

    package = os.path.dirname(nnterp.__file__)
    model = StandardizedTransformer(str(tiny_checkpoint(model_type)), dispatch=True, device="cpu")
    mix = next(layer.linear_attn for layer in model.layers if layer.linear_attn is not None)
    events: list = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            events.append(os.path.relpath(frame.f_code.co_filename, package).replace(os.sep, "/"))

    found = []
    for setting in settings or settings_of(model_type):
        with _setting(model, setting), torch.no_grad():
            with model.trace(PROMPT):
                state = mix.state_after(1)
                events.clear()
                sys.setprofile(profile)
                mix.set_state_after(2, state * 0)
                sys.setprofile(None)
            write = _count(events)
            with model.trace(PROMPT):
                events.clear()
                sys.setprofile(profile)
                mix.states.save()
                sys.setprofile(None)
            read = _count(events)
        found.append({"model_type": model_type, "setting": setting, "what": "states", **read})
        found.append({"model_type": model_type, "setting": setting, "what": "set_state_after", **write})
    return found


def walk(types: list | tuple | None = None, inline: bool = False, jobs: int = 2) -> list:
    """The walks of ``types`` (default: `model_types`), each model type in its own interpreter (``jobs`` at a time) unless ``inline``."""
    types = list(types or model_types())
    if inline:
        return [row for model_type in types for row in walks_of(model_type)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(Path(__file__).resolve()), "--inline", "--json"]
    pending, running, done = list(types), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            process = subprocess.Popen(command + [model_type], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            running.append((model_type, process))
        model_type, process = running.pop(0)
        out, err = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"walk of {model_type} failed:\n{err[-4000:]}")
        done[model_type] = json.loads(out.strip().splitlines()[-1])
    return [row for model_type in types for row in done[model_type]]


def table(rows: list) -> str:
    """A markdown table: one line per walk, calls / files / hops."""
    lines = ["| model type | setting | walk | calls | files | hops |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['model_type']} | {row['setting']} | {row['what']} | {row['calls']} | {len(row['files'])} | {row['hops']} |"
        )
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_types", nargs="*", help="default: one per recurrent kind (model_types())")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, files included")
    parser.add_argument("--inline", action="store_true", help="walk in this process (one model type at a time)")
    parser.add_argument("--jobs", type=int, default=2, help="interpreters at a time")
    args = parser.parse_args(argv)
    rows = walk(args.model_types, inline=args.inline, jobs=args.jobs)
    print(json.dumps(rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
