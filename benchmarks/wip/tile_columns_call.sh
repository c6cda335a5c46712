#!/usr/bin/env bash
# One device call for benchmarks/wip/tile_column_tests.patch (fifty-fourth session's Next 2):
#   here:   rm -rf ab && mkdir -p ab/old && git archive HEAD cuda_src | tar -x -C ab/old
#           git apply benchmarks/wip/tile_column_tests.patch
#   device: OUT=... bash benchmarks/wip/tile_columns_call.sh      (carry .whl and ab)
source benchmarks/wip/device_setup.sh
for only in "3d 256^3 float32" "3d 256^3 uint8" "3d 512^3 float32" "8192^2 float64" "8192^2 float32"; do
  timeout 45 python3 benchmarks/ab_ecc.py --against ab/old --rounds 5 --only "$only" 2>&1 \
    | grep -E "^\| (case|[23]d)|Error|error"
done > "$OUT/ab.log"; stamp ab
cat "$OUT/ab.log"
