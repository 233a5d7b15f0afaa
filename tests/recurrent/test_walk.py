"""The code a reader finds for a per-token write is the code that runs: one strategy file, the record, the component.

A profiler follows one ``set_state_after`` on a Mamba-2 mixer (chunk boundaries),
a routed gated DeltaNet (the token loop) and the fast path (from the call's
arguments), and lists the nnterp files it enters. Each walk enters exactly one
strategy file, the per-call record, the component's own file and the shared
helpers below them, and no other component, family or strategy.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import nnterp

ROOT = os.path.dirname(nnterp.__file__)
STRATEGIES = {"recurrent/per_token/loop.py", "recurrent/per_token/boundaries.py", "recurrent/per_token/from_arguments.py"}
SHARED = {
    "components/recurrent.py", "recurrent/call.py", "recurrent/per_token/__init__.py", "recurrent/settings.py",
    "recurrent/arguments.py", "recurrent/kernels.py", "recurrent/labels.py", "core/calls.py", "core/values.py",
}


def _walk(model, mix) -> set:
    entered: set = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            entered.add(os.path.relpath(frame.f_code.co_filename, ROOT).replace(os.sep, "/"))

    with torch.no_grad(), model.trace("Hello world there and more"):
        state = mix.state_after(1)
        sys.setprofile(profile)
        mix.set_state_after(2, state * 0)
        sys.setprofile(None)
    return entered


@pytest.mark.parametrize(
    "model_type, setting, strategy, component",
    [
        ("mamba2", lambda m: nnterp.chunk_per_token(m), "boundaries", "state_space"),
        ("qwen3_5_text", lambda m: nnterp.route_kernels(m.family, "torch"), "loop", "linear_attention"),
        ("qwen3_5_text", lambda m: nnterp.fast_states(m), "from_arguments", "linear_attention"),
    ],
    ids=["mamba2-chunk-boundaries", "deltanet-token-loop", "deltanet-from-arguments"],
)
def test_a_write_walks_its_strategy_the_record_and_its_component(load, model_type, setting, strategy, component):
    model = load(model_type)
    with setting(model):
        entered = _walk(model, model.layers[0].linear_attn)
    assert f"recurrent/per_token/{strategy}.py" in entered and "recurrent/call.py" in entered
    assert entered & STRATEGIES == {f"recurrent/per_token/{strategy}.py"}
    assert entered - SHARED - STRATEGIES <= {f"components/{component}.py"}
