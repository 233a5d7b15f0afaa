"""The code a reader finds for a per-token write is the code that runs: one strategy file, the record, the component.

A profiler follows one ``set_state_after`` on a Mamba-2 mixer (chunk boundaries),
a routed gated DeltaNet (the token loop) and the fast path (from the call's
arguments), and lists the nnterp files it enters. Each walk enters exactly one
strategy file, the per-call record, the component's own file and the shared
helpers below them, and no other component, family or strategy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

STRATEGIES = {"recurrent/per_token/loop.py", "recurrent/per_token/boundaries.py", "recurrent/per_token/from_arguments.py"}
SHARED = {
    "components/recurrent.py", "components/per_token_values.py", "recurrent/call.py", "recurrent/per_token/__init__.py", "recurrent/settings.py",
    "recurrent/arguments.py", "recurrent/kernels.py", "recurrent/labels.py", "core/calls.py", "core/values.py", "core/indices.py",
    "fast/step.py",
}


WALK = """
import json, os, sys, torch, nnterp
from nnterp import StandardizedTransformer
from nnterp.testing import tiny_checkpoint

root = os.path.dirname(nnterp.__file__)
model = StandardizedTransformer(str(tiny_checkpoint(sys.argv[1])), dispatch=True, device="cpu")
setting = {"chunks": nnterp.chunk_per_token, "fast": nnterp.fast_states,
           "routed": lambda m: nnterp.route_kernels(m.family, "torch")}[sys.argv[2]]
entered = set()

def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(root):
        entered.add(os.path.relpath(frame.f_code.co_filename, root).replace(os.sep, "/"))

mix = model.layers[0].linear_attn
with setting(model), torch.no_grad(), model.trace("Hello world there and more"):
    state = mix.state_after(1)
    sys.setprofile(profile)
    mix.set_state_after(2, state * 0)
    sys.setprofile(None)
print(json.dumps(sorted(entered)))
"""


def _walk(model_type: str, setting: str) -> set:
    # Its own interpreter: nothing another test left in this process (a registered package, a profiler) counts.
    done = subprocess.run([sys.executable, "-c", WALK, model_type, setting], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "model_type, setting, strategy, component",
    [
        ("mamba2", "chunks", "boundaries", "state_space"),
        ("qwen3_5_text", "routed", "loop", "linear_attention"),
        ("qwen3_5_text", "fast", "from_arguments", "linear_attention"),
    ],
    ids=["mamba2-chunk-boundaries", "deltanet-token-loop", "deltanet-from-arguments"],
)
def test_a_write_walks_its_strategy_the_record_and_its_component(model_type, setting, strategy, component):
    entered = _walk(model_type, setting)
    assert f"recurrent/per_token/{strategy}.py" in entered and "recurrent/call.py" in entered
    assert entered & STRATEGIES == {f"recurrent/per_token/{strategy}.py"}
    assert entered - SHARED - STRATEGIES <= {f"components/{component}.py"}
