#!/usr/bin/env bash
# Fifty-sixth session, call 3: the packed sweep's plane corner from a per-tile corner and the
# plane size (the tree) against HEAD's kernels (ab/old = git archive HEAD cuda_src).
#   device: bash benchmarks/wip/session56_call3.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "3d 256^3 float32" "3d 512^3 float32" "3d 256^3 uint8" "3d 512^3 uint8" "3d 512^3 uint16" "2d 8192^2 float32" "64x1024^2 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --rounds 7 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_old.log"; stamp ab_old
cat "$OUT/ab_old.log"
