#!/usr/bin/env bash
# One device call (fifty-third session): the packed sweep's edge tiles on the row-read path.
# Needs ab/old (git archive HEAD cutopo cuda_src benchmarks); carry .whl and ab; timeout 590.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
timeout 170 python3 benchmarks/ab_ecc.py --against ab/old --rounds 3 > "$OUT/ab_large.log" 2>&1; stamp large
cat "$OUT/ab_large.log"
timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --small --rounds 3 > "$OUT/ab_small.log" 2>&1; stamp small
cat "$OUT/ab_small.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 12 -m gpu tests/test_ecc_gpu.py tests/test_band_gpu.py \
    tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1; stamp tests
tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -10
timeout 80 bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/bench_soft.py --only "soft_ecc 2d" \
    --no-baseline > "$OUT/ab_soft.log" 2>&1; stamp soft
grep -E "soft_ecc" "$OUT/ab_soft.log" | cut -c1-160
timeout 100 bash benchmarks/wip/ncu_hist.sh; stamp ncu
