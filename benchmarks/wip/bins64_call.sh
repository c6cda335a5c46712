#!/usr/bin/env bash
# Fifty-fifth session: float64_one_step.patch (applied to the tree) against HEAD's kernels, then the
# ECC family's GPU tests.
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#           git apply benchmarks/wip/float64_one_step.patch
#   device: bash benchmarks/wip/bins64_call.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
for only in "2d 8192^2 float64" "3d 256^3 float64" "3d 512^3 float64" "2d 8192^2 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab.log"; stamp ab
cat "$OUT/ab.log"
timeout 300 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
tail -n 4 "$OUT/gpu_tests.log"
