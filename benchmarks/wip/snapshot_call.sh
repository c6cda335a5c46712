#!/usr/bin/env bash
# One device call: where every open issue stands on the committed tree (~9 min): the GPU suite,
# bench_ecc (issue 2), bench_soft (issue 3), bench_cpab (issue 4), bench_stream's Dask rows
# (issue 8). Logs into $OUT (at most 8 files come back). Carry .whl; timeout 590.
source benchmarks/wip/device_setup.sh
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } \
    | tee "$OUT/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -2 "$OUT/gpu_suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_suite.log" | head -10; stamp suite
timeout 130 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp ecc
timeout 110 python3 benchmarks/bench_soft.py > "$OUT/bench_soft.log" 2>&1; stamp soft
timeout 100 python3 benchmarks/bench_cpab.py > "$OUT/bench_cpab.log" 2>&1; stamp cpab
timeout 70 python3 benchmarks/bench_stream.py --quick --only chunks --reps 9 > "$OUT/bench_stream.log" 2>&1; stamp stream
grep -E "MET|MISSED|NOT MEASURED" "$OUT"/bench_*.log | cut -c1-200
