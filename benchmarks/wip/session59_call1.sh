#!/usr/bin/env bash
# Fifty-ninth session, call 1 (carry .whl and ab): the shared histogram in interleaved copies
# (HistSink adds every pixel, zeros included, to its lane's copy: no select): the whole GPU
# suite on it (after the A/B's first cases: little device time was left), the A/B against 5cfe31d's kernels
# (ab/old: zeros to a word of the lane's own), with 16 and 1 copies at most besides the
# default 32 (the same kernel, the host's HIST_COPIES_MAX), issue 2's table (bench_ecc.py
# --no-cpu), the A/B's small cases.
source benchmarks/wip/device_setup.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/copies.txt"
import numpy as np, cupy as cp
from cutopo import _ecc_cupy as e
for shape, nd, dt in [((8192, 8192), 2, "float32"), ((8192, 8192), 2, "uint8"), ((8192, 8192), 2, "float64"),
                      ((512,) * 3, 3, "float32"), ((512,) * 3, 3, "uint8"), ((1024, 1024), 2, "float32")]:
    t = np.linspace(0, 1, 256, dtype=np.float32) if dt == "float32" else np.linspace(0, 255, 256)
    p = e.HistogramPlan(shape[-nd:], 1, np.dtype(dt), t, nd, False)
    print(shape, dt, "copies", p.copies, "shared", p.shared_mem, "cumulate", p.cumulate, p.sig.name)
PY
V="--against ab/old --variant c16=HIST_COPIES_MAX=16 --variant c1=HIST_COPIES_MAX=1 --rounds 3"
ab_cases copies_noise $V -- "2d 8192^2 float32" "2d 8192^2 uint8" "3d 512^3 float32"
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 12 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -2 "$OUT/gpu_suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_suite.log" | head -10; stamp suite
ab_cases copies_smooth $V --smooth -- "2d 8192^2 float32" "3d 512^3 float32"
timeout 140 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp ecc
grep -E "^\| (2d|3d)|copy|MET|MISSED|NOT MEASURED" "$OUT"/bench_ecc.log | cut -c1-220
ab_cases copies_small $V --small -- "2d 1024^2 float32" "3d 128^3 float32" "2d 1024^2 bool"
