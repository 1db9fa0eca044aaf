#!/usr/bin/env bash
# Set up (if needed), then run the main job on the embedded defaults: a local stack (Redis, target,
# draft, orchestrator), one generation, the result and its statistics. Extra arguments go to `specdec run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/specdec run "$@"
