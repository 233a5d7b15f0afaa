"""Remote execution: every family kind, run on a fake NDIF server without nnterp, equals the local run exactly.

The server (`server.py`) is a second interpreter with torch, transformers and
nnsight but no nnterp; it builds the model from the request's model key with
plain nnsight and runs the request as nnsight's ``RemoteBackend`` ships it
(`harness.intercept` replaces only the network). Each block runs once with
``remote=True`` and once locally, and the saves are compared with
``torch.equal``.
"""

from __future__ import annotations

import json

import nnsight
import pytest
import torch

import nnterp
from nnterp import StandardizedTransformer
from nnterp.families import REGISTRY, families
from nnterp.testing import tiny_checkpoint
from tests.remote.harness import FakeServer, ServerError, intercept

pytestmark = pytest.mark.timeout(900)

PROMPT = "The quick brown fox jumps over the lazy dog"
#: One family per recurrent component (the first registered: gated DeltaNet, Kimi, Mamba-1, Mamba-2), and the plain one.
RECURRENT = sorted({family.MIXER: family.NAME for family in reversed(families()) if family.MIXER is not None}.values())
PLAIN = next(family.NAME for family in families() if family.MIXER is None)
KINDS = [*RECURRENT, PLAIN]
#: The kinds whose mixer has a fast path (fast_states).
FAST = [kind for kind in RECURRENT if REGISTRY[kind].MIXER.FAST is not None]
NEW = 3


@pytest.fixture(scope="module")
def server():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def sent(server):
    with intercept(server) as record:
        yield record


@pytest.fixture(scope="module")
def models():
    """``models(kind) -> (local, remote)``: a dispatched local model and a ``remote=True`` one, cached."""
    cache: dict = {}

    def get(kind: str) -> tuple[StandardizedTransformer, StandardizedTransformer]:
        if kind not in cache:
            path = str(tiny_checkpoint(kind))
            cache[kind] = (StandardizedTransformer(path, dispatch=True, device="cpu"), StandardizedTransformer(path, remote=True))
        return cache[kind]

    return get


def mixer_layer(model: StandardizedTransformer) -> int:
    return next(i for i, layer in enumerate(model.layers) if layer.linear_attn is not None)


def assert_same(remote: dict, local: dict) -> None:
    assert remote.keys() == local.keys()
    for name in local:
        ours, theirs = remote[name], local[name]
        if isinstance(theirs, (list, tuple)):
            assert len(ours) == len(theirs), name
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert (a is None and b is None) or torch.equal(a, b), f"{name}[{i}]"
        elif theirs is None:
            assert ours is None, name
        else:
            assert torch.equal(ours, theirs), name


# -- the blocks, each run with remote=True on the remote model and locally on the local one -------------------


def reads(model: StandardizedTransformer, remote: bool) -> dict:
    last = len(model.layers) - 1
    with torch.no_grad(), model.trace(PROMPT, remote=remote):
        hidden = model.layers[last].layer_output.save()
        head = model.lm_head.output.save()
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    return {"head": head, "hidden": hidden, "logits": logits, "probs": probs}


def state_reads(model: StandardizedTransformer, layer: int, remote: bool) -> dict:
    mix = model.layers[layer].linear_attn
    with torch.no_grad(), model.trace(PROMPT, remote=remote):
        entering = nnsight.save(mix.state_input)
        leaving = mix.state_output.save()
        out = mix.attention_output.save()
    return {"entering": entering, "leaving": leaving, "out": out}


def generate_steps(model: StandardizedTransformer, layer: int | None, remote: bool) -> dict:
    mix = model.layers[layer].linear_attn if layer is not None else None
    block = model.layers[-1]
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, remote=remote) as tracer:
        states = nnsight.save([])
        hidden = nnsight.save([])
        for step in tracer.iter[:NEW]:
            if mix is not None:
                states.append(mix.state_output.clone())
            hidden.append(block.layer_output.clone())
        ids = tracer.result.save()
    return {"states": states, "hidden": hidden, "ids": ids}


def per_token(model: StandardizedTransformer, layer: int, remote: bool) -> dict:
    # Gradient mode as a server runs the block (a client's `torch.no_grad()` does not travel): under autograd the
    # fast path builds its states differentiably, so both sides must take the same path to compare bit for bit.
    mix = model.layers[layer].linear_attn
    with model.trace(PROMPT, remote=remote):
        states = mix.states.save()
    return {"states": states}


def per_token_write(model: StandardizedTransformer, layer: int, remote: bool) -> dict:
    mix = model.layers[layer].linear_attn
    with model.trace(PROMPT, remote=remote):  # gradient mode as on a server (see per_token)
        first = mix.state_after(0).save()
        mix.set_state_after(1, 2 * first)
        after = mix.state_after(2).save()
        leaving = mix.state_output.save()
        logits = model.logits.save()
    return {"first": first, "after": after, "leaving": leaving, "logits": logits}


# -- every family kind ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reads_equal_the_local_run(kind, models, sent):
    local, remote = models(kind)
    assert_same(reads(remote, True), reads(local, False))
    assert len(sent.payload_bytes) == 1
    assert not remote.dispatched  # it ran on the server: no weights here


@pytest.mark.parametrize("kind", RECURRENT)
def test_state_input_and_output_equal_the_local_run(kind, models, sent):
    local, remote = models(kind)
    layer = mixer_layer(local)
    ours = state_reads(remote, layer, True)
    assert ours["entering"] is None  # a prompt starts from nothing
    assert_same(ours, state_reads(local, layer, False))


@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_tracer_iter_equals_the_local_run(kind, models, sent):
    local, remote = models(kind)
    layer = mixer_layer(local) if kind != PLAIN else None
    ours = generate_steps(remote, layer, True)
    assert len(ours["hidden"]) == NEW and len(ours["states"]) == (NEW if layer is not None else 0)
    assert_same(ours, generate_steps(local, layer, False))


@pytest.mark.parametrize("kind", FAST)
def test_fast_states_run_remotely(kind, models, sent):
    local, remote = models(kind)
    layer = mixer_layer(local)
    with nnterp.fast_states(remote), nnterp.fast_states(local):
        assert_same(per_token(remote, layer, True), per_token(local, layer, False))
        assert_same(per_token_write(remote, layer, True), per_token_write(local, layer, False))


@pytest.mark.parametrize("kind", [kind for kind in RECURRENT if kind not in FAST])
def test_own_states_run_remotely(kind, models, sent):
    # The kinds whose states need no setting (their own strategies, one passes included) ship with the request.
    local, remote = models(kind)
    layer = mixer_layer(local)
    assert_same(per_token(remote, layer, True), per_token(local, layer, False))


def selected_states(model: StandardizedTransformer, remote: bool) -> dict:
    with model.trace(PROMPT, remote=remote):  # gradient mode as on a server (see per_token)
        chosen = model.states_of(positions=[3, -1]).save()  # a saved dict comes back with its tensors
    return {f"layers[{layer}]": states for layer, states in chosen.items()}


@pytest.mark.parametrize("kind", FAST)
def test_model_states_of_runs_remotely(kind, models, sent):
    local, remote = models(kind)
    with nnterp.fast_states(remote), nnterp.fast_states(local):
        ours = selected_states(remote, True)
        assert len(ours) == sum(layer.linear_attn is not None for layer in local.layers)
        assert_same(ours, selected_states(local, False))


def test_mamba1_per_token_states_run_remotely_unrouted(models, sent):
    # Mamba-1's pure-torch prompt kernel is the token loop itself: nothing to route, on a server either.
    local, remote = models("mamba")
    layer = mixer_layer(local)
    assert_same(per_token(remote, layer, True), per_token(local, layer, False))
    assert_same(per_token_write(remote, layer, True), per_token_write(local, layer, False))


def test_mamba2_chunk_per_token_runs_remotely(models, sent):
    # A per-model setting held on nnterp's envoys travels with the request (the scan call gets chunk_size=1).
    local, remote = models("mamba2")
    layer = mixer_layer(local)
    with nnterp.chunk_per_token(remote), nnterp.chunk_per_token(local):
        assert_same(per_token(remote, layer, True), per_token(local, layer, False))


def session_reads(model: StandardizedTransformer, remote: bool) -> dict:
    with torch.no_grad(), model.session(remote=remote):
        with model.trace(PROMPT):
            first = model.logits.save()
        with model.trace("An unrelated prompt"):
            second = model.next_token_probs.save()
    return {"first": first, "second": second}


def test_a_session_runs_remotely_as_one_request(models, sent):
    # Its inner traces run on the server's model: the copy a request carries is not remote there.
    local, remote = models("qwen3_5_text")
    assert_same(session_reads(remote, True), session_reads(local, False))
    assert len(sent.payload_bytes) == 1


# -- what cannot run remotely says so ------------------------------------------------------------------------


def test_routed_states_are_unavailable_remotely_and_the_error_names_fast_states(models, sent):
    _, remote = models("qwen3_5_text")
    layer = mixer_layer(remote)
    with pytest.raises(ServerError) as error:
        per_token(remote, layer, True)
    message = str(error.value)
    assert "Unavailable" in message and "fast_states" in message
    assert "route_kernels(model.family, 'torch') before" not in message


def test_support_of_a_remote_model_names_fast_states(models):
    local, remote = models("qwen3_5_text")
    layer = mixer_layer(remote)
    reason = remote.support()["linear_attn.states"][layer]
    assert "fast_states" in reason and "server" in reason
    assert "route_kernels" in local.support()["linear_attn.states"][layer]
    with nnterp.fast_states(remote):
        assert remote.support()["linear_attn.states"] is None or remote.support()["linear_attn.states"][layer] is None


# -- the request itself ----------------------------------------------------------------------------------------


def test_remote_true_builds_the_request_without_a_network(models):
    local, remote = models("qwen3_5_text")
    assert remote.remote and not local.remote
    with intercept(None) as sent, pytest.raises(ServerError, match="not sent"):
        with remote.trace(PROMPT):  # remote by default
            remote.lm_head.output.save()
    (request,) = sent.requests
    cls, _, key = request["model_key"].partition(":")
    assert cls == "nnsight.modeling.transformers.TransformersModel"  # the server needs no nnterp to build it
    assert json.loads(key) == {"repo_id": str(tiny_checkpoint("qwen3_5_text")), "revision": None, "task": "text-generation"}
    assert request["env"] == {"attn_implementation": remote.attn_implementation}
    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES

    assert "nnterp" in _PICKLE_BY_VALUE_MODULES


def test_the_model_key_rebuilds_the_model(models):
    local, _ = models(PLAIN)
    key = local.to_model_key()
    rebuilt = nnsight.modeling.transformers.TransformersModel.from_model_key(key, dispatch=True)
    assert type(rebuilt._module) is type(local._module)
    # StandardizedTransformer's own key form (its class in the key) rebuilds too: the key's task is not passed twice.
    ours = StandardizedTransformer.from_model_key(f"nnterp.standardized.StandardizedTransformer:{key.partition(':')[2]}")
    assert ours.family is local.family


def test_the_server_cannot_import_nnterp(server):
    assert server.probe("__import__('importlib.util').util.find_spec('nnterp')") == "None"
    assert server.probe("__import__('sys').flags.isolated and __import__('sys').flags.no_site") == "1"


@pytest.mark.parametrize("kind", [RECURRENT[0], PLAIN])
def test_collect_runs_remotely_one_request_per_batch(kind, models, sent, tmp_path):
    local, remote = models(kind)
    names = ["layers.0.layer_output", "logits"]
    if kind != PLAIN:
        names.insert(0, f"layers.{mixer_layer(local)}.linear_attn.state_output")
    prompts = [PROMPT, "Hello there", "A third prompt"]
    ours = nnterp.collect(remote, prompts, tmp_path / "remote", names, positions=[-1, 0], batch_size=2, remote=True, progress=False)
    theirs = nnterp.collect(local, prompts, tmp_path / "local", names, positions=[-1, 0], batch_size=2, progress=False)
    assert len(sent.payload_bytes) == 2  # one request per batch
    assert not remote.dispatched
    assert ours.manifest["prompts"] == theirs.manifest["prompts"]
    for i in range(len(prompts)):
        for name in names:
            assert torch.equal(ours.value(i, name), theirs.value(i, name)), (i, name)
