# Sourced by the device-call scripts here: the wheels carried in .whl/ installed into /tmp/site
# (the device reaches no package registry), the environment of their Python runs, $OUT, and
# ``stamp NAME`` (seconds since the setup, also into $OUT/stamps.txt).
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $(ls .whl/*.whl | grep -v 2026.7.1) >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/stamps.txt"; }
# ``ab_cases NAME [ab_ecc.py options...] -- CASE...``: ab_ecc.py with those options on each case
# (its --only), the table rows into $OUT/NAME.log and to stdout.
ab_cases() {
  local name=$1 opts=()
  shift
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  shift
  local only
  for only in "$@"; do
    timeout 80 python3 benchmarks/ab_ecc.py "${opts[@]}" --only "$only" 2>&1 | grep -E "^\| (case|[23]d)|Error|error"
  done > "$OUT/$name.log"
  stamp "$name"
  cat "$OUT/$name.log"
}
# ``ecc_gpu_tests``: the ECC family's GPU tests into $OUT/gpu_tests.log, their tail to stdout.
ecc_gpu_tests() {
  timeout 220 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
    tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1
  stamp gpu_tests
  tail -n 4 "$OUT/gpu_tests.log"
}
