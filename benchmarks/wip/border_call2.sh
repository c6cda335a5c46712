#!/usr/bin/env bash
# Second device call (fifty-third session): the 2D 8192^2 rows again (float64 read 8 % slower
# in call 1), bench_ecc on the new tree, Nsight Compute's per-address view of the histogram.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
timeout 120 python3 benchmarks/ab_ecc.py --against ab/old --rounds 7 --only "2d 8192^2" > "$OUT/ab_8192.log" 2>&1; stamp ab
cat "$OUT/ab_8192.log"
timeout 150 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp bench
grep -E "^\| (2d|3d)|MET|MISSED|copy" "$OUT/bench_ecc.log" | cut -c1-200
timeout 120 bash benchmarks/wip/ncu_hist.sh; stamp ncu
ls "$OUT"
