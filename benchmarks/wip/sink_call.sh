#!/usr/bin/env bash
# Fifty-eighth session, call 1 (ran on 4ef35e1; the variant has been the default since ad605e8,
# so its A/B now compares equal kernels; carry .whl; timeout 595): the sink's dump variant (ecc.cu CUTOPO_ECC_SINK_DUMP: the shared reduction of every
# pixel unconditional, zero contributions to a lane's own word, bin T and the outside key
# (T + 1 in the variant) to slots T and T + 1 past the histogram, both contributions from one
# subtraction, keys by byte permutes; sm_90 SASS, a thread's plane step: 2D float32 560 -> 497
# instructions (10 rows), uint8 668 -> 592 (12), float64 454 -> 408 (8), 3D float32 541 -> 515
# (4 rows), uint8 542 -> 517 (4 B of spill where none)) against
# the tree on white noise and smooth images; plan_diag.py's 2048^2 question (ab_ecc.py's 32-row
# replay 25 us against bench_ecc.py's 21 us); the GPU suite (histogram_shared_bytes now holds
# slots T and T + 1) and bench_ecc.py --no-cpu.
source benchmarks/wip/device_setup.sh
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } \
    | tee "$OUT/env.txt"
# (a fresh machine compiles each instance twice, tree and variant: ~4 min for the A/B)
ab_cases dump_noise --variant "dump=-DCUTOPO_ECC_SINK_DUMP" --rounds 3 -- \
  "2d 8192^2 float32" "2d 8192^2 uint8" "2d 8192^2 float64" "3d 512^3 float32" "3d 512^3 uint8"
ab_cases dump_smooth --variant "dump=-DCUTOPO_ECC_SINK_DUMP" --rounds 3 --smooth -- \
  "2d 8192^2 float32" "2d 8192^2 uint8" "3d 512^3 float32"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -2 "$OUT/gpu_suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_suite.log" | head -10; stamp suite
for m in 2 1; do timeout 60 python3 benchmarks/wip/plan_diag.py $m; done > "$OUT/plan_diag.log" 2>&1
stamp plan_diag; cut -c1-400 "$OUT/plan_diag.log"
timeout 130 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp ecc
grep -E "^\| (2d|3d)|copy|MET|MISSED|NOT MEASURED" "$OUT"/bench_ecc.log | cut -c1-220
