#!/usr/bin/env bash
# One device call that measures where every open issue stands on the committed tree (prepared
# in the thirty-sixth session, which was lent no machine): the GPU suite, bench_ecc (issue 2)
# with Nsight Compute's instruction counts, bench_soft (issue 3) with Nsight Compute of the 3D
# soft forward, the soft ECT's stages, and bench_stream's Dask rows (issue 8). ~9 minutes.
#
#   OUT=... bash benchmarks/wip/status_call.sh      (carry .whl; logs.tgz comes back)
source benchmarks/wip/device_setup.sh
stamp start
OUT=$OUT TESTS='-n 14 -m "gpu and not slow" --ignore-glob="tests/*_host.py" tests' \
    NCU=1 NCU_SOFT=1 BENCH_ARGS="--no-cpu" timeout 450 bash benchmarks/device_run.sh \
    > "$OUT/device_run.txt" 2>&1
stamp device_run
timeout 45 python3 benchmarks/profile_host.py soft_ect_stages > "$OUT/soft_ect_stages.log" 2>&1
stamp soft_ect_stages
timeout 80 python3 benchmarks/bench_stream.py --quick --only chunks --reps 15 > "$OUT/stream.log" 2>&1
stamp stream
tail -5 "$OUT/tests.log"
# at most 8 files come back: one archive
cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt && rm -f ./*.log ./*.txt
