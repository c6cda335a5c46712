#!/usr/bin/env bash
# One device call for the forty-ninth session's two parked patches (benchmarks/RESULTS.md), ~5 min:
#  * stream_once.patch: the soft ECC forward and backward read the current stream once (the
#    workspace, the check word's arm, the arrays made ahead and every launch take it; ~0.3 us
#    a read on the device hosts, three reads fewer before the 3D forward's first launch), and
#    RepeatedCalls.key reads the contiguity flag inline;
#  * fallback_waves.patch (on top of it): the listed 3D forward's fallback launches (the
#    overflowed images' fused forward and the backward's sweep of them), which exit at once on
#    smooth volumes, on FALLBACK_WAVES (1) wave of blocks instead of ~1400 one-tile blocks.
# CPU tests passed on both (the emulated kernels run the fallback launches with several tiles
# a block on noise). Wanted: the soft ECC GPU tests, the per-call A/B on smooth volumes
# (bench_soft) and the noise case that the fallback geometry may slow (profile_listed.py).
#
# Here first, from the repository root:
#   mkdir -p ab/old ab/stream && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
#   git apply benchmarks/wip/stream_once.patch
#   tar -c --exclude=__pycache__ cutopo cuda_src benchmarks | tar -x -C ab/stream
#   git apply benchmarks/wip/fallback_waves.patch
# then run this with carry [".whl", "ab"]. Commit what is not slower (removing the patches
# and this script): stream_once alone if the fallback geometry loses on noise more than it
# gains on smooth volumes.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_band_gpu.py tests/test_expected_euler_gpu.py \
    tests/test_cpab_gpu.py -k "soft_ecc or repeated or made_ahead" > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"; stamp tests
for r in 1 2 3; do for tree in ab/old ab/stream .; do
  printf "[$tree $r] "
  PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 30 python3 $tree/benchmarks/bench_soft.py --only soft_ecc \
      --no-baseline 2>&1 | grep -E "forward\+VJP \|" | grep -v "<=" | awk -F'|' '{printf "%s %s/%s; ", $2, $5, $6}'
  echo
done; done
stamp ab
for r in 1 2; do for tree in ab/stream .; do for noise in "" --noise; do
  printf "[$tree $r] "
  PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 60 python3 $tree/benchmarks/profile_listed.py --only 256^3 \
      $noise 2>&1 | tail -1
done; done; done
stamp profile
# issue 3's table on the patched tree (the baseline on the same run), for RESULTS
timeout 120 python3 benchmarks/bench_soft.py --only soft_ecc > "$OUT/bench_soft.log" 2>&1
grep -E "forward\+VJP|copy" "$OUT/bench_soft.log" | head -8; stamp bench
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 -m "gpu and not slow" tests \
    --ignore=tests/test_soft_ecc_kernels_host.py > "$OUT/gpu_suite.log" 2>&1
tail -3 "$OUT/gpu_suite.log"; stamp suite
