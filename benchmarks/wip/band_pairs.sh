#!/usr/bin/env bash
# The device call that decides branch band-pairs (thirty-sixth session): GPU tests of the
# pairs, and A/B of the band kernels against main, alternating processes.
#
#   here:       bash benchmarks/wip/band_pairs.sh prepare     (from a checkout of band-pairs)
#   on device:  OUT=... [PART=2] bash benchmarks/wip/band_pairs.sh run  (carry .whl; ab/ travels)
#
# Trees: ab/old = main; "." = the branch (ECT pairs on, soft ECC pairs off); ab/soft = the
# branch with every soft ECC kernel's pairs on; ab/listed = only the listed soft backward's.
# Merge what is faster; the ECT spills rose (sm_90 float32: forward 16 -> 16/24 B 3D, backward
# 0 -> 20 B 2D, 12 -> 64 B 3D), the soft sweeps' more (RESULTS.md).
set -uo pipefail
case "${1:-}" in
prepare)
    rm -rf ab/old ab/soft ab/listed
    mkdir -p ab/old ab/soft ab/listed
    git archive main cutopo cuda_src benchmarks | tar -x -C ab/old
    for t in soft listed; do git archive HEAD cutopo cuda_src benchmarks tests pyproject.toml | tar -x -C ab/$t; done
    sed -i 's/^#define CUTOPO_SOFT_BAND_PAIRS 0$/#define CUTOPO_SOFT_BAND_PAIRS 1/' ab/soft/cuda_src/ecc_band.cuh
    sed -i 's/^#define CUTOPO_SOFT_LISTED_PAIRS CUTOPO_SOFT_BAND_PAIRS$/#define CUTOPO_SOFT_LISTED_PAIRS 1/' \
        ab/listed/cuda_src/ecc_band.cuh
    grep -c "define CUTOPO_SOFT_BAND_PAIRS 1" ab/soft/cuda_src/ecc_band.cuh
    grep -c "define CUTOPO_SOFT_LISTED_PAIRS 1" ab/listed/cuda_src/ecc_band.cuh
    ;;
run)
    OUT=${OUT:-/tmp/out}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $(ls .whl/*.whl | grep -v 2026.7.1) >/dev/null 2>&1
    export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
    sel="tests/test_band_gpu.py tests/test_ect.py tests/test_soft_ecc.py tests/test_periodic.py"
    python3 -m pytest -q -n 14 -m gpu $sel -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/tests.txt"
    (cd ab/soft && PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -n 14 -m gpu $sel \
        -p no:cacheprovider 2>&1 | tail -5) | tee -a "$OUT/tests.txt"
    # PART 1 (default): the ECT's pairs, and the soft ECC as the branch leaves it (its packed 2D
    # forward's window lost its unused g: 44/52 -> 32/40 B of spills); PART 2: the soft trees.
    {
        if [ "${PART:-1}" = 1 ]; then
            bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/bench_soft.py --no-baseline --only soft_ect
            bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/bench_soft.py --no-baseline --only soft_ecc
        else
            bash benchmarks/ab_trees.sh ab/old ab/soft 2 -- python3 benchmarks/bench_soft.py --no-baseline --only soft_ecc
            bash benchmarks/ab_trees.sh ab/old ab/listed 2 -- python3 benchmarks/bench_soft.py --no-baseline --only soft_ecc
        fi
    } 2>&1 | tee "$OUT/ab.txt" | grep -E "^\[|ms" | tail -80
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
