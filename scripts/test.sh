#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. pytest exits non-zero on failures and when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
[ -n "${VIRTUAL_ENV:-}" ] || source .venv/bin/activate
python -m pytest -q "$@"
