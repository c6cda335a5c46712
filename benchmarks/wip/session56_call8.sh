#!/usr/bin/env bash
# Fifty-sixth session, call 8 (not run: no device time left): 2D tiles of 80, 96 and 128 rows
# (10, 12 and 16 rows per thread; the tree's 64 = 8) through ab_ecc.py --setting, and the tree
# with benchmarks/wip/row_ends_loop.patch (row ends by a loop, two a thread in tiles of 128
# rows) against HEAD's kernels (ab/old), then the GPU tests.
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#           git apply benchmarks/wip/row_ends_loop.patch
#   device: bash benchmarks/wip/session56_call8.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ab_cases ab_rows --against ab/old --setting "r10=HIST_TALL_ROWS=10" --setting "r12=HIST_TALL_ROWS=12" \
  --setting "r16=HIST_TALL_ROWS=16" --rounds 5 -- "2d 8192^2 float32" "2d 8192^2 float64" "2d 8192^2 uint8" \
  "2d 8192^2 float16" "64x1024^2 float32" "2d 4096^2 float32" "2d 8192^2 uint16"
ab_cases ab_3d --against ab/old --rounds 5 -- "3d 256^3 float32" "3d 512^3 float32" "3d 512^3 uint8"
ecc_gpu_tests
