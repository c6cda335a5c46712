#!/usr/bin/env bash
# Fifty-sixth session, call 7: the 3D histograms at 3 and 5 blocks per SM against the tree's 4,
# with float64 volumes (0.9 % faster at 5 in calls 4-5).   device: bash benchmarks/wip/session56_call7.sh (carry .whl)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "3d 512^3 float32" "3d 1024^3 float32" "3d 512^3 uint8" "3d 256^3 float64" "3d 512^3 float64" "3d 512^3 uint16"; do
  timeout 80 python3 benchmarks/ab_ecc.py --variant "3 blocks=-DCUTOPO_ECC_MIN_BLOCKS_3D=3" \
    --variant "5 blocks=-DCUTOPO_ECC_MIN_BLOCKS_3D=5" --rounds 5 --only "$only" 2>&1 | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_blocks.log"; stamp ab_blocks
cat "$OUT/ab_blocks.log"
