#!/usr/bin/env bash
# Fifty-eighth session, call 2 (carry .whl): the ECC family's GPU tests on the tree whose histogram
# sink is the dump form by default (the A/B of call 1, sink_call.sh, measured it as a variant).
source benchmarks/wip/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
ecc_gpu_tests
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -10
