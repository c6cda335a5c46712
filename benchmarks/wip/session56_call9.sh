#!/usr/bin/env bash
# Fifty-sixth session, call 9 (not run: no device time left): benchmarks/wip/inv_dt_register.patch
# (1/dt in a general register) against HEAD's kernels (ab/old), then the GPU tests.
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#           git apply benchmarks/wip/inv_dt_register.patch
#   device: bash benchmarks/wip/session56_call9.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ab_cases ab_inv_dt --against ab/old --rounds 5 -- "2d 8192^2 float32" "2d 1024^2 float32" "64x1024^2 float32" \
  "2d 8192^2 float16" "2d 8192^2 uint16" "3d 256^3 float32" "3d 512^3 float32" "3d 512^3 uint16"
ecc_gpu_tests
