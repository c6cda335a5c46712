#!/usr/bin/env bash
# One device call for fallback_hint.patch (the fifty-first session; benchmarks/RESULTS.md), ~4 min.
# The patch: the listed 3D forward's fallback launches (the fused forward of the images whose
# list overflowed, the backward's sweep of them) on FALLBACK_WAVES (1) wave of blocks instead of
# the sweep's full grid, unless the plan's previous checked call overflowed an image's list,
# which that call's list sweep notes in the pinned check word's second word. Measured in the
# fifty-first session without the hint (H100): smooth 256^3 fallback launches 5.1 -> 4.4 and
# 5.5 -> 4.7 us (3D per call 0.300-0.304 -> 0.2985-0.2992 ms), white noise 3.47 -> 3.53 ms. With
# the hint a noise loop should keep the full grid (as HEAD) and a smooth loop gain as above.
# CPU tests pass (tests/test_soft_ecc_kernels_host.py: test_fallback_grid_follows_the_previous_call).
#
# Here first, from the repository root:
#   mkdir -p ab/old && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
#   git apply benchmarks/wip/fallback_hint.patch
# then run this with carry [".whl", "ab"], timeout ~360. Commit the patch if smooth gains and
# noise (--full-fallback, what a loop on noise takes after its first call) stays at HEAD's.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_band_gpu.py -k "soft_ecc or repeated or made_ahead" \
    > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"; stamp tests
for r in 1 2 3; do for tree in ab/old .; do
  printf "[$tree $r] "
  PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 30 python3 $tree/benchmarks/bench_soft.py --only "soft_ecc 3d" \
      --no-baseline 2>&1 | grep -E "forward\+VJP \|" | grep -v "<=" | awk -F'|' '{printf "%s %s/%s; ", $2, $5, $6}'
  echo
done; done
stamp ab
for r in 1 2; do
  for run in "ab/old --noise" ". --noise --full-fallback" ". --noise" "ab/old" "."; do
    set -- $run; tree=$1; shift
    printf "[$tree $* $r] "
    PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 40 python3 $tree/benchmarks/profile_listed.py --only 256^3 "$@" \
        2>&1 | tail -1 | sed 's/; sums.*//'
  done
done
stamp profile
timeout 120 python3 benchmarks/bench_soft.py --only soft_ecc > "$OUT/bench_soft.log" 2>&1
grep -E "forward\+VJP|copy" "$OUT/bench_soft.log" | head -8; stamp bench
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -3 "$OUT/gpu_suite.log"; stamp suite
