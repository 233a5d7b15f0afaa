"""The GPU run's device command, run on the CPU from the carried wheels with only what the GPU machine's image has.

The device machine reaches no registry: what its image lacks travels as wheels (`scripts/carry_gpu_wheels.sh`,
downloaded here for this Python) and is installed by the one command in `benchmarks/gpu.py`'s docstring, offline
(``--no-index --no-deps --target``). Here the image is stood in for by this environment's distributions that the
image's list names (``IMAGE``, from the GPU machine image's package list, read on 2026-11-17), linked into a folder put on the
path after the carried one, and a ``python3`` that runs without this environment's site-packages (``-S``). Then
the command runs as written, with ``--cpu-dry-run`` added to the two scripts, and every requirement of nnterp and of
the carried wheels must be met by the carried folder or the image, at the image's versions where its package list gives them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
#: The image's versions where the image's pip list gives them (transformers' is below nnterp's range: it must be carried).
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "jaxtyping": "0.3.11", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
}
#: Given by the image and not walked: their own needs (CUDA libraries named per build) are the image's.
LEAVES = ("torch", "triton")
#: Run by the image-only python3: every requirement below nnterp's dependencies and the carried wheels, met.
WALK = r"""
import re, sys
from importlib import metadata
from packaging.requirements import Requirement

site, image_versions, leaves, roots = sys.argv[1], eval(sys.argv[2]), eval(sys.argv[3]), sys.argv[4:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
found = {}
for dist in metadata.distributions():  # in sys.path's order: the carried folder first
    found.setdefault(norm(dist.metadata["Name"]), dist)
carried = [name for name, dist in found.items() if str(dist.locate_file("")).startswith(site)]
todo, seen, problems = [Requirement(r) for r in roots] + [Requirement(name) for name in carried], set(), []
while todo:
    req = todo.pop()
    name, dist = norm(req.name), found.get(norm(req.name))
    if dist is None:
        problems.append(f"{req} (wanted, in neither the carried wheels nor the image)")
        continue
    here = str(dist.locate_file("")).startswith(site)
    version = dist.version if here else image_versions.get(name, dist.version)
    if not req.specifier.contains(version, prereleases=True):
        problems.append(f"{req}: {'carried' if here else 'the image has'} {version}")
    if name in seen or name in leaves or not here:
        continue  # the image's own packages need what the image holds
    seen.add(name)
    for line in dist.requires or []:
        sub = Requirement(line)
        if sub.marker is None or sub.marker.evaluate({"extra": ""}):
            todo.append(sub)
print("\n".join(sorted(set(problems))) or "every requirement met")
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_command() -> str:
    from benchmarks import gpu

    lines = [line.strip() for line in gpu.__doc__.splitlines() if line.strip().startswith("python3 -m pip install")]
    assert len(lines) == 1, "benchmarks/gpu.py's docstring gives the device command once"
    return lines[0]


def image_site(folder: Path) -> Path:
    """This environment's distributions that the image has, linked into ``folder`` (their top-level files)."""
    from packaging.requirements import Requirement

    folder.mkdir()
    wanted, todo = set(IMAGE), ["torch"]
    while todo:  # and torch's own needs, whatever this build names them (its CUDA libraries): the image's torch has its
        try:
            lines = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for line in lines:
            need = Requirement(line)
            if norm(need.name) not in wanted and (need.marker is None or need.marker.evaluate({"extra": ""})):
                wanted.add(norm(need.name))
                todo.append(need.name)
    for dist in metadata.distributions():
        if norm(dist.metadata["Name"]) not in wanted:
            continue
        for file in dist.files or ():
            top = file.parts[0]
            if top != ".." and not (folder / top).exists():
                os.symlink(dist.locate_file(top), folder / top)
    return folder


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The device command, run once in a stand-in of the device machine's repository root."""
    root = tmp_path_factory.mktemp("device")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(["bash", str(ROOT / "scripts/carry_gpu_wheels.sh"), str(root / "repo/.whl"), python], check=True, timeout=600)
    for name in ("nnterp", "benchmarks", "scripts"):
        os.symlink(ROOT / name, root / "repo" / name)
    base = image_site(root / "image")
    bin_ = root / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then exec {sys.executable} "$@"; fi\n'
        f'PYTHONPATH="$PYTHONPATH:{base}" exec {sys.executable} -S -s "$@"\n'
    )
    (bin_ / "python3").chmod(0o755)
    site, out = root / "site", root / "out"
    out.mkdir()
    command = (
        device_command().replace("/tmp/site", str(site))
        .replace("benchmarks/gpu.py", "benchmarks/gpu.py --cpu-dry-run --lengths 12 --check-length 10 --reps 1")
        .replace("scripts/gpu_check.py", "scripts/gpu_check.py --cpu-dry-run --kinds qwen3_5_text")
    )
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(out), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "-c", command], cwd=root / "repo", env=env, capture_output=True, text=True, timeout=600)
    return {"done": done, "site": site, "base": base, "out": out, "bin": bin_, "env": env}


def test_the_device_command_runs_both_scripts_from_the_carried_wheels(ran):
    done, out = ran["done"], ran["out"]
    logs = done.stdout + done.stderr
    assert (ran["site"] / "nnsight").is_dir() and (ran["site"] / "fla").is_dir(), logs
    text = (out / "gpu.md").read_text() if (out / "gpu.md").exists() else logs
    assert "Run finished; checks failed or raised: 0." in text and text.count("| pass |") >= 7, text
    assert "nnsight 0.8.1" in text and "flash-linear-attention 0.6.0" in text, text
    checks = (out / "gpu_check.txt").read_text() if (out / "gpu_check.txt").exists() else logs
    found = re.search(r"(\d+) of (\d+) checks passed", checks)
    assert found and found.group(1) == found.group(2) and int(found.group(1)) >= 8, checks


def test_every_requirement_is_met_by_the_carried_wheels_or_the_image(ran):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib

    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"] + ["flash-linear-attention"]
    env = {**ran["env"], "PYTHONPATH": str(ran["site"])}
    walked = subprocess.run(
        [str(ran["bin"] / "python3"), "-c", WALK, str(ran["site"]), repr(IMAGE_VERSIONS), repr(LEAVES), *roots],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert walked.stdout.strip() == "every requirement met", walked.stdout + walked.stderr


def test_the_performance_page_gives_the_same_device_command():
    page = (ROOT / "docs/performance.md").read_text()
    section = page[page.index("<!-- gpu:"):page.index("<!-- /gpu -->")]
    assert device_command() in section
