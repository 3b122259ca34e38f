"""The wheel holds every package under its own namespace: the repository's kernels/ folder installs
as batchgen.kernels (never a top-level `kernels`, which is Hugging Face's package name), with the
C sources the CPU kernels compile on first use."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"])


def _package_dirs() -> set[str]:
    """Every folder holding Python or C sources, named as the wheel installs it."""
    found = set()
    for top, name in ((ROOT / "batchgen", "batchgen"), (ROOT / "kernels", "batchgen.kernels")):
        for folder in [top, *[p for p in top.rglob("*") if p.is_dir()]]:
            if folder.name == "__pycache__" or not any(folder.glob("*.py")) and not any(folder.glob("*.c")):
                continue
            relative = folder.relative_to(top).parts
            found.add(".".join((name, *relative)))
    return found


def test_pyproject_lists_every_package_folder() -> None:
    assert _package_dirs() == _listed_packages()


def test_the_wheel_keeps_kernels_inside_batchgen(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("batchgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert "kernels" not in tops
    assert {"batchgen/kernels/registry.py", "batchgen/kernels/cpu/linear.py"} <= set(names)
    sources = {Path(name).name for name in names if name.startswith("batchgen/kernels/cpu/csrc/")}
    assert {p.name for p in (ROOT / "kernels/cpu/csrc").glob("*.c")} <= sources
    assert any(name.startswith("batchgen/kernels/triton/") for name in names)


def test_a_checkout_on_sys_path_does_not_hide_hugging_faces_kernels() -> None:
    """transformers (5.25 on) imports Hugging Face's `kernels`; run from the checkout's root (pytest,
    `python -m`, a Ray worker) the folder kernels/ comes first on sys.path and must hand the name on."""
    pytest.importorskip("transformers")
    probe = (
        "import importlib.metadata, sys\n"
        "try:\n"
        "    importlib.metadata.version('kernels')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    print('absent'); sys.exit(0)\n"
        "import kernels\n"
        "from transformers import LlamaConfig\n"
        "import batchgen.kernels.registry\n"
        "print(kernels.__file__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    location = result.stdout.strip()
    if location != "absent":
        assert not Path(location).is_relative_to(ROOT / "kernels")
