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
