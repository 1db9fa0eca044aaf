#!/usr/bin/env bash
# Set up (if needed) and run the default test suite. Extra arguments go to pytest (one plain run).
#
# Without arguments the suite runs in two parts: the tests that only count (equivalence, distributions, units)
# spread over SPECDEC_TEST_WORKERS pytest-xdist workers (default: the CPU count, at most 4), then the
# timing-sensitive ones (marker `serial`: deadlines, stall bounds, batch windows, the benchmark) alone, so no
# other test competes with them for the cores. SPECDEC_TEST_WORKERS=1 runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1
.venv/bin/python -m specdec.ops.genproto --check
pytest=(.venv/bin/python -m pytest -q -ra --durations=15)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
cpus=$(OMP_NUM_THREADS= nproc)  # nproc alone would answer OMP_NUM_THREADS (1, exported above)
workers=${SPECDEC_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}
if [ "$workers" -le 1 ]; then
  exec "${pytest[@]}"
fi
echo "== part 1: tests not marked serial, on $workers workers"
# worksteal: a worker that runs out takes queued tests from the other; with the longest modules collected first
# (tests/conftest.py) the part ends on short tests instead of one worker finishing a long one alone.
"${pytest[@]}" -n "$workers" --dist worksteal -m "not heavy and not serial"
echo "== part 2: timing-sensitive tests (marker serial), one at a time"
"${pytest[@]}" -m "not heavy and serial"
