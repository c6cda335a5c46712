#!/usr/bin/env bash
# Fifty-eighth session, call 1 (carry .whl; timeout 590): plan_diag.py's 2048^2 question (ab_ecc.py's
# 32-row replay 25 us against bench_ecc.py's 21 us, with HIST_TALL_MIN_TILES 2 and 1), then where
# issues 2 and 3 stand on the committed tree (after an A/B of the sink's dump variant,
# CUTOPO_ECC_SINK_DUMP): the GPU suite, bench_ecc.py --no-cpu, bench_soft.py.
source benchmarks/wip/device_setup.sh
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } \
    | tee "$OUT/env.txt"
for m in 2 1; do timeout 60 python3 benchmarks/wip/plan_diag.py $m; done > "$OUT/plan_diag.log" 2>&1
stamp plan_diag; cut -c1-400 "$OUT/plan_diag.log"
ab_cases sink_dump --variant "dump=-DCUTOPO_ECC_SINK_DUMP" --rounds 3 -- \
  "2d 8192^2 float32" "2d 8192^2 uint8" "3d 512^3 float32" "3d 256^3 uint8"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -2 "$OUT/gpu_suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_suite.log" | head -10; stamp suite
timeout 130 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp ecc
timeout 110 python3 benchmarks/bench_soft.py > "$OUT/bench_soft.log" 2>&1; stamp soft
grep -E "^\| (2d|3d|soft|expected)|copy|MET|MISSED|NOT MEASURED" "$OUT"/bench_*.log | cut -c1-220
