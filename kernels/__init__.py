"""Every kernel of batchgen, one folder per target, installed as `batchgen.kernels`.

The repository keeps them in a top-level `kernels/` folder; `pyproject.toml` maps it to
`batchgen.kernels` (setuptools `package-dir`) so an installed batchgen never writes a top-level
`kernels` package (Hugging Face's own `kernels` package, which transformers uses, has that name).

- `triton/`: paged decode attention, chunked-prefill attention over the paged KV cache, the KV-cache write.
- `cpu/`: the C sources (`cpu/csrc/*.c`, built once per machine) and their ctypes wrappers: linear,
  paged attention, fused element-wise ops, the one-call decoder stack.
- `registry.py`: the candidates of each op, timed on the loaded model's shapes where they run; the
  fastest correct one is used, and the table is cached on disk.

Nothing here imports `batchgen.engine`, `batchgen.jobs` or the model's classes.
"""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: the checkout's root is on sys.path (pytest's rootdir,
    # `python -m` run from the checkout, a Ray worker started there) ahead of site-packages, and
    # something asked for Hugging Face's `kernels` (transformers >= 5.25 imports it). This folder is
    # batchgen.kernels, so hand the name to the first `kernels` found outside the checkout.
    import importlib.util
    import os
    import sys
    from importlib.machinery import PathFinder
    from typing import NoReturn

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        # No Hugging Face `kernels` here. transformers' availability check imports the name when it
        # finds no metadata and raises whatever the import raises, so raising would break `import
        # transformers` itself. It counts a module with neither `__version__` nor `__file__` as a
        # namespace package shadowing sys.path, not an install: be that, and answer any other name
        # with the fix.
        del __file__

        def __getattr__(name: str) -> NoReturn:
            raise AttributeError(
                f"no {name!r} here: the top-level `kernels` found first is batchgen's checkout folder "
                "kernels/ (batchgen.kernels), not Hugging Face's `kernels` package (pip install kernels)"
            )
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import system returns what sys.modules holds after this runs
        _spec.loader.exec_module(_module)
