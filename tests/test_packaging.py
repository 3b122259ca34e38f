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
