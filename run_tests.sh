#!/usr/bin/env bash
# The whole test suite from a fresh clone: ./run_tests.sh [pytest arguments…]
#
# Creates .venv on first use, installs zerosim with its test extra (pytest, hypothesis, the
# notebook runner, ruff, numba, and PyTorch CPU and DeepSpeed 0.19.8 as the oracles), then runs
# ruff over the code and pytest over tests/ (which also launches real mpirun and torchrun jobs).
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -x .venv/bin/python ]; then
  echo "run_tests.sh: creating .venv (first run only)…" >&2
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import zerosim, torch, pytest, hypothesis, nbmake, deepspeed, numba, array_api_strict, array_api_compat" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test]"
fi
.venv/bin/ruff check zerosim tests benchmarks
exec .venv/bin/python -m pytest "$@"
