#!/usr/bin/env bash
# mypy over every module of batchgen, kernels/ included (settings: pyproject.toml [tool.mypy]).
# scripts/test.sh runs it before the tests. `bash scripts/typecheck.sh FILE...` checks those files
# instead (with what they import of batchgen), in the same settings and cache.
#
# kernels/ installs as batchgen.kernels (pyproject's package-dir), a mapping mypy cannot follow from
# the source tree, so it reads a tree of links with the installed layout: build/typecheck/batchgen
# holds a link to each entry of batchgen/, and batchgen/kernels links to kernels/. Paths in its
# messages are those of that layout (batchgen/kernels/cpu/linear.py is kernels/cpu/linear.py).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
tree=build/typecheck/batchgen
rm -rf "$tree"
mkdir -p "$tree"
for entry in batchgen/*; do
  ln -s "$root/$entry" "$tree/"
done
ln -s "$root/kernels" "$tree/kernels"
targets=(-p batchgen)
if [ $# -gt 0 ]; then
  targets=()
  for file in "$@"; do
    targets+=("$(cd "$(dirname "$file")" && pwd)/$(basename "$file")")
  done
fi
cd build/typecheck
exec python -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" "${targets[@]}"
