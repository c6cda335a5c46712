#!/usr/bin/env bash
# The device call that decides branch ect-prechecked (thirty-seventh session; no device time
# was left to run it): the soft ECT's GPU tests on the branch, then its per-call time against
# main's in alternating processes (bench_soft.py's soft ECT case, 3 rounds; ~3 minutes). The
# branch cuts host time: the forward's launches check their arguments at the first call of a
# plan only, as_c_contiguous replaces CuPy's ascontiguousarray on the call's arrays, and the
# band forward's last block of each row writes that row of the result (no soft_finalize
# launch: four launches a forward instead of five). The GPU ms should hardly move, the call ms
# should drop. The exact ECT's and the grouped soft ECT's band forward (launched with out =
# NULL) are covered by the GPU tests of test_ect.py and test_band_gpu.py.
#
#   here:       mkdir -p ab/old && git archive main cutopo cuda_src benchmarks | tar -x -C ab/old
#   on device:  OUT=... bash benchmarks/wip/ect_prechecked.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -n 14 -m gpu tests/test_band_gpu.py tests/test_ect.py \
    tests/test_checks.py tests/test_jax_adapter.py tests/test_torch_adapter.py -k ect \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"
timeout 120 bash benchmarks/ab_trees.sh ab/old . 3 -- \
    python3 benchmarks/bench_soft.py --no-baseline --only soft_ect > "$OUT/ab_ect.log" 2>&1
grep -E "^\[.*\| (forward|VJP|forward\+VJP) \|" "$OUT/ab_ect.log"
