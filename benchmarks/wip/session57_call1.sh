#!/usr/bin/env bash
# Fifty-seventh session, call 1: the fifty-sixth session's parked calls 8 and 9 in one call.
# The working tree is HEAD; this script applies each patch to the device's copy in turn,
# compares it against HEAD's kernels (ab/old) and restores cuda_src/. No GPU tests: HEAD's
# kernels are 658d409's, which passed them (fifty-sixth session, call 5).
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#   device: bash benchmarks/wip/session57_call1.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
with_patch() {  # with_patch PATCH: cuda_src/ = HEAD's + PATCH
  rm -rf cuda_src && cp -r ab/old/cuda_src cuda_src
  patch -s -p1 < "$1" || { echo "patch $1 failed"; exit 1; }
}
with_patch benchmarks/wip/inv_dt_register.patch
ab_cases ab_inv_dt --against ab/old --rounds 5 -- "2d 8192^2 float32" "64x1024^2 float32" \
  "2d 8192^2 uint16" "3d 256^3 float32" "3d 512^3 float32" "3d 512^3 uint16"
with_patch benchmarks/wip/row_ends_loop.patch
ab_cases ab_rows --against ab/old --setting "r10=HIST_TALL_ROWS=10" --setting "r12=HIST_TALL_ROWS=12" \
  --setting "r16=HIST_TALL_ROWS=16" --rounds 5 -- "2d 8192^2 float32" "2d 8192^2 float64" "2d 8192^2 uint8" \
  "64x1024^2 float32" "2d 4096^2 float32" "2d 8192^2 uint16"
ab_cases ab_rows_3d --against ab/old --rounds 5 -- "3d 256^3 float32" "3d 512^3 float32" "3d 512^3 uint8"
rm -rf cuda_src && cp -r ab/old/cuda_src cuda_src
