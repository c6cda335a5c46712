#!/usr/bin/env bash
# One device call for stream_once.patch (forty-ninth session; benchmarks/RESULTS.md): the soft
# ECC forward and backward read the current stream once (the workspace, the check word's arm,
# the arrays made ahead and every launch take it; ~0.3 us a read on the device hosts, five
# reads fewer a forward+VJP, three of them before the first launch), and RepeatedCalls.key
# reads the contiguity flag inline. CPU tests passed on it (the emulated soft ECC kernels
# check the stream handed to the launches). ~2 min.
#
# Here first, from the repository root:
#   mkdir -p ab/old && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
#   git apply benchmarks/wip/stream_once.patch
# then run this with carry [".whl", "ab"]; commit the patch's changes (removing it and this
# script) if the tests pass and the calls are not slower.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_band_gpu.py tests/test_expected_euler_gpu.py \
    tests/test_cpab_gpu.py -k "soft_ecc or repeated or made_ahead" > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"; stamp tests
for r in 1 2 3; do for tree in ab/old .; do
  printf "[$tree $r] "
  PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 30 python3 $tree/benchmarks/bench_soft.py --only soft_ecc \
      --no-baseline 2>&1 | grep -E "forward\+VJP \|" | grep -v "<=" | awk -F'|' '{printf "%s %s/%s; ", $2, $5, $6}'
  echo
done; done
stamp ab
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -3 "$OUT/gpu_suite.log"; stamp suite
