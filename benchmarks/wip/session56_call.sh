#!/usr/bin/env bash
# Fifty-sixth session, one call: the tree's ECC-family GPU tests, float64_one_step.patch against
# HEAD's kernels (ab_ecc.py) with test_ecc_gpu.py on the patched tree, then bench_ecc.py --no-cpu
# and bench_soft.py on the tree.
#   here:   rm -rf ab && mkdir -p ab/old ab/head ab/patched; git archive HEAD cuda_src into ab/old,
#           the patch's files from HEAD into ab/head and, with the patch applied, into ab/patched
#   device: bash benchmarks/wip/session56_call.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
tail -n 4 "$OUT/gpu_tests.log"
cp -r ab/patched/. .
for only in "2d 8192^2 float64" "3d 256^3 float64" "3d 512^3 float64" "2d 8192^2 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab.log"; stamp ab
cat "$OUT/ab.log"
timeout 120 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py > "$OUT/gpu_tests_patched.log" 2>&1
stamp gpu_tests_patched; tail -n 4 "$OUT/gpu_tests_patched.log"
cp -r ab/head/. .
timeout 150 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp bench_ecc
tail -n 30 "$OUT/bench_ecc.log"
timeout 150 python3 benchmarks/bench_soft.py > "$OUT/bench_soft.log" 2>&1; stamp bench_soft
tail -n 30 "$OUT/bench_soft.log"
