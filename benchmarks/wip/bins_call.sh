#!/usr/bin/env bash
# Fifty-fifth session, the call for the estimate's one-step bins and the packed sweep's shared
# table: ab_ecc.py against HEAD's kernels, the ECC family's GPU tests, bench_ecc.py's float rows.
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#   device: bash benchmarks/wip/bins_call.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
for only in "3d 256^3 float32" "3d 512^3 float32" "2d 8192^2 float32" "2d 1024^2 float32" "64x1024^2 float32" "3d 512^3 uint16" "2d 8192^2 float16" "3d 1024^3 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab.log"; stamp ab
timeout 300 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
timeout 90 python3 benchmarks/bench_ecc.py --no-cpu --only float > "$OUT/bench_ecc.log" 2>&1; stamp bench
cat "$OUT/ab.log"; tail -n 4 "$OUT/gpu_tests.log"; tail -n 20 "$OUT/bench_ecc.log"
