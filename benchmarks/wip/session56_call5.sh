#!/usr/bin/env bash
# Fifty-sixth session, call 5: the tree's 3D histograms at 4 blocks per SM against 5 (the
# variant now), then the ECC family's GPU tests.   device: bash benchmarks/wip/session56_call5.sh (carry .whl)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "3d 512^3 float32" "3d 1024^3 float32" "3d 512^3 uint8" "3d 512^3 float64" "3d 256^3 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --variant "5 blocks=-DCUTOPO_ECC_MIN_BLOCKS_3D=5" --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_blocks.log"; stamp ab_blocks
cat "$OUT/ab_blocks.log"
timeout 220 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py tests/test_dask.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
tail -n 4 "$OUT/gpu_tests.log"
