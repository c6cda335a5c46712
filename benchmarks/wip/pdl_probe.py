"""Probe: what a launch whose blocks all exit at once costs behind a
busy kernel, launched plainly or with programmatic dependent launch (PDL).

The 3D soft ECC's forward+VJP at 256^3 is five launches, two of which (the fused forward of
the images whose list overflowed, the backward's sweep of them) exit at their first line on a
smooth volume and still cost ~5 us each on the GPU (benchmarks/RESULTS.md, forty-fifth
session): ~2048 blocks of ~40 KB shared memory dispatched in waves. Under PDL (compute
capability 9.0: ``cuLaunchKernelEx`` with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
``griddepcontrol`` in the kernels) such a launch may start while the kernel before it runs, if
that one signals ``griddepcontrol.launch_dependents``; a block with work then waits with
``griddepcontrol.wait`` before it reads what the earlier kernel wrote. CuPy launches through
``cuLaunchKernel`` only, so this calls the driver through ctypes.

Prints the median microseconds (CUDA events, 30 runs) of: the busy kernel alone (one wave of
blocks, ~tens of us, with and without its early signal), then followed by one and two
early-exit launches, plain and under PDL. Run on the device:

    python3 benchmarks/wip/pdl_probe.py

Forty-eighth session, H100 (two runs of 200; benchmarks/RESULTS.md): busy alone 34.4 / 30.4
us; one early-exit launch after it plain +2.2 / +3.0, under PDL -2.9 / +1.3; two plain +5.5 /
+6.7, under PDL +2.2 / +3.9. So ~1.5 us of each early-exit launch's ~3 us hides under PDL,
with or without the busy kernel's early signal.
"""
import ctypes

import cupy as cp
import numpy as np

SOURCE = r'''
extern "C" __global__ void busy(const float* __restrict__ x, float* __restrict__ y, int n, int reps,
                                int signal) {
    if (signal) asm volatile("griddepcontrol.launch_dependents;");
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float a = x[i % n];
    for (int r = 0; r < reps; ++r) a = a * 0.999f + 0.001f;
    y[i % n] = a;
}
// every block exits at once where its flag is 0 (the early-exit launches); one with work waits
// for the kernel before it first
extern "C" __global__ void early_exit(const unsigned long long* __restrict__ flags,
                                      float* __restrict__ y, int n) {
    extern __shared__ float staged[];
    if (flags[blockIdx.x % 4] == 0ull) return;
    asm volatile("griddepcontrol.wait;" ::: "memory");
    staged[threadIdx.x] = y[threadIdx.x % n];
    __syncthreads();
    y[threadIdx.x % n] = staged[(threadIdx.x + 1) % blockDim.x];
}
'''
SHARED = 40 * 1024
EXIT_BLOCKS = 2048
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


def main():
    module = cp.RawModule(code=SOURCE)
    busy, early_exit = module.get_function("busy"), module.get_function("early_exit")
    early_exit.max_dynamic_shared_size_bytes = SHARED
    driver = ctypes.CDLL("libcuda.so.1")
    pdl = LaunchAttribute()
    pdl.id = PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(pdl) + 8, ctypes.byref(ctypes.c_int(1)), 4)
    n = 1 << 20
    x = cp.random.random(n, dtype=cp.float32)
    y = cp.zeros(n, dtype=cp.float32)
    flags = cp.zeros(4, dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def launch(function, grid, block, shared, args, dependent):
        config = LaunchConfig(grid, 1, 1, block, 1, 1, shared, stream.ptr,
                              ctypes.pointer(pdl) if dependent else None, 1 if dependent else 0)
        values = [ctypes.c_uint64(a.data.ptr) if isinstance(a, cp.ndarray) else ctypes.c_int32(a)
                  for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        status = driver.cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function.kernel.ptr), params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx: CUresult {status}")

    def median_us(exits, dependent, signal, runs=200):
        times = []
        for _ in range(runs + 3):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            launch(busy, sms * 8, 256, 0, (x, y, n, 2000, signal), False)
            for _ in range(exits):
                launch(early_exit, EXIT_BLOCKS, 256, SHARED, (flags, y, n), dependent)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1000)
        return float(np.median(times[3:]))

    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: busy kernel of {sms * 8} "
          f"blocks, then early-exit launches of {EXIT_BLOCKS} blocks x {SHARED // 1024} KB (us)")
    print(f"busy alone: {median_us(0, False, 0):.1f} (with its signal {median_us(0, False, 1):.1f})")
    for exits in (1, 2):
        print(f"{exits} early-exit: plain {median_us(exits, False, 0):.1f} / busy signals "
              f"{median_us(exits, False, 1):.1f}; PDL {median_us(exits, True, 0):.1f} / busy signals "
              f"{median_us(exits, True, 1):.1f}")


if __name__ == "__main__":
    main()
