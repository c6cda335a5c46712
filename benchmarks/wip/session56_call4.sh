#!/usr/bin/env bash
# Fifty-sixth session, call 4: the 3D histograms at 4 blocks per SM (64 registers, no spills)
# against 5 (48, the tree's then), the ECC family's GPU tests on the tree, then bench_ecc.py
# --no-cpu and bench_soft.py.   device: bash benchmarks/wip/session56_call4.sh    (carry .whl)
# Call 5 (the tree at 4 blocks): VARIANT="5 blocks=-DCUTOPO_ECC_MIN_BLOCKS_3D=5" BENCH=0.
VARIANT=${VARIANT:-"4 blocks=-DCUTOPO_ECC_MIN_BLOCKS_3D=4"}
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "3d 256^3 float32" "3d 512^3 float32" "3d 1024^3 float32" "3d 256^3 uint8" "3d 512^3 uint8" "3d 512^3 uint16" "3d 512^3 float64"; do
  timeout 60 python3 benchmarks/ab_ecc.py --variant "$VARIANT" --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_blocks.log"; stamp ab_blocks
cat "$OUT/ab_blocks.log"
timeout 220 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py tests/test_dask.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
tail -n 4 "$OUT/gpu_tests.log"
[ "${BENCH:-1}" = 1 ] || exit 0
timeout 150 python3 benchmarks/bench_ecc.py --no-cpu > "$OUT/bench_ecc.log" 2>&1; stamp bench_ecc
grep -E "^#|^\|" "$OUT/bench_ecc.log" | tail -n 30
timeout 150 python3 benchmarks/bench_soft.py > "$OUT/bench_soft.log" 2>&1; stamp bench_soft
grep -E "^\|" "$OUT/bench_soft.log" | tail -n 28
