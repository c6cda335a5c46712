#!/usr/bin/env bash
# The thirty-eighth session's one device call (its budget went mostly on refused starts):
# branch ect-prechecked's GPU suite and its soft ECT against main's (bench_soft, alternating
# processes, 2 rounds), then Nsight Compute of the 3D soft forward (ncu_soft3d.sh) and the 3D soft forward against main's
# (plane_slot's unsigned arithmetic). Logs in
# one archive, stamps as it goes, so a cut-off run still says how far it came.
#   here: mkdir -p ab/old && git archive main cutopo cuda_src benchmarks | tar -x -C ab/old
set -uo pipefail
OUT=${OUT:-/tmp/out}
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/stamps.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $(ls .whl/*.whl | grep -v 2026.7.1) >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
stamp setup
timeout 150 python3 -m pytest -q -n 14 -m "gpu and not slow" --ignore-glob="tests/*_host.py" tests \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"; stamp tests
timeout 100 bash benchmarks/ab_trees.sh ab/old . 2 -- \
    python3 benchmarks/bench_soft.py --no-baseline --only soft_ect > "$OUT/ab_ect.log" 2>&1
grep -E "^\[.*\| (forward|VJP|forward\+VJP) \|" "$OUT/ab_ect.log"; stamp ab_ect
OUT=$OUT timeout 130 bash benchmarks/wip/ncu_soft3d.sh; stamp ncu
# plane_slot by unsigned arithmetic (this tree) against main: the 3D soft forward alone
timeout 100 bash benchmarks/ab_trees.sh ab/old . 2 -- \
    python3 benchmarks/profile_soft.py --forward-3d > "$OUT/ab_3d.log" 2>&1
grep -E "^\[.*(##|forward)" "$OUT/ab_3d.log" | head -60; stamp ab_3d
cd "$OUT" && tar czf s38.tgz ./*.log ./*.txt && rm -f ./*.log ./*.txt
