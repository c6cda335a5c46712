#!/usr/bin/env bash
# The device call that decides branch ect-prechecked (thirty-seventh session; no device time
# was left to run it): the GPU suite on the branch, then the soft ECT's per-call time against
# main's in alternating processes (bench_soft.py's soft ECT case, 3 rounds; profile_host.py's
# soft ECT stages, 2 rounds; ~4 minutes). The branch cuts host time: the plan's launches
# check their arguments at the first call of a plan only, as_c_contiguous replaces CuPy's
# ascontiguousarray on the call's arrays, the band forward's last block of each row writes that
# row of the result (no soft_finalize launch: four launches a forward instead of five), and the
# argument check's last block stores its flags in page-locked host memory (a PinnedStatus, as
# CPAB's prepare_cells does: no DeferredFlags copy, event or pinned allocation per call). The
# GPU ms should hardly move, the call ms should drop. The GPU suite covers the exact and
# grouped soft ECT's band forward too (launched with out = NULL) and CPAB's PinnedStatus, now
# from deferred.thread_status. Needs the Dask wheels of .whl for the suite (carry .whl).
#
#   here:       mkdir -p ab/old && git archive main cutopo cuda_src benchmarks | tar -x -C ab/old
#   on device:  OUT=... bash benchmarks/wip/ect_prechecked.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $(ls .whl/*.whl | grep -v 2026.7.1) >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -n 14 -m "gpu and not slow" --ignore-glob="tests/*_host.py" tests \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"
timeout 120 bash benchmarks/ab_trees.sh ab/old . 3 -- \
    python3 benchmarks/bench_soft.py --no-baseline --only soft_ect > "$OUT/ab_ect.log" 2>&1
grep -E "^\[.*\| (forward|VJP|forward\+VJP) \|" "$OUT/ab_ect.log"
timeout 100 bash benchmarks/ab_trees.sh ab/old . 2 -- \
    python3 benchmarks/profile_host.py soft_ect_stages > "$OUT/stages.log" 2>&1
grep -E "soft_ect call|pullback call|device path" "$OUT/stages.log"
