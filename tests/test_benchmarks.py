"""The benchmark runner at tiny sizes: what it measures is right (not how fast it is)."""

from __future__ import annotations

import pytest

from benchmarks import run


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "performance.md"
    found = run.main([
        "--tiny", "--lengths", "8", "20", "--reps", "1", "--long-reps", "1",
        "--tl", "off", "--cache-dir", str(folder / "models"), "--out", str(out),
    ])
    return found, out.read_text()


def test_fast_and_routed_states_it_times_are_equal(results):
    found, _ = results
    for name in ("gated_deltanet", "mamba", "mamba2"):
        for length, data in found["families"][name]["lengths"].items():
            checks = data["checks"]
            assert checks["states_fast_vs_routed"] < 1e-5, (name, length)
            assert checks["write_fast_vs_routed"] < 1e-4, (name, length)
            assert checks["states_bytes"] > 0


def test_every_family_times_its_calls_against_the_plain_forward(results):
    found, _ = results
    for name, family in found["families"].items():
        for length, data in family["lengths"].items():
            rows = data["rows"]
            assert rows["plain forward"]["ratio"] == pytest.approx(1.0)
            expected = {"nnsight trace, reading nothing", "layer_output of every layer", "state_output of every recurrent layer", "states, routed"}
            if family["fast"]:
                expected |= {"states, fast path", "set_state_after(mid), fast path"}
            assert expected <= set(rows), (name, length)
        assert family["generate"]["rows"]["generate, plain"]["ratio"] == pytest.approx(1.0)
    assert found["families"]["mamba"]["fast"], "Mamba-1 has a fast path (nnterp.fast.selective)"


def test_the_report_carries_the_command_the_machine_and_the_targets(results):
    found, text = results
    assert found["command"].startswith("python benchmarks/run.py --tiny") and found["command"] in text
    assert "* Machine: " in text and "thread" in text
    for heading in ("## Gated DeltaNet hybrid", "## Mamba-1", "## Mamba-2", "## Targets"):
        assert heading in text
    assert "| states, fast path |" in text and "TransformerLens" in text
    assert any(target.startswith("generate reading state_output") for target, *_ in found["targets"])


def test_gpu_script_dry_run_checks_fast_against_routed(tmp_path, capsys):
    # The GPU benchmark on tiny models on the CPU: its checks (fast vs routed states and writes) run and pass.
    from benchmarks import gpu

    out = tmp_path / "gpu.md"
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n" + gpu.SECTION + "\nnot run\n" + gpu.END + "\n")
    status = gpu.main(["--cpu-dry-run", "--lengths", "12", "--check-length", "10", "--reps", "1", "--out", str(out), "--page", str(page)])
    text = out.read_text()
    assert status == 0 and "Checks: all passed" in text
    assert text.count("| pass |") >= 5 and "**fail**" not in text
    assert "not run" not in page.read_text() and page.read_text().count(gpu.SECTION) == 1


def test_gpu_script_without_a_gpu_says_so(monkeypatch):
    import torch

    from benchmarks import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 2
