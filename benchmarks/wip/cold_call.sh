#!/usr/bin/env bash
# One device call (fifty-second session): GPU tests of the soft ECC, then the 3D soft ECC's
# first launch after a synchronisation (cold_probe.py) and bench_soft's 3D per-call time,
# alternating the committed tree (ab/old) and the working tree; the working tree's timelines.
#   mkdir -p ab/old && git archive HEAD cutopo cuda_src benchmarks | tar -x -C ab/old
# then run with carry [".whl", "ab"], timeout ~300 (~100 s).
source benchmarks/wip/device_setup.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_band_gpu.py -k "soft_ecc or repeated or made_ahead" > "$OUT/tests.log" 2>&1
tail -1 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -5; stamp tests
for r in 1 2 3; do for tree in ab/old .; do
  printf "[$tree $r] "; PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 40 python3 benchmarks/wip/cold_probe.py --calls 200 2>&1 | tail -1
done; done; stamp cold
for r in 1 2 3 4; do for tree in ab/old .; do
  printf "[$tree $r] "
  PYTHONPATH="$PWD/$tree:$PYTHONPATH" timeout 30 python3 $tree/benchmarks/bench_soft.py --only "soft_ecc" \
      --no-baseline 2>&1 | grep -E "forward\+VJP \|" | grep -v "<=" | awk -F'|' '{printf "%s %s/%s; ", $2, $5, $6}'
  echo
done; done; stamp ab
timeout 60 python3 benchmarks/host_timeline.py soft_ecc_3d soft_ecc_2d 2>&1 | tail -4
timeout 60 python3 benchmarks/host_timeline.py soft_ecc_2d --detailed 2>&1 | tail -2; stamp timeline
