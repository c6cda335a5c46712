#!/usr/bin/env bash
# Fifty-sixth session, call 8: 2D tiles of 80, 96 and 128 rows (10, 12 and 16 rows per thread;
# the tree's 64 = 8) through ab_ecc.py --setting, and the tree (row ends by a loop, two a thread
# in tiles of 128 rows) against HEAD's kernels (ab/old = git archive HEAD cuda_src).
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#           git apply benchmarks/wip/row_ends_loop.patch
#   device: bash benchmarks/wip/session56_call8.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "2d 8192^2 float32" "2d 8192^2 float64" "2d 8192^2 uint8" "2d 8192^2 float16" "64x1024^2 float32" "2d 4096^2 float32" "2d 8192^2 uint16"; do
  timeout 80 python3 benchmarks/ab_ecc.py --against ab/old --setting "r10=HIST_TALL_ROWS=10" \
    --setting "r12=HIST_TALL_ROWS=12" --setting "r16=HIST_TALL_ROWS=16" \
    --rounds 5 --only "$only" 2>&1 | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_rows.log"; stamp ab_rows
cat "$OUT/ab_rows.log"
for only in "3d 256^3 float32" "3d 512^3 float32" "3d 512^3 uint8"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_3d.log"; stamp ab_3d
cat "$OUT/ab_3d.log"
timeout 220 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
tail -n 4 "$OUT/gpu_tests.log"
