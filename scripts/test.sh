#!/usr/bin/env bash
# Set up (if needed), check the types (scripts/typecheck.sh: mypy, seconds once its cache is warm),
# then run the whole test suite. Either failing fails the script; pytest also fails when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate  # where setup.sh installed, whichever virtual environment was active
bash scripts/typecheck.sh
python -m pytest -q "$@"
