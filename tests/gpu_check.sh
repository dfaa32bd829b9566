#!/usr/bin/env bash
# The GPU checks in one prepared script, for a short session on a machine with an NVIDIA GPU
# (ran on this workplace's H200 image on 2026-12-04 in about 65 s: CUDA 13, Python 3.12, CuPy,
# torch and JAX preinstalled, no network; elsewhere it installs what is missing). Not run by
# CI; run it from anywhere as:
#
#   bash tests/gpu_check.sh "$OUT"        # the log folder; default ${OUT:-./gpu-logs}
#
# Steps: record nvidia-smi, the Python version and this checkout's commit (to tell a run
# before a change from one after it); make akv importable: from this checkout
# (PYTHONPATH) when the machine's Python already has CuPy and akv's dependencies (this
# workplace's H200 image: python3 with cupy-cuda13x, torch, jax, aiohttp, pytest, and no
# network), else by installing akv with its test and interop extras and CuPy's CUDA 12 wheel
# (cupy-cuda12x) unless a CuPy already imports; report what
# CuPy sees; run every test marked gpu; run `akv bench device --json`. Each step runs under
# `timeout`, its output tee'd to a log in the folder; a failed step does not stop the later
# ones. A summary comes LAST (each step's exit status, the tests' counts, the bench table),
# also written to summary.txt; the exit status is 1 if any step failed.
#
# Knobs (environment): PYTHON (default python3, else python), CUPY_WHEEL (default
# cupy-cuda12x, the wheel the gpu extra names; cupy-cuda13x for CUDA 13),
# GPU_CHECK_SKIP_INSTALL=1 (a rerun on a machine where the install step already ran), and
# each step's time limit (*_TIMEOUT_S below).
# The folder receives 9 files: nvidia-smi.txt, python-version.txt, checkout.txt, install.log,
# cupy.log, gpu-tests.log, bench-device.log, bench-device.json, summary.txt. The bench's
# table has issue #28's rows (reduce 4 x 64 MiB + pull, SGD and Adam updates of 64 MiB, small
# key push + pull, CuPy to a host key and back, the chained engine task), each against a
# floor measured in the same run, with its target and whether this run met it.
set -euo pipefail

DIR=${1:-${OUT:-./gpu-logs}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd) # relative to where the script was started
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  PYTHON=python
fi
# The checkout's packages come first (an older installed akv must not shadow them).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CUPY_WHEEL=${CUPY_WHEEL:-cupy-cuda12x}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# JAX takes 75% of the GPU's memory at its first use unless told not to; the tests run JAX,
# torch and CuPy in one process.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# The machine is lent for this session only: let pip install into its Python.
export PIP_BREAK_SYSTEM_PACKAGES=${PIP_BREAK_SYSTEM_PACKAGES:-1}

# Seconds each step may take (each can be set in the environment). A normal run takes a few
# minutes; only a run whose every step hangs reaches their sum (about 12 minutes).
MACHINE_TIMEOUT_S=${MACHINE_TIMEOUT_S:-20}
INSTALL_TIMEOUT_S=${INSTALL_TIMEOUT_S:-200}
CUPY_TIMEOUT_S=${CUPY_TIMEOUT_S:-60}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-300}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-150}

STEPS=()
FAILED=0

# step NAME TIMEOUT_S LOG COMMAND...: run COMMAND under `timeout`, output to the screen and to
# $DIR/LOG; record its exit status (124: it ran out of time). Never fails the script itself.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start rc
  start=$(date +%s)
  echo "== $name (at most ${limit} s): $*"
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$DIR/$log"
  rc=${PIPESTATUS[0]}
  set -e
  STEPS+=("$name|$rc|$(($(date +%s) - start))|$log")
  if [ "$rc" -ne 0 ]; then
    FAILED=1
  fi
  return 0
}

step nvidia-smi "$MACHINE_TIMEOUT_S" nvidia-smi.txt nvidia-smi
step python-version "$MACHINE_TIMEOUT_S" python-version.txt "$PYTHON" -VV
step checkout "$MACHINE_TIMEOUT_S" checkout.txt \
  sh -c 'git log -1 --format="%H %cd %s" 2>/dev/null || echo "not a git checkout"; git status --short 2>/dev/null | head -n 20'

if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  echo "== install skipped (GPU_CHECK_SKIP_INSTALL=1)" | tee "$DIR/install.log"
elif "$PYTHON" -c 'import cupy, akv, akv_engine, akv_transport, pytest, torch' >/dev/null 2>&1; then
  echo "== install not needed: CuPy, torch, pytest and this checkout's akv import" \
    | tee "$DIR/install.log"
else
  INSTALL=(-e '.[test,interop]')
  if "$PYTHON" -c 'import cupy' >/dev/null 2>&1; then
    echo "== CuPy already imports: $CUPY_WHEEL is not installed"
  else
    INSTALL+=("$CUPY_WHEEL")
  fi
  step install "$INSTALL_TIMEOUT_S" install.log "$PYTHON" -m pip install -q "${INSTALL[@]}"
fi

step cupy "$CUPY_TIMEOUT_S" cupy.log "$PYTHON" -c '
import sys
import cupy
from akv_engine import gpu_available
runtime = cupy.cuda.runtime
print("cupy", cupy.__version__, "runtime", runtime.runtimeGetVersion(),
      "driver", runtime.driverGetVersion(), "devices", runtime.getDeviceCount())
print("akv_engine.gpu_available():", gpu_available())
cupy.show_config()
import numpy
print("numpy", numpy.__version__)
for name in ("torch", "jax", "aiohttp", "uvloop"):
    try:
        module = __import__(name)
    except ImportError as exc:
        print(name, "not importable:", exc)
    else:
        print(name, getattr(module, "__version__", "?"))
sys.exit(0 if gpu_available() else 1)
'

step gpu-tests "$TESTS_TIMEOUT_S" gpu-tests.log \
  "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider
# Every GPU test skipped (no CuPy, no GPU seen) checks nothing: that is a failure here.
if grep -qE '[0-9]+ passed' "$DIR/gpu-tests.log"; then
  STEPS+=("some-gpu-test-ran|0|0|gpu-tests.log")
else
  STEPS+=("some-gpu-test-ran|1|0|gpu-tests.log")
  FAILED=1
fi

step bench-device "$BENCH_TIMEOUT_S" bench-device.log \
  "$PYTHON" -m akv bench device --json "$DIR/bench-device.json"

# ------------------------------------------------------------------------------ summary
summary() {
  echo
  echo "=================== gpu_check summary ($DIR) ==================="
  printf '%-18s %-14s %8s  %s\n' step status seconds log
  local entry name rc seconds log status
  for entry in "${STEPS[@]}"; do
    IFS='|' read -r name rc seconds log <<<"$entry"
    case $rc in
      0) status=ok ;;
      124 | 137) status="TIMED OUT($rc)" ;;
      *) status="FAILED($rc)" ;;
    esac
    printf '%-18s %-14s %8s  %s\n' "$name" "$status" "$seconds" "$log"
  done
  echo
  local last counts
  last=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$DIR/gpu-tests.log" \
    | tail -n 1 || true)
  counts=$(echo "$last" | grep -oE '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)' \
    | paste -sd ',' - | sed 's/,/, /g' || true)
  echo "GPU tests (pytest -m gpu): ${counts:-no counts found, see gpu-tests.log}"
  grep -E '^(FAILED|ERROR|SKIPPED)' "$DIR/gpu-tests.log" | head -n 20 || true
  echo
  if grep -q '^akv bench device' "$DIR/bench-device.log" 2>/dev/null; then
    sed -n '/^akv bench device/,$p' "$DIR/bench-device.log"
  else
    echo "akv bench device: no table (see bench-device.log):"
    tail -n 5 "$DIR/bench-device.log" 2>/dev/null || true
  fi
  echo
  if [ "$FAILED" -ne 0 ]; then
    echo "gpu_check: a step failed (see above)"
  else
    echo "gpu_check: every step passed"
  fi
}

summary | tee "$DIR/summary.txt"
exit "$FAILED"
