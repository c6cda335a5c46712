"""The grid_sample forward kernels, ours and torch's, on the benchmark's first case, for Nsight
Compute: each runs three times (the last is the one to read).

    ncu --clock-control none -k regex:"sampling|grid_sampler" --section SpeedOfLight \
        python benchmarks/ncu_grid_sample.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    import cupy as cp
    import torch

    import cutopo
    from bench_grid_sample import cases

    case = cases(quick=False)[0]
    image, grid = case.inputs(cp, 0)
    for _ in range(3):
        cutopo.grid_sample(image, grid, **case.kw)
    ti, tg = torch.from_dlpack(image), torch.from_dlpack(grid)
    for _ in range(3):
        torch.nn.functional.grid_sample(ti, tg, **case.kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
