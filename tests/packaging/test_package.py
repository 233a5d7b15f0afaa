"""The package as it ships: `pip install .` gives the 2.0 pre-release, its license, and its type marker."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_version() -> str:
    return re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)


def _setuptools_reads_spdx() -> bool:
    from packaging.version import Version

    try:
        import setuptools
    except ImportError:
        return False
    return Version(setuptools.__version__) >= Version("77")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """`pip install --no-deps --no-build-isolation --target` of a copy of the project (the checkout stays clean)."""
    work = tmp_path_factory.mktemp("pkg")
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "nnterp", source / "nnterp", ignore=shutil.ignore_patterns("__pycache__"))
    target = work / "site"
    # With this environment's setuptools when it reads an SPDX license (>= 77, pyproject's build requirement);
    # an older one (a fresh Python 3.11 venv's) makes pip fetch the build requirement, as `pip install .` does.
    isolation = ["--no-build-isolation"] if _setuptools_reads_spdx() else []
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation, "--no-compile",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    return target


def test_version_is_a_2_0_pre_release():
    from packaging.version import Version

    version = Version(_pyproject_version())
    assert version.release[:2] == (2, 0) and version.is_prerelease, version


def test_a_source_checkout_reports_its_own_pyproject_version():
    import nnterp

    assert nnterp.__version__ == _pyproject_version()


@pytest.mark.timeout(180)
def test_pip_install_reports_the_version_from_its_metadata(installed):
    # The installed copy first on the path: its metadata and its files win over any editable install.
    out = subprocess.run(
        [sys.executable, "-c", "import nnterp, importlib.metadata as m; "
         "print(nnterp.__version__); print(nnterp.__file__); print(m.version('nnterp'))"],
        env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}, cwd=installed,
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout.split("\n")
    assert out[0] == _pyproject_version() == out[2]
    assert Path(out[1]).resolve().is_relative_to(installed.resolve())


def test_the_wheel_carries_license_type_marker_and_metadata(installed):
    assert (installed / "nnterp" / "py.typed").is_file()
    (dist_info,) = installed.glob("nnterp-*.dist-info")
    meta = (dist_info / "METADATA").read_text()
    assert "License-Expression: MIT" in meta
    assert "Classifier: Typing :: Typed" in meta
    assert "Project-URL:" in meta
    assert any(path.name == "LICENSE" for path in dist_info.rglob("LICENSE"))


def test_readme_names_the_nnsight_line():
    assert "nnterp 2 for nnsight 0.8" in (ROOT / "README.md").read_text()
