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
