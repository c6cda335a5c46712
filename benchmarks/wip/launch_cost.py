"""Probe: host microseconds of one cuLaunchKernel (CuPy's launchKernel) on the device machine.

    python3 benchmarks/wip/launch_cost.py

The 3D soft ECC's forward launches come ~6-7 us apart on the device machines' hosts, where the
Python between them times at ~1 us in a loop: this times the driver call itself for a trivial
kernel with 1 and with 24 parameters, into an idle stream and into one that is busy (a
long kernel queued first), and a PreparedLaunch's call_prechecked of the same kernels.
"""
import timeit

import cupy as cp
import numpy as np

from cutopo._cuda import launch

SOURCE = r'''
extern "C" __global__ void one(unsigned long long* a) { if (a == (unsigned long long*)8) a[threadIdx.x] = 1; }
extern "C" __global__ void many(unsigned long long* a, unsigned long long* b, unsigned long long* c,
    unsigned long long* d, unsigned long long* e, unsigned long long* f, unsigned long long* g,
    unsigned long long* h, long long i, long long j, long long k, long long l, long long m,
    long long n, long long o, long long p, int q, int r, int s, int t, float u, float v, double w,
    double x) { if (a == (unsigned long long*)8) a[threadIdx.x] = i + q + (long long)w; }
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64(); while (clock64() - start < cycles) {}
}
'''
module = cp.RawModule(code=SOURCE)
one, many, spin = (module.get_function(n) for n in ("one", "many", "spin"))
buf = cp.zeros(4, cp.uint64)
stream = cp.cuda.get_current_stream().ptr
block1 = launch.ParameterBlock(np.zeros(1, np.uint64))
block24 = launch.ParameterBlock(np.zeros(24, np.uint64))
launch_kernel = cp.cuda.driver.launchKernel


def per_call(stmt, n=500, busy=False):
    best = []
    for _ in range(5):
        cp.cuda.Device().synchronize()
        if busy:  # ~10 ms of one block: the launches below queue behind it
            spin((1,), (1,), (np.int64(20_000_000),))
        best.append(timeit.timeit(stmt, number=n, globals=globals()) / n * 1e6)
        cp.cuda.Device().synchronize()
    return min(best)


for name, fn, blk, grid, smem in (("1 param", one, block1, 1, 0), ("24 params", many, block24, 1, 0),
                                  ("24 params, 1400 blocks, 40 KB", many, block24, 1400, 40960)):
    if smem:
        many.max_dynamic_shared_size_bytes = smem
    stmt = f"launch_kernel(fn_ptr, {grid}, 1, 1, 256, 1, 1, {smem}, stream, blk.address, 0)"
    globals().update(fn_ptr=fn.kernel.ptr, blk=blk)
    print(f"{name:34s} idle {per_call(stmt):6.2f} us, busy stream {per_call(stmt, busy=True):6.2f} us",
          flush=True)
