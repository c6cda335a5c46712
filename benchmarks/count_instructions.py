"""One ECC launch per case, for Nsight Compute to count instructions per voxel.

    ncu --clock-control none -k regex:ecc_histogram --metrics smsp__thread_inst_executed.sum \
        python benchmarks/count_instructions.py
Divide the thread instructions by the voxel count printed for each case.
"""
import cupy as cp
import numpy as np

import cutopo

CASES = [((8192, 8192), "float32"), ((8192, 8192), "uint8"), ((512, 512, 512), "float32"),
         ((512, 512, 512), "uint8")]

for shape, dtype in CASES:
    rs = cp.random.default_rng(0)
    img = rs.integers(0, 256, size=shape, dtype=cp.uint8) if dtype == "uint8" else rs.random(shape, dtype=cp.float32)
    t = np.linspace(0, 255, 256) if dtype == "uint8" else np.linspace(0, 1, 256, dtype=np.float32)
    cutopo.ecc(img, t)
    cp.cuda.Device().synchronize()
    print(f"case {shape} {dtype}: {img.size} voxels", flush=True)
