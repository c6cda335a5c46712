#!/usr/bin/env bash
# Fifty-seventh session, call 3: HIST_TALL_MIN_TILES 1 -- the ECC family's GPU tests and
# bench_ecc.py --no-cpu's 2D rows.   device: bash benchmarks/wip/session57_call3.sh (carry .whl)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ecc_gpu_tests
timeout 100 python3 benchmarks/bench_ecc.py --no-cpu --only "2d" > "$OUT/bench_ecc.log" 2>&1; stamp bench_ecc
grep -E "^\| (2d|3d|case)|MET|MISSED|copy" "$OUT/bench_ecc.log" | cut -c1-200
