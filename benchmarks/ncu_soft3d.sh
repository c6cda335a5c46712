#!/usr/bin/env bash
# Where the 3D soft forward's instructions go (thirty-eighth session): Nsight Compute's
# instruction mix and per-SASS-instruction execution counts of one 256^3 float32 forward
# (bench_soft's smooth volume, T = 256, entries kept as the VJP's forward keeps them).
# soft3d_sass.csv: one row per SASS address (executions, thread instructions, stall samples);
# soft3d_cuda_sass.csv: the same under the lines of the self-contained source
# (cutopo._cuda.source.family_source("ecc")); an inlined instruction is listed under each of
# its lines, so sum per address. benchmarks/sass_lines.py gives the static view here.
#   OUT=... bash benchmarks/ncu_soft3d.sh    (PYTHONPATH as device_run.sh sets it)
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
cat > /tmp/one_forward.py <<'PY'
import sys; sys.path.insert(0, "benchmarks")
import cupy as cp, numpy as np
from bench_soft import smooth_image
from cutopo import _soft_ecc_cupy
from cutopo._band_numpy import band_halfwidth
T = 256
image = smooth_image(cp, (256, 256, 256), 3, 2.0, 7).astype(np.float32)
t = cp.asarray(np.linspace(0, 1, T).astype(np.float32))
lam = np.float32(4.0 * (T - 1))
out, kept = _soft_ecc_cupy.soft_ecc_forward(image, t, lam, band_halfwidth(np.dtype(np.float32), lam), 3, False, keep=True)
cp.cuda.Device().synchronize()
print("entries", int(kept[0].get()), "voxels", image.size)
PY
timeout 100 ncu --clock-control none -k regex:soft_ecc_fused_forward -c 1 \
    --section InstructionStats --section SourceCounters --section WarpStateStats \
    --metrics smsp__thread_inst_executed.sum,smsp__inst_executed.sum \
    -o /tmp/soft3d python3 /tmp/one_forward.py > "$OUT/ncu_soft3d.log" 2>&1
ncu --import /tmp/soft3d.ncu-rep --page details >> "$OUT/ncu_soft3d.log" 2>&1
ncu --import /tmp/soft3d.ncu-rep --page source --csv --print-source sass > "$OUT/soft3d_sass.csv" 2>&1
ncu --import /tmp/soft3d.ncu-rep --page source --csv --print-source cuda,sass > "$OUT/soft3d_cuda_sass.csv" 2>&1
cd "$OUT" && tar czf soft3d.tgz ncu_soft3d.log soft3d_sass.csv soft3d_cuda_sass.csv && rm -f soft3d_sass.csv soft3d_cuda_sass.csv
grep -E "entries|inst_executed|Executed Ipc|Warp Cycles" ncu_soft3d.log | head -20
