#!/usr/bin/env bash
# Set up (if needed) and run the default test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1
.venv/bin/python -m specdec.genproto --check
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
