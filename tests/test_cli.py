"""The command line, run as a user runs it: ``python -m nnterp`` in a subprocess, on tiny checkpoints."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nnterp.__main__ import main
from nnterp.families import REGISTRY, families
from nnterp.testing import tiny_checkpoint

ROUTE_HINT = "nnterp.route_kernels(model.family, 'torch')"


def nnterp_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nnterp", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_help():
    done = nnterp_cli("--help")
    assert done.returncode == 0, done.stderr
    assert "usage: nnterp" in done.stdout and "demo" in done.stdout and "support" in done.stdout


@pytest.mark.parametrize("command, words", [("demo", ("--model", "--out", "--no-sweep")), ("support", ("ID_OR_PATH", "--routed"))])
def test_help_of_each_command(command, words, capsys):
    # In process: the subprocess path is the same parser, and each start costs seconds of imports.
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: nnterp {command}")
    assert all(word in out for word in words)


def test_no_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main([])
    assert exit.value.code != 0 and "usage: nnterp" in capsys.readouterr().err


def test_support_prints_layers_by_values_with_reasons():
    done = nnterp_cli("support", str(tiny_checkpoint("qwen3_5_text")))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "4 layers, as loaded" in lines[0]
    header = next(line for line in lines if line.startswith("value"))
    assert header.split()[-4:] == ["0", "1", "2", "3"]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.startswith(("layer.", "linear_attn.", "self_attn."))}
    assert rows["layer.layer_output"] == ["+"] * 4
    assert rows["linear_attn.state_output"] == ["+", "+", "+", "-"]  # block 3 is softmax attention
    assert rows["self_attn.attention_output"] == ["-", "-", "-", "+"]
    code = rows["linear_attn.states"][0]
    assert rows["linear_attn.states"] == [code] * 3 + ["-"] and code not in "+-"
    reason = next(line for line in lines if line.strip().startswith(f"{code}:"))
    assert "token-by-token kernel" in reason and ROUTE_HINT in reason
    assert "--routed" in done.stdout
    # The circuits rows are model-wide: one line, each node kind served or a reason's letter.
    circuits_line = next(line for line in lines if line.startswith("circuits:"))
    kinds = dict(item.split() for item in circuits_line[len("circuits: "):].split(", "))
    assert all(kinds[kind] == "+" for kind in ("embed", "logits", "attention_heads", "mixer_heads", "mixers", "mlp"))
    positional = next(line for line in lines if line.strip().startswith(f"{kinds['positional']}:"))
    assert "enable_attention_probs=True" in positional
    assert not any(line.startswith("circuits.") for line in lines)


def test_support_routed_serves_the_states():
    done = nnterp_cli("support", "qwen3_5_text", "--routed")  # a tiny checkpoint's name works too
    assert done.returncode == 0, done.stderr
    assert "after nnterp.route_kernels" in done.stdout
    states = next(line for line in done.stdout.splitlines() if line.startswith("linear_attn.states"))
    assert states.split()[1:] == ["+", "+", "+", "-"]


def test_support_reads_the_config_alone(tmp_path):
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(tiny_checkpoint("mamba") / "config.json", only / "config.json")  # no weights, no tokenizer
    done = nnterp_cli("support", str(only))
    assert done.returncode == 0, done.stderr
    assert "mamba" in done.stdout and "2 layers" in done.stdout
    assert any(line.startswith("linear_attn.state_output") for line in done.stdout.splitlines())


def test_demo_runs_on_the_trained_toys_by_default(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    (tmp_path / "toys").mkdir()  # a folder named like the default, where the demo runs, does not shadow it
    done = nnterp_cli("demo", "--out", str(out), "--samples", "40", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert "the trained toys" in text and "toy 'deltanet'" in text and "toy 'hybrid'" in text
    assert "the state after every token" in text and "effective attention" in text
    rates = dict(re.findall(r"(state \+ window|state alone|window alone|clean answer) ([01]\.\d\d)", text))
    assert float(rates["state + window"]) >= 0.9  # the recurrent-only toy answers the donor's value
    assert "the model answers 'v" in text and "so on this hybrid the recall runs through" in text
    for name in ("toy_state_norms.png", "toy_effective_attention.png", "toy_swap.png", "toy_hybrid.png"):
        png = out / name
        assert png.stat().st_size > 5_000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_walks_the_recipe_and_writes_plots(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    done = nnterp_cli("demo", "--model", "qwen3_5_text", "--out", str(out), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    for section in ("what each layer serves", "the state leaving the prompt", "the state after every token", "a patch:", "a sweep:"):
        assert section in text, section
    assert "recurrent mixers at [0, 1, 2]" in text
    assert "linear_attn.states" in text and ROUTE_HINT in text  # the support table, with its reason
    assert "states[:, -1] == state_output: True" in text
    assert "'The'" in text  # a row per token of the prompt
    assert "clean:" in text and "patched:" in text and "total variation" in text
    for name in ("state_norms.png", "head_norms.png", "patch_effect.png", "patch_sweep.png"):
        png = out / name
        assert png.stat().st_size > 5_000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_on_a_model_without_a_recurrent_mixer(tmp_path):
    done = nnterp_cli("demo", "--model", "llama", "--out", str(tmp_path / "plots"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "self_attn.attention_output" in done.stdout and "no recurrent mixer" in done.stdout
    assert not (tmp_path / "plots").exists()


def test_support_of_a_missing_folder_says_so(tmp_path):
    done = nnterp_cli("support", str(tmp_path / "nothing-here"))
    assert done.returncode == 2
    assert "no folder exists at that path" in done.stderr and "Traceback" not in done.stderr


def _recurrent_types() -> list:
    return [family.NAME for family in families() if family.MIXER is not None]


@pytest.mark.parametrize("model_type", _recurrent_types())
def test_demo_runs_on_every_recurrent_familys_tiny_checkpoint(model_type, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code = main(["demo", "--family", model_type, "--out", str(tmp_path / "plots"), "--no-sweep", "--quiet"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert f"nnterp demo: {model_type}" in text and "the state leaving the prompt" in text
    # Bit for bit from a token loop; to float rounding where the states are computed from the kernel's arguments (mLSTM).
    close = re.search(r"states\[:, -1\] == state_output: to (\S+) \(computed from the kernel call's arguments\)", text)
    assert "states[:, -1] == state_output: True" in text or (close is not None and float(close.group(1)) < 1e-5)
    assert (tmp_path / "plots" / "state_norms.png").stat().st_size > 5_000


@pytest.mark.parametrize("model_type", [family.NAME for family in families()])
def test_support_prints_every_familys_table_from_its_tiny_checkpoint(model_type, capsys):
    assert main(["support", str(tiny_checkpoint(model_type))]) == 0
    text = capsys.readouterr().out
    assert "layer_output" in text
    if REGISTRY[model_type].MIXER is not None:
        assert "linear_attn.state_output" in text


def _one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """A refusal as the CLI gives it: nonzero exit, one line on stderr (no traceback) holding ``words``."""
    assert done.returncode != 0, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def _config_folder(tmp_path: Path, text: str | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    if text is not None:
        (folder / "config.json").write_text(text)
    return folder


@pytest.mark.parametrize(
    "text, words",
    [
        (None, ("has no config.json", "save_pretrained")),
        ("{not json", ("is not valid JSON", "fix its config.json")),
        ('{"hidden_size": 8}', ("no `model_type`", "fix its config.json")),
        ("[1, 2]", ("JSON list", "fix its config.json")),
        ('{"model_type": "qwen3", "hidden_size": [1]}', ("hidden_size", "fix its config.json")),
    ],
    ids=["empty-folder", "invalid-json", "no-model-type", "json-list", "wrong-field-type"],
)
def test_support_of_a_broken_folder_is_one_line(tmp_path, text, words):
    _one_line_error(nnterp_cli("support", str(_config_folder(tmp_path, text))), "nnterp support:", *words)


def test_demo_on_cuda_without_cuda_is_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for one without")
    _one_line_error(nnterp_cli("demo", "--device", "cuda", "--out", str(tmp_path / "plots"), cwd=tmp_path), "--device cpu")


def test_demo_out_under_a_file_is_refused_before_it_runs(tmp_path):
    (tmp_path / "file").write_text("")
    done = nnterp_cli("demo", "--out", str(tmp_path / "file" / "plots"), "--no-sweep", cwd=tmp_path)
    _one_line_error(done, "is a file", "another --out")
    assert "nnterp demo:" not in done.stdout  # nothing ran


def test_demo_of_an_unknown_family_names_the_valid_ones(tmp_path):
    from nnterp.testing import MODEL_TYPES

    line = _one_line_error(nnterp_cli("demo", "--family", "nonexistent", "--out", str(tmp_path / "plots"), cwd=tmp_path), "'nonexistent'")
    assert all(name in line for name in MODEL_TYPES)


def test_the_demo_says_where_it_writes_and_the_readme_names_nnterp_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "NNTERP_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "nnterp", "demo", "--model", "llama", "--out", str(tmp_path / "plots")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    built = [path for path in cache.iterdir() if path.name.startswith("llama-")]
    assert len(built) == 1  # the checkpoint went where NNTERP_CACHE says, and the demo names it
    assert f"the tiny checkpoint is kept at {built[0]}" in done.stdout and "NNTERP_CACHE" in done.stdout
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "NNTERP_CACHE" in readme and "~/.cache/nnterp/tiny" in readme


def test_transformers_reference_kernel_notice_is_said_once_per_process(tmp_path):
    """Two loads of two families that fall back to four reference kernels between them: one line, not one per kernel."""
    code = (
        "import torch, nnterp\n"
        "from nnterp.testing import tiny_checkpoint\n"
        "for model_type in ('mamba', 'qwen3_5_text', 'mamba'):\n"
        "    model = nnterp.StandardizedTransformer(str(tiny_checkpoint(model_type)), dispatch=True, device='cpu')\n"
        "    with torch.no_grad(), model.trace('Hello world'):\n"
        "        model.logits.save()\n"
        "    print('loaded', model_type, flush=True)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("loaded") == 3
    notices = [line for line in done.stderr.splitlines() if "falling back to its reference PyTorch implementation" in line]
    assert len(notices) == 1, notices
    assert "once per process" in notices[0]
