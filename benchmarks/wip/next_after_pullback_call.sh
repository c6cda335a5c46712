#!/usr/bin/env bash
# One device call for next_after_pullback.patch (forty-eighth session; benchmarks/RESULTS.md):
# a cutopo.vjp soft_ecc call makes its next call's arrays after its pullback's launches
# (Residual.make_next) instead of after its forward's, where in 2D they lengthened the GPU's
# wait for the backward launch (~15 us of allocations on the H100 host). The emulated kernel
# tests passed on it (without a GPU). ~2 min.
#
# Here first, from the repository root:
#   mkdir -p ab/old && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
#   git apply benchmarks/wip/next_after_pullback.patch
# then run this with carry [".whl", "ab"]; commit the patch's changes (removing it and this
# script) if the tests pass and the calls are not slower.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_band_gpu.py \
    -k "made_ahead or keeps_no_entries or forward_and_vjp_match or repeated_calls or kept_entries" \
    > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"; stamp tests
timeout 100 bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/bench_soft.py --only soft_ecc \
    --no-baseline > "$OUT/ab.log" 2>&1
grep -E "forward\+VJP \||copy" "$OUT/ab.log" | grep -v "<="; stamp ab
timeout 30 python3 benchmarks/host_timeline.py soft_ecc_2d --calls 100 > "$OUT/timeline.log" 2>&1
cat "$OUT/timeline.log"; stamp timeline
