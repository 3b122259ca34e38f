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


def _run_in_checkout(probe: str) -> subprocess.CompletedProcess:
    """`python -c probe` from the checkout's root (so kernels/ is first on sys.path); it must succeed."""
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


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
    result = _run_in_checkout(probe)
    location = result.stdout.strip()
    if location != "absent":
        assert not Path(location).is_relative_to(ROOT / "kernels")


def test_a_checkout_on_sys_path_without_hugging_faces_kernels_still_imports_transformers() -> None:
    """Without Hugging Face's `kernels` (transformers 5.17 on the GPU machine had none), the checkout's
    folder must not break transformers' availability check, which imports the name and raises what the
    import raises: it stands in as an empty namespace-like module (no `__version__`, no `__file__`,
    which transformers counts as absent) and names the fix for anything asked of it. Hugging Face's
    package is hidden from the finder and from the installed metadata, as on a machine without it."""
    pytest.importorskip("transformers")
    probe = (
        "import importlib.machinery\n"
        "find = importlib.machinery.PathFinder.find_spec\n"
        "def hide(name, path=None, target=None):\n"
        "    # the checkout's kernels/__init__.py looks for Hugging Face's package with an explicit path\n"
        "    return None if name == 'kernels' and path is not None else find(name, path, target)\n"
        "importlib.machinery.PathFinder.find_spec = hide\n"
        "import importlib.metadata as metadata\n"
        "version, owners = metadata.version, metadata.packages_distributions\n"
        "def no_version(name):\n"
        "    if name == 'kernels':\n"
        "        raise metadata.PackageNotFoundError(name)\n"
        "    return version(name)\n"
        "metadata.version = no_version\n"
        "metadata.packages_distributions = lambda: {k: v for k, v in owners().items() if k != 'kernels'}\n"
        "import kernels\n"
        "assert getattr(kernels, '__version__', 'N/A') == 'N/A'\n"
        "assert getattr(kernels, '__file__', None) is None\n"
        "try:\n"
        "    kernels.get_kernel\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
        "try:\n"
        "    from kernels import get_kernel\n"
        "    raise SystemExit('imported get_kernel from the stand-in')\n"
        "except ImportError:\n"
        "    pass\n"
        "import transformers.activations\n"
        "import batchgen.kernels.registry\n"
    )
    result = _run_in_checkout(probe)
    assert "pip install kernels" in result.stdout
