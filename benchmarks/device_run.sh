#!/usr/bin/env bash
# Everything one device session runs, in one call: GPU tests, the benchmarks, instruction counts.
# Usage (repository root, on a machine with a GPU):  OUT=/tmp/out bash benchmarks/device_run.sh
# Environment: BENCH_ARGS (extra benchmark options), TESTS (pytest selection, default: -m gpu tests;
# quotes inside it are honoured, e.g. TESTS='-m "gpu and not slow" tests'),
# BENCH_SOFT_ARGS (extra bench_soft.py options), SOFT=0 (skip bench_soft.py), ECC=0 (skip bench_ecc.py),
# DEFORM=1 (also run bench_deformable.py), CPAB=1 (bench_cpab.py with the VJP's checkpoints
# "sparse" (the default) and "recompute", and profile_cpab.py), REGISTER=1 (bench_register.py),
# TRANSFORM=1 (bench_transform_image.py: transform_image's fused path against the composed one),
# NCU=1 (also count instructions per voxel with Nsight Compute), NCU_SOFT=1 (Nsight Compute's
# warp states, scheduler and occupancy of the 3D soft ECC forward on bench_soft's 256^3 volume:
# the first launch of profile_soft.py --forward-3d; divide thread instructions by 16777216).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX must not take most of the GPU's memory: CuPy and PyTorch share the card in the adapter tests.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/cutopo_out}
mkdir -p "$OUT"
{
  date -u
  git rev-parse --short HEAD 2>/dev/null || echo "commit: unknown"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import cupy, numpy, skimage, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'skimage', skimage.__version__)"
} 2>&1 | tee "$OUT/env.txt"

# eval: TESTS may quote a marker expression, e.g. TESTS='-m "gpu and not slow" tests'
eval "python3 -m pytest -q -p no:cacheprovider --maxfail=${MAXFAIL:-25} --durations=12 ${TESTS:--m gpu tests}" 2>&1 \
  | tee "$OUT/tests.log"

if [ "${ECC:-1}" != 0 ]; then
  python3 benchmarks/bench_ecc.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi

if [ "${SOFT:-1}" != 0 ]; then
  python3 benchmarks/bench_soft.py ${BENCH_SOFT_ARGS:-} 2>&1 | tee "$OUT/bench_soft.log"
fi

if [ "${DEFORM:-0}" = 1 ]; then
  python3 benchmarks/bench_deformable.py 2>&1 | tee "$OUT/bench_deformable.log"
fi

if [ "${CPAB:-0}" = 1 ]; then
  for mode in sparse recompute; do
    python3 benchmarks/bench_cpab.py --checkpoints "$mode" --json "$OUT/bench_cpab_$mode.json" 2>&1 \
      | tee "$OUT/bench_cpab_$mode.log"
  done
  python3 benchmarks/profile_cpab.py 2>&1 | tee "$OUT/profile_cpab.log"
fi

if [ "${REGISTER:-0}" = 1 ]; then
  python3 benchmarks/bench_register.py --json "$OUT/register.json" 2>&1 | tee "$OUT/register.log"
fi

if [ "${TRANSFORM:-0}" = 1 ]; then
  python3 benchmarks/bench_transform_image.py --json "$OUT/transform_image.json" 2>&1 \
    | tee "$OUT/transform_image.log"
fi

if [ "${SASS:-0}" = 1 ] && command -v nvdisasm >/dev/null; then
  python3 - <<'PY'
import os
import cutopo
from cutopo._cuda.compile import compile_offline
names = ["cutopo::ecc::ecc_histogram<float, float, unsigned short, 2, false>",
         "cutopo::ecc::ecc_histogram<unsigned char, double, unsigned short, 3, false>"]
for i, name in enumerate(names):
    cubin, _ = compile_offline("ecc", [name], "90")
    open(f"/tmp/k{i}.cubin", "wb").write(cubin)
PY
  for i in 0 1; do nvdisasm -c /tmp/k$i.cubin > "$OUT/sass$i.txt" 2>&1; done
  wc -l "$OUT"/sass*.txt
fi

if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  ncu --clock-control none -k regex:ecc_histogram \
      --metrics smsp__inst_executed.sum,smsp__thread_inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum \
      python3 benchmarks/count_instructions.py 2>&1 | tee "$OUT/ncu.log" | grep -E "ecc_histogram|inst_executed|dram__|duration|case" 
fi

if [ "${NCU_SOFT:-0}" = 1 ] && command -v ncu >/dev/null; then
  ncu --clock-control none -k regex:soft_ecc_fused_forward -c 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --metrics smsp__thread_inst_executed.sum,smsp__inst_executed.sum \
      python3 benchmarks/profile_soft.py --forward-3d 2>&1 | tee "$OUT/ncu_soft.log" | tail -90
fi
