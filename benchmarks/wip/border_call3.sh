#!/usr/bin/env bash
# Third device call (fifty-third session): the tree (f8ecc9e with the grouped row reads in two
# instances, the row end read early, the ring slot in 32 bits) against f8ecc9e (ab/v1); 3D
# tiles of 64 rows (HIST_TALL_ROWS_3D=8) as a setting.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for only in "3d 512^3 float32" "8192^2 float64" "3d 256^3 float32"; do
  timeout 50 python3 benchmarks/ab_ecc.py --against ab/v1 --setting "tall3d=HIST_TALL_ROWS_3D=8" --rounds 3 --only "$only" 2>&1 | grep -E "^\| (case|[23]d)"
done > "$OUT/ab.log"; stamp ab
cat "$OUT/ab.log"
