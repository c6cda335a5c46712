#!/usr/bin/env bash
# Sixtieth session, call 1 (carry .whl and ab): the float bin guess one-sided (round((v - t0)
# / dt) clamped by FFMA.SAT, one table word, one comparison) and uint8 bytes as their own
# bins (thresholds 0..255; --bins 200: the table, as before): the A/B against 2885a61's
# kernels (ab/old), the ECC family's GPU tests, the new extreme-thresholds test on 2885a61's whole
# package (ab/oldfull: it should fail there), issue 2's table (bench_ecc.py --no-cpu), Nsight
# Compute's counts of the 2D float32 histogram. Not run in the sixtieth session (no device
# machine lent). Before the call, here:
#   rm -rf ab && mkdir -p ab/old ab/oldfull && git archive 2885a61 cuda_src | tar -x -C ab/old \
#     && git archive 2885a61 cutopo cuda_src | tar -x -C ab/oldfull
# then run it with carry [".whl", "ab"] (about 400 s of wall time; the tail is optional).
source benchmarks/wip/device_setup.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
V="--against ab/old --rounds 3"
ab_cases bins $V -- "2d 8192^2 float32" "3d 512^3 float32" "2d 8192^2 uint8" "3d 512^3 uint8" \
    "2d 8192^2 uint16" "2d 8192^2 float64"
ab_cases bins_u8_table $V --bins 200 -- "2d 8192^2 uint8" "3d 512^3 uint8"
ecc_gpu_tests; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -10
(cd ab/oldfull && timeout 60 python3 -m pytest -q -p no:cacheprovider ../../tests/test_ecc_gpu.py -k extreme \
    > "$OUT/extreme_old.log" 2>&1); tail -n 7 "$OUT/extreme_old.log"; stamp extreme_old
timeout 140 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp ecc
grep -E "^\| (2d|3d)|copy|MET|MISSED|NOT MEASURED" "$OUT"/bench_ecc.log | cut -c1-220
bash benchmarks/wip/ncu_hist.sh "8192x8192 float32 h2f"; stamp ncu
ab_cases bins2 $V -- "2d 8192^2 float16" "3d 512^3 float64" "2d 64x1024^2 float32"
ab_cases bins_smooth $V --smooth -- "2d 8192^2 float32" "3d 512^3 float32"
