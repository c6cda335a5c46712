#!/usr/bin/env bash
# Fifty-seventh session, call 2: the tree (1/dt in a register; 2D tall tiles by itemsize,
# _ecc_cupy.tall_rows) -- the ECC family's GPU tests, then ab_ecc.py: the tree against its
# kernels with HEAD's 64-row tiles (r8) and against HEAD's kernels with the tree's tiles
# (ab/old), then bench_ecc.py --no-cpu.
#   here:   rm -rf ab && mkdir -p ab/old && git archive 14fc45c cuda_src | tar -x -C ab/old
#   device: bash benchmarks/wip/session57_call2.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ecc_gpu_tests
ab_cases ab_tall --against ab/old --setting "r8=HIST_TALL_ROWS={1: 8, 2: 8, 4: 8, 8: 8}" --rounds 5 -- \
  "2d 8192^2 float32" "2d 8192^2 float64" "2d 8192^2 uint8" "2d 8192^2 uint16" "2d 8192^2 float16" \
  "2d 8192^2 int16" "2d 8192^2 int32" "2d 8192^2 bool" "64x1024^2" "2d 4096^2 float32" "3d 512^3 float32"
timeout 150 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp bench_ecc
grep -E "^\| (2d|3d|size)|MET|MISSED|copy" "$OUT/bench_ecc.log" | cut -c1-200
