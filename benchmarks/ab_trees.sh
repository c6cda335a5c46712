#!/usr/bin/env bash
# A/B of two source trees in one device call: the same command run in alternating processes,
# once per tree per round, so that both see the same machine (host speed varies up to 2x
# between calls on the device machines; compare only within one run).
#
# Usage (repository root):
#   git archive REF cutopo cuda_src benchmarks | (mkdir -p ab/old && tar -x -C ab/old)   # here
#   bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/profile_cpab.py --case 2d
#
# Each tree must hold cutopo/ and cuda_src/ side by side (cutopo finds its CUDA sources next to
# the package). COMMAND must run a script file: "python -c" and "python -m" put the working
# directory first on sys.path, so both runs would import this checkout's cutopo. A tree that
# holds its own copy of the script (a relative path, as above) runs that copy: benchmarks that
# call private functions (bench_soft.py's kernel-only stages) change with the tree. Output lines
# are prefixed with "[tree round]". ab/ is untracked and not ignored, so it travels to the
# device with the working tree; delete it before committing.
set -uo pipefail
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
    echo "usage: $0 TREE_A TREE_B ROUNDS -- COMMAND..." >&2
    exit 2
fi
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) rounds=$3
shift 4
case " ${2-} " in
    " -c "|" -m ") echo "$0: run a script file, not python $2 (see the header)" >&2; exit 2 ;;
esac
for tree in "$a" "$b"; do
    if [ ! -d "$tree/cutopo" ] || [ ! -d "$tree/cuda_src" ]; then
        echo "$0: $tree needs cutopo/ and cuda_src/" >&2
        exit 2
    fi
done
for ((r = 1; r <= rounds; r++)); do
    for tree in "$a" "$b"; do
        label="$(basename "$tree") $r"
        cmd=("$@")
        # the tree's own copy of a relative script path, where it has one
        if [ $# -ge 2 ] && [[ "$2" != /* ]] && [ -f "$tree/$2" ]; then
            cmd[1]="$tree/$2"
        fi
        PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" 2>&1 | sed "s|^|[$label] |"
    done
done
