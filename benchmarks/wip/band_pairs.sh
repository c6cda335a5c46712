#!/usr/bin/env bash
# The device calls that decide branch band-pairs (thirty-sixth session): GPU tests of the band
# window's layouts (ecc_band.cuh, Window: 0 one entry per pass on 32 thresholds, the layout of
# main; 1 pairs of short bands per pass; 2 one entry per pass on 64 thresholds) and A/B of the
# band kernels against main in alternating processes.
#
#   here:       bash benchmarks/wip/band_pairs.sh prepare      (from a checkout of band-pairs)
#   on device:  OUT=... PART=1|2|3 bash benchmarks/wip/band_pairs.sh run
#               (carry .whl; ab/ travels with the working tree; ~5 minutes a part)
#
# Trees: ab/old = main; "." = the branch as committed (ECT layout 1 with a block's entries dealt
# over its warps, soft ECC layout 0); ab/ect2 = ECT layout 2; ab/ectnospread = ECT layout 1,
# 32 entries a warp as on main; ab/soft1, ab/soft2 = every soft ECC kernel on layout 1 or 2;
# ab/listed1, ab/listed2 = only the listed soft backward. Part 1: the GPU tests of ".", and the
# soft ECT of ".", ect2 and ectnospread against main; part 2: the GPU tests of soft1, the soft
# ECC of ".", soft1 and soft2 (the branch's own soft ECC: its packed 2D forward's window lost
# an unused member, 44/52 -> 32/40 B of spills); part 3: the GPU tests of listed2, the soft
# ECC of listed1 and listed2. (Each tree's kernels compile on first use: the emulated tests
# cover the layouts' code, so one tree's GPU tests per part.) Merge what wins; the model in
# RESULTS.md (passes and window moves per layout) says what to expect.
set -uo pipefail
trees="ect2:ECT_BAND_WINDOW:2 ectnospread:ECT_SPREAD:0 soft1:SOFT_BAND_WINDOW:1 soft2:SOFT_BAND_WINDOW:2
       listed1:SOFT_LISTED_WINDOW:1 listed2:SOFT_LISTED_WINDOW:2"
case "${1:-}" in
prepare)
    rm -rf ab/old ab/ect2 ab/ectnospread ab/soft1 ab/soft2 ab/listed1 ab/listed2
    mkdir -p ab/old
    git archive main cutopo cuda_src benchmarks | tar -x -C ab/old
    for spec in $trees; do
        IFS=: read -r name macro value <<<"$spec"
        mkdir -p "ab/$name"
        git archive HEAD cutopo cuda_src benchmarks tests pyproject.toml | tar -x -C "ab/$name"
        # the macro's default (#ifndef ... #define CUTOPO_X default) becomes the value
        sed -i "s/^#define CUTOPO_$macro .*$/#define CUTOPO_$macro $value/" "ab/$name/cuda_src/ecc_band.cuh"
        grep -c "^#define CUTOPO_$macro $value$" "ab/$name/cuda_src/ecc_band.cuh"
    done
    ;;
run)
    OUT=${OUT:-/tmp/out}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $(ls .whl/*.whl | grep -v 2026.7.1) >/dev/null 2>&1
    export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
    sel="tests/test_band_gpu.py tests/test_ect.py tests/test_soft_ecc.py tests/test_periodic.py"
    case "${PART:-1}" in
        1) test_trees="." ;;
        2) test_trees="ab/soft1" ;;
        *) test_trees="ab/listed2" ;;
    esac
    for tree in $test_trees; do
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -n 14 -m gpu $sel \
            -p no:cacheprovider 2>&1 | tail -3 | sed "s|^|[$tree] |")
    done | tee "$OUT/tests.txt"
    bench() { bash benchmarks/ab_trees.sh ab/old "$1" 2 -- python3 benchmarks/bench_soft.py --no-baseline --only "$2"; }
    {
        case "${PART:-1}" in
            1) bench . soft_ect; bench ab/ect2 soft_ect; bench ab/ectnospread soft_ect ;;
            2) bench . soft_ecc; bench ab/soft1 soft_ecc; bench ab/soft2 soft_ecc ;;
            *) bench ab/listed1 soft_ecc; bench ab/listed2 soft_ecc ;;
        esac
    } 2>&1 | tee "$OUT/ab.txt" | grep -E "^\[|ms" | tail -80
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
