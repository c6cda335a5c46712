#!/usr/bin/env bash
# Where the exact ECC histogram's instructions and stalls go (fifty-third session): Nsight
# Compute's instruction mix, warp states and per-SASS-address counts of one bench_ecc launch
# per case (white noise, 256 thresholds, as count_instructions.py). Per case NAME:
# NAME_sass.csv (per SASS address: executions, thread instructions, stall samples) and
# NAME_cuda_sass.csv (under the self-contained source's lines) and NAME.log, in hist_ncu.tgz.
#   OUT=... bash benchmarks/wip/ncu_hist.sh ["SHAPE DTYPE NAME" ...]   (default: the three below)
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cat > /tmp/one_hist.py <<'PY'
import sys
import cupy as cp, numpy as np
import cutopo
shape = tuple(int(s) for s in sys.argv[1].split("x")); dtype = sys.argv[2]
rs = cp.random.default_rng(0)
img = rs.integers(0, 256, size=shape, dtype=cp.uint8) if dtype == "uint8" else rs.random(shape, dtype=cp.float32)
t = np.linspace(0, 255, 256) if dtype == "uint8" else np.linspace(0, 1, 256, dtype=np.float32)
cutopo.ecc(img, t); cp.cuda.Device().synchronize()
print("voxels", img.size)
PY
files=()
[ "$#" -gt 0 ] || set -- "256x256x256 float32 h3f" "256x256x256 uint8 h3u" "4096x4096 float32 h2f"
for case in "$@"; do
  set -- $case
  timeout 120 ncu --clock-control none -k regex:ecc_histogram -c 1 \
      --section InstructionStats --section SourceCounters --section WarpStateStats --section Occupancy \
      --metrics smsp__thread_inst_executed.sum,smsp__inst_executed.sum,gpu__time_duration.sum \
      -o /tmp/$3 python3 /tmp/one_hist.py $1 $2 > "$OUT/$3.log" 2>&1
  ncu --import /tmp/$3.ncu-rep --page details >> "$OUT/$3.log" 2>&1
  ncu --import /tmp/$3.ncu-rep --page source --csv --print-source sass > "$OUT/$3_sass.csv" 2>&1
  ncu --import /tmp/$3.ncu-rep --page source --csv --print-source cuda,sass > "$OUT/$3_cuda_sass.csv" 2>&1
  files+=($3.log $3_sass.csv $3_cuda_sass.csv)
  grep -E "voxels|thread_inst_executed|inst_executed.sum|Duration|Executed Ipc|Warp Cycles Per Issued|Achieved Occ" "$OUT/$3.log" | head -12
done
cd "$OUT" && tar czf hist_ncu.tgz "${files[@]}" && rm -f "${files[@]}"
