"""The benchmark runner at tiny sizes: what it measures is right (not how fast it is)."""

from __future__ import annotations

import pytest

from benchmarks import cases, models, run


def own_kinds() -> list:
    """The kinds with no fast path (no ``FAST`` spec, from the registry), whose states the runner times as their own
    strategy serves them."""
    from nnterp.families import REGISTRY

    return [name for name, config in models.configs(True).items() if REGISTRY[type(config).model_type].MIXER.FAST is None]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "performance.md"
    found = run.main([
        "--tiny", "--lengths", "8", "20", "--reps", "1", "--long-reps", "1",
        "--tl", "off", "--cache-dir", str(folder / "models"), "--out", str(out),
    ])
    return found, out.read_text()


def test_it_runs_every_kind_by_default(results):
    found, _ = results
    assert tuple(found["families"]) == models.FAMILIES


def test_its_kinds_are_every_recurrent_kind_of_the_registry():
    from nnterp.families import REGISTRY, families

    for tiny in (True, False):
        measured = [REGISTRY[type(config).model_type].MIXER for config in models.configs(tiny).values()]
        assert tuple(models.configs(tiny)) == models.FAMILIES
        assert len(set(measured)) == len(measured), "one model per kind"
        assert set(measured) == {family.MIXER for family in families() if family.MIXER is not None}, (
            "a registered recurrent kind has no benchmark model (benchmarks/models.py), or one left the registry"
        )


def test_its_own_one_pass_rows_follow_the_components_switches(results):
    from benchmarks import cases
    from nnterp.families import REGISTRY

    # Since issue 23 every kind has a fast path, so no kind is timed with a one pass of its own strategy's (RWKV-4's
    # loop's is its fast path's): the table derives from the registry, and the rows follow it.
    for kind, switch in cases.OWN_ONE_PASSES.items():
        assert kind.FAST is None and switch.ONE_PASS is True, kind.__name__
    configs = models.configs(True)
    for name, family in results[0]["families"].items():
        switched = REGISTRY[type(configs[name]).model_type].MIXER in cases.OWN_ONE_PASSES
        for length, data in family["lengths"].items():
            assert (cases.OWN_TWO_PASSES in data["rows"]) == switched, (name, length)


def test_fast_and_routed_states_it_times_are_equal(results):
    found, _ = results
    for name in ("gated_deltanet", "mamba", "mamba2", "kimi_delta_attention"):
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
            expected = {"nnsight trace, reading nothing", "layer_output of every layer", "state_output of every recurrent layer"}
            expected |= {"knockout(mid) of every recurrent layer, every target", "knockout(mid, targets=-1) of every recurrent layer"}
            expected |= {cases.SWEEP_ROW, cases.SWEEP_BATCH_ROW}
            expected |= {"states, own strategy", "set_state_after(mid), own strategy"} if family["own"] else {"states, routed"}
            if family["fast"]:
                expected |= {"states, fast path", "set_state_after(mid), fast path"}
            assert expected <= set(rows), (name, length)
        assert family["generate"]["rows"]["generate, plain"]["ratio"] == pytest.approx(1.0)
    assert found["families"]["mamba"]["fast"], "Mamba-1 has a fast path (nnterp.fast.selective_scan)"
    assert found["families"]["kimi_delta_attention"]["fast"] and not found["families"]["kimi_delta_attention"]["own"]


def test_every_kind_has_a_fast_path():
    # Issue 23: every registered kind attaches a `FAST` spec, so the runner times no kind on an own strategy without one.
    assert not own_kinds(), f"kinds with no fast path: {own_kinds()}"


def test_kinds_whose_own_strategy_is_the_fast_path_time_it_as_both_and_nothing_routed(results):
    from nnterp.families import REGISTRY

    found, _ = results
    kinds = [
        name for name, config in models.configs(True).items()
        if getattr(REGISTRY[type(config).model_type].MIXER, "STATES_FROM_ARGUMENTS", False)
        and REGISTRY[type(config).model_type].MIXER.FAST is not None
    ]
    assert kinds, "the mLSTM's own strategy is FromArguments"
    for name in kinds:
        family = found["families"][name]
        assert family["fast"] and family["own"], name
        for length, data in family["lengths"].items():
            assert not any("routed" in row for row in data["rows"]), (name, length)
            assert {"states, own strategy", "states, fast path"} <= set(data["rows"]), (name, length)
            assert data["checks"]["own_last_vs_state_output"] < 1e-5, (name, length)


def test_the_report_carries_the_command_the_machine_and_the_targets(results):
    found, text = results
    assert found["command"].startswith("python benchmarks/run.py --tiny") and found["command"] in text
    assert "* Machine: " in text and "thread" in text
    for heading in ("## Gated DeltaNet hybrid", "## Mamba-1", "## Mamba-2", "## Targets", "## Kimi delta attention", "## Lightning attention",
                    "## RG-LRU", "## RWKV-4", "## mLSTM", "## Gated short convolution"):
        assert heading in text
    assert "| states, fast path |" in text and "TransformerLens" in text
    assert any(target.startswith("generate reading state_output") for target, *_ in found["targets"])


def test_targets_cover_every_kind_and_show_what_was_not_run():
    # At the lengths (not reached by the tiny run): the own strategy's states are held to the same bound, with the
    # reason beside them; a skipped length shows as not run; a sibling fast row ("... (kernel + states pass)") gets its own target.
    row = lambda ratio: {"ratio": ratio, "min": ratio, "max": ratio, "median_s": ratio, "n": 3}  # noqa: E731
    results = {"families": {
        "mlstm": {"fast": False, "own": True, "skipped": {}, "lengths": {512: {
            "rows": {"plain forward": row(1.0), "states, own strategy": row(1.9)}, "checks": {"peak_rss_own": 1100 * 2**20, "states_bytes": 1000 * 2**20}}}},
        "short_convolution": {"fast": False, "own": True, "skipped": {}, "lengths": {512: {
            "rows": {"plain forward": row(1.0)}, "checks": {"peak_rss_own": 195 * 2**20, "states_bytes": 72 * 2**20}}}},
        "kimi_delta_attention": {"fast": True, "own": False, "skipped": {2048: "one plain forward projected to take 62 s"}, "lengths": {512: {
            "rows": {"plain forward": row(1.0), "states, fast path": row(1.2), "states, fast path (kernel + states pass)": row(1.05),
                     "set_state_after(mid), fast path": row(1.0)}, "checks": {}}}},
    }}
    found = {(target, where): (value, met, key) for target, where, value, met, key in run.targets(results)}
    assert found[("states ≤ 1.1× (own strategy: no fast path)", "mlstm, L=512")] == (1.9, False, "own_states")
    assert found[("peak memory of a states read (own strategy) ≤ 1.05× the states", "mlstm, L=512")][1] is False
    # States smaller than the forward's own activations are not held to the memory target (the peak would be the forward's).
    assert not any(where == "short_convolution, L=512" and "peak memory" in target for target, where in found)
    assert found[("fast states ≤ 1.1×", "kimi_delta_attention, L=512")][1] is False
    assert found[("fast states (kernel + states pass) ≤ 1.1×", "kimi_delta_attention, L=512")][1] is True
    assert found[("set_state_after(mid), fast path ≤ 1.1×", "kimi_delta_attention, L=512")][1] is True
    assert found[("fast states ≤ 1.1×", "kimi_delta_attention, L=2048")] == (None, None, "skipped")
    results.update(command="python benchmarks/run.py", machine="m", targets=run.targets(results))
    for family in results["families"].values():
        family["tl"] = {"adapter": None, "lengths": {}, "errors": ["boot_transformers: ValueError: no"]}
    text = run.render(results)
    assert "| fast states ≤ 1.1× | kimi_delta_attention, L=2048 | – | not run |" in text
    assert "L=2048 not run: one plain forward projected to take 62 s." in text
    assert "**own_states**" in text and "TransformerLens 4.3: no adapter for this architecture" in text


def test_model_folders_are_named_the_same_in_every_process(tmp_path):
    # str hash() is salted per process: a name made from it changed every run (and every run rebuilt every model).
    import subprocess
    import sys

    code = "from benchmarks import cases, models; print(cases.folder_name('mamba', models.configs(True)['mamba']))"
    names = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert len(names) == 1 and names.pop().startswith("mamba-")


def test_gpu_script_dry_run_checks_fast_against_routed(tmp_path, capsys):
    # The GPU benchmark on tiny models on the CPU: its checks (fast vs routed states and writes) run and pass.
    from benchmarks import gpu

    out = tmp_path / "gpu.md"
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n" + gpu.SECTION + "\nnot run\n" + gpu.END + "\n")
    status = gpu.main(["--cpu-dry-run", "--lengths", "12", "--check-length", "10", "--reps", "1", "--out", str(out), "--page", str(page)])
    text = out.read_text()
    assert status == 0 and "Run finished; checks failed or raised: 0." in text
    assert text.count("| pass |") == 7 and "**fail**" not in text  # 3 + 1 DeltaNet checks, 2 + 1 Mamba-2
    assert text.count("| 12 | 0.") == 2, "a timing row per family"
    assert "not run" not in page.read_text() and page.read_text().count(gpu.SECTION) == 1
    # A brought-back section goes into the page as it is.
    (tmp_path / "back.md").write_text(gpu.SECTION + "\nfrom the GPU\n" + gpu.END + "\n")
    assert gpu.main(["--section", str(tmp_path / "back.md"), "--page", str(page)]) == 0
    assert "from the GPU" in page.read_text() and "Run finished" not in page.read_text()


def test_gpu_script_skips_what_its_budget_would_not_fit(tmp_path, monkeypatch):
    from benchmarks import gpu

    real_check = gpu.check

    def check(name, family, *args):
        real_check(name, family, *args)
        family["per_token_s"] = 1.0  # the projection's input fixed: 8 calls of a second per token

    monkeypatch.setattr(gpu, "check", check)
    out = tmp_path / "gpu.md"
    common = ["--cpu-dry-run", "--check-length", "10", "--reps", "1", "--out", str(out)]
    assert gpu.main([*common, "--budget-s", "600", "--lengths", "12", "--families", "mamba2"]) == 0
    text = out.read_text()
    assert text.count("| pass |") == 3 and "| 12 | 0." in text, "projected 96 s: it runs"
    assert gpu.main([*common, "--budget-s", "600", "--lengths", "1000", "500", "--families", "mamba2"]) == 0
    text = out.read_text()
    assert "| 500 | skipped: projected 4000 s" in text and "| 1000 | skipped: projected 8000 s" in text, text
    assert text.index("| 500 |") < text.index("| 1000 |"), "shortest first"
    assert gpu.main([*common, "--budget-s", "0", "--lengths", "12"]) == 0
    text = out.read_text()
    assert text.count("Skipped: the budget (0 s) was spent before it began.") == 2 and "| pass |" not in text, text


def test_gpu_script_errors_leave_the_other_family_and_length(tmp_path, monkeypatch):
    # An error in one family's checks, and in one length of the other's timing: the rest is measured and written.
    from benchmarks import gpu

    real_check, real_row = gpu.check, gpu.row

    def check(name, *args):
        if name == "mamba2":
            raise RuntimeError("injected into the checks")
        return real_check(name, *args)

    def row(name, family, length, *args):
        if length == 12:
            raise RuntimeError("injected into a row")
        return real_row(name, family, length, *args)

    monkeypatch.setattr(gpu, "check", check)
    monkeypatch.setattr(gpu, "row", row)
    out = tmp_path / "gpu.md"
    assert gpu.main(["--cpu-dry-run", "--lengths", "12", "14", "--check-length", "10", "--reps", "1", "--out", str(out)]) == 1
    text = out.read_text()
    deltanet, mamba = text.split("### mamba2")
    assert deltanet.count("| pass |") == 4 and "| 14 | 0." in deltanet and "injected into a row" in deltanet, text
    assert "injected into the checks" in mamba and "| pass |" not in mamba, text
    assert "| 14 | skipped: no warm trace" in mamba, "no projection without the checks' warm trace"
    assert "Run finished; checks failed or raised: 3." in text  # the checks' error, and a row's in each family


def test_gpu_script_killed_mid_run_leaves_each_finished_table_on_disk(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from benchmarks import gpu

    out, started = tmp_path / "gpu.md", tmp_path / "mamba2-row-started"
    code = (
        "import sys, time; from benchmarks import gpu; real = gpu.row\n"
        "def row(name, *args):\n"
        f"    if name == 'mamba2': open({str(started)!r}, 'w').close(); time.sleep(3600)\n"
        "    return real(name, *args)\n"
        "gpu.row = row\n"
        f"sys.exit(gpu.main(['--cpu-dry-run', '--lengths', '12', '--check-length', '10', '--reps', '1', '--out', {str(out)!r}]))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=Path(gpu.__file__).parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600  # a bound on a stuck run, not a measurement
        while not started.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), "the Mamba-2 row never started"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    text = out.read_text()
    assert text.startswith(gpu.SECTION) and text.endswith(gpu.END + "\n") and "**cut short**" in text
    assert text.count("| pass |") == 7, "both families' checks were written when they finished"
    deltanet, mamba = text.split("### mamba2")
    assert "| 12 | 0." in deltanet and "| 12 |" not in mamba


def test_gpu_script_without_a_gpu_says_so(monkeypatch):
    import torch

    from benchmarks import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 2


def test_the_sweep_target_is_forwards_per_cell_averaged_over_the_kinds():
    row = lambda ratio: {"ratio": ratio, "min": ratio, "max": ratio, "median_s": ratio, "n": 3}  # noqa: E731
    per_cell = {"gated_deltanet": 1.2, "kimi_delta_attention": 1.9, "mamba": 0.7}
    results = {"families": {
        name: {"fast": True, "own": False, "skipped": {}, "lengths": {512: {"rows": {"plain forward": row(1.0), cases.SWEEP_ROW: row(value * cases.SWEEP_CELLS)}, "checks": {}}}}
        for name, value in per_cell.items()
    }}
    found = {(target, where): (value, met) for target, where, value, met, key in run.targets(results) if key == "sweep_cell"}
    each = "knockout_sweep: forwards per cell (each kind's, informative; the target is the mean) ≤ 1.3"
    assert found[(each, "kimi_delta_attention, L=512")] == (pytest.approx(1.9), False)
    assert found[(each, "gated_deltanet, L=512")] == (pytest.approx(1.2), True)
    assert found[("knockout_sweep: forwards per cell, mean over the kinds ≤ 1.3", "every kind, L=512")] == (pytest.approx(1.2666, abs=1e-3), True)


def test_store_script_writes_its_section_and_the_runner_keeps_it(tmp_path):
    # The store rows on the tiny model: the section replaces the page's, and run.write keeps it when the page is rewritten.
    from benchmarks import store

    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n" + store.SECTION + "\nnot run\n" + store.END + "\n")
    text = store.main(["--size", "tiny", "--prompts", "4", "--batch", "2", "--length", "12", "--checkpoint-every", "4", "--reps", "1",
                       "--cache", str(tmp_path / "models"), "--page", str(page)])
    assert text.startswith(store.SECTION) and text.rstrip().endswith(store.END)
    rows = [line for line in text.splitlines() if line.startswith("| collect")]
    assert len(rows) == 3 and all("KiB" in row and "x: " in row for row in rows)  # state_output, factorized, inputs
    assert "not run" not in page.read_text() and page.read_text().count(store.SECTION) == 1
    run.write(str(page), "# Performance\n\nrewritten\n")
    assert page.read_text().count(store.SECTION) == 1 and "rewritten" in page.read_text()


def test_circuits_script_writes_its_section_and_the_runner_keeps_it(tmp_path):
    # edge_attribution's cost on the hybrid toy, two pairs, one repeat: four rows with a positive ratio each.
    from benchmarks import circuits

    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n" + circuits.SECTION + "\nnot run\n" + circuits.END + "\n")
    text = circuits.main(["--pairs", "2", "--steps", "2", "--reps", "1", "--page", str(page)])
    assert text.startswith(circuits.SECTION) and text.rstrip().endswith(circuits.END)
    rows = [line for line in text.splitlines() if line.startswith("| `edge_attribution")]
    assert len(rows) == 4 and all(float(row.split("|")[4].split("x")[0]) > 0 for row in rows)
    assert "not run" not in page.read_text() and page.read_text().count(circuits.SECTION) == 1
    run.write(str(page), "# Performance\n\nrewritten\n")
    assert page.read_text().count(circuits.SECTION) == 1 and "rewritten" in page.read_text()
