#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. pytest exits non-zero on failures and when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate  # where setup.sh installed, whichever virtual environment was active
python -m pytest -q "$@"
