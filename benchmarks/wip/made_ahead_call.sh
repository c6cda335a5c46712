#!/usr/bin/env bash
# One device call for made_ahead.patch (prepared in the forty-seventh session, which got no
# device machine; benchmarks/RESULTS.md): the soft ECC forward launches on arrays made by the
# previous call of its kind once that call's launches were queued (cutopo._cuda.workspace.
# made_ahead), cutopo.vjp's forward makes the backward's outputs (the pullback allocates
# nothing), lambda and w memoized per scale value, the _Config built after the launches.
# The emulated kernel tests, test_made_ahead.py and .ci/run passed on it (without a GPU).
# Runs the GPU suite (not run since b9bdfa6), the per-call A/B against the committed tree, the
# soft ECC targets with the baseline, the host timeline, and the PDL probe. ~5 min.
#
# Here first, from the repository root:
#   mkdir -p ab/old && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
#   git apply benchmarks/wip/made_ahead.patch
# then run this with carry [".whl", "ab"]; commit the patch's changes (and remove it here)
# only if the tests pass and the calls are not slower.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 14 -m "gpu and not slow" \
    --ignore-glob="tests/*_host.py" tests > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
stamp tests
timeout 150 bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/bench_soft.py --only soft_ecc \
    --no-baseline > "$OUT/ab.log" 2>&1
grep -E "forward\+VJP|copy" "$OUT/ab.log"
stamp ab
timeout 60 python3 benchmarks/bench_soft.py --only soft_ecc > "$OUT/soft.log" 2>&1
stamp soft
timeout 40 python3 benchmarks/host_timeline.py soft_ecc_3d soft_ecc_2d --detailed --calls 40 \
    > "$OUT/timeline.log" 2>&1
stamp timeline
timeout 30 python3 benchmarks/wip/pdl_probe.py 2>&1 | tee "$OUT/pdl.log"
stamp pdl
