#!/usr/bin/env bash
# Fifty-sixth session, call 2: the shared table read at an address biased once (the tree) against
# HEAD's kernels (ab/old), then the tile-column tests patch on top of the tree (ab/tile) against
# the tree; the ECC family's GPU tests on the tree.
#   here:   rm -rf ab && mkdir -p ab/old ab/tile; git archive HEAD cuda_src into ab/old; the
#           tree's cuda_src with benchmarks/wip/tile_column_tests.patch applied into ab/tile
#   device: bash benchmarks/wip/session56_call2.sh        (carry .whl and ab)
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for only in "3d 256^3 float32" "3d 512^3 float32" "2d 8192^2 float32" "2d 1024^2 float32" "64x1024^2 float32" "3d 512^3 uint16" "2d 8192^2 float16" "2d 8192^2 uint16"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/old --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_old.log"; stamp ab_old
cat "$OUT/ab_old.log"
for only in "3d 256^3 float32" "3d 256^3 uint8" "3d 512^3 float32" "2d 8192^2 float64" "2d 8192^2 float32"; do
  timeout 60 python3 benchmarks/ab_ecc.py --against ab/tile --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab_tile.log"; stamp ab_tile
cat "$OUT/ab_tile.log"
timeout 200 python3 -m pytest -q -n 14 -m "gpu and not slow" tests/test_ecc_gpu.py tests/test_band_gpu.py \
  tests/test_stream_gpu.py tests/test_periodic.py > "$OUT/gpu_tests.log" 2>&1; stamp gpu_tests
tail -n 4 "$OUT/gpu_tests.log"
