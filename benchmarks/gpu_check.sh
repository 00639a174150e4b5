#!/usr/bin/env bash
# The GPU check in one command, on a bare GPU machine with a copy of this repository and the
# wheels benchmarks/gpu_prepare.py put in .gpu_check/wheels:
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--wheels DIR] [--cpu-dry] [--parts …] [--limit …]
#
# Runs benchmarks/gpu_check.py (the parts, their time limits, the report: see there) with the
# machine's Python, which writes report.md and the logs to DIR ($OUT by default) and exits 1 if
# a check failed. This wrapper picks the Python and makes sure a report comes back even when the
# check itself cannot start or is cut short: it then writes one saying so, and exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[i]}" = "--out" ] && [ $((i + 1)) -lt ${#args[@]} ]; then out="${args[i + 1]}"; fi
done
if [ -z "$out" ]; then
  out=.gpu_check/out
  echo "gpu_check.sh: no --out folder (or an empty one: is \$OUT set?); writing to $out" >&2
fi
mkdir -p "$out" || exit 2

# the machine's Python: $PYTHON if given, else the first of python3, python that imports CuPy,
# else the first that imports NumPy
python="${PYTHON:-}"
for module in cupy numpy; do
  for candidate in python3 python; do
    if [ -z "$python" ] && command -v "$candidate" >/dev/null &&
      "$candidate" -c "import $module" 2>/dev/null; then
      python="$(command -v "$candidate")"
    fi
  done
done
if [ -z "$python" ]; then
  status=127
  echo "gpu_check.sh: no python3 or python on PATH that imports NumPy" | tee "$out/setup.log" >&2
else
  rm -f "$out/report.md"
  "$python" benchmarks/gpu_check.py "$@" --out "$out"
  status=$?
fi

if [ ! -s "$out/report.md" ]; then
  {
    echo "# zerosim GPU check"
    echo
    echo "**Failed: the check did not start or was cut short** (exit status $status of" \
      "benchmarks/gpu_check.py under ${python:-no Python}); the logs in this folder show how far it went."
  } >"$out/report.md"
  [ "$status" -eq 0 ] && status=1
fi
exit "$status"
