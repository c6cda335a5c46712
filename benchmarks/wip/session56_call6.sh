#!/usr/bin/env bash
# Fifty-sixth session, call 6: the 3D plan's constants at 4 blocks per SM (ab_ecc.py --setting),
# and the 2D histograms at 5 blocks per SM (48 registers, no spills) against 6 (40, the tree's).
#   device: bash benchmarks/wip/session56_call6.sh        (carry .whl)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "3d 256^3 float32" "3d 512^3 float32" "3d 1024^3 float32" "3d 512^3 uint8"; do
  timeout 80 python3 benchmarks/ab_ecc.py --setting "bp1=HIST_BLOCK_PLANES=1" --setting "bp4=HIST_BLOCK_PLANES=4" \
    --setting "w8=HIST_WAVES_3D=8" --setting "w32=HIST_WAVES_3D=32" --setting "zc32=HIST_ZCHUNK_MAX=32" \
    --rounds 5 --only "$only" 2>&1 | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_3d.log"; stamp ab_3d
cat "$OUT/ab_3d.log"
for only in "2d 8192^2 float32" "2d 1024^2 float32" "64x1024^2 float32" "2d 8192^2 uint8" "2d 8192^2 float64" "2d 4096^2 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --variant "5 blocks=-DCUTOPO_ECC_MIN_BLOCKS=5" --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_2d.log"; stamp ab_2d
cat "$OUT/ab_2d.log"
