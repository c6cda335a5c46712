#!/usr/bin/env bash
# One device call for expected_walk.patch (prepared in the forty-fifth session, whose device
# time ran out before it ran; benchmarks/RESULTS.md): the 3D expected_euler backward walk that
# keeps one plane and a sum, float32 held to 4 blocks/SM and float64 to 3, no spills (emulated
# tests, test_nvrtc and .ci/run passed on it). Runs its GPU tests, then times it against the
# committed tree and against itself with float32 unbounded (ptxas's 85-94 registers). ~4 min.
#
# Here first, from the repository root:
#   git apply benchmarks/wip/expected_walk.patch
#   mkdir -p ab/old && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
#   mkdir -p ab/f32free && tar -c cutopo cuda_src benchmarks | tar -x -C ab/f32free
#   sed -i 's/NDIM == 3 ? (sizeof(Real) == 8 ? 3 : 4) : 1)/(NDIM == 3 \&\& sizeof(Real) == 8) ? 3 : 1)/' \
#       ab/f32free/cuda_src/ecc_expected.cuh
# then run this with carry [".whl", "ab"]; keep the patch (commit it with the results) only if
# the tests pass and the walk is not slower.
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 14 -m "gpu and not slow" \
    tests/test_expected_euler_gpu.py > "$OUT/gpu.log" 2>&1
tail -3 "$OUT/gpu.log"
stamp tests
timeout 200 bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/probe_expected_3d.py 2>&1 \
    | grep -v "^$" | tee "$OUT/probe.log"
stamp probe
timeout 100 bash benchmarks/ab_trees.sh ab/f32free . 1 -- python3 benchmarks/probe_expected_3d.py 2>&1 \
    | grep -v "^$" | grep -v float64 | tee "$OUT/probe_f32.log"
stamp f32
