"""Probe: host microseconds of each step before the 3D soft ECC's first launch, on a real GPU.

    python3 benchmarks/wip/host_parts.py

A repeated cutopo.vjp(soft_ecc) call on bench_soft's 256^3 float32 volume (T = 256) spends
~15-18 us on the device machines' hosts before its first launch, against ~5 us on the build
machine (benchmarks/host_path_nogpu.py): this times each step there (timeit, min of 5 x N) to
find what costs disproportionately more on the device's host.
"""
import sys
import timeit

import cupy
import numpy as np

import cutopo
from cutopo import _ecc_cupy, _soft_ecc, _soft_ecc_cupy
from cutopo._cuda import launch
from cutopo._cuda.repeated import RepeatedCalls

image = cupy.random.random((256, 256, 256), dtype=cupy.float32)
t = cupy.linspace(0, 1, 256, dtype=cupy.float32)
out, pb = cutopo.vjp(cutopo.soft_ecc, image, t, 40.0, ndim=3)
pb(cupy.ones_like(out))
cupy.cuda.Device().synchronize()
D = _soft_ecc._DEVICE_CALLS
key = D.key((image, t), (3, 1, "box"), 40.0)
kept = D.get(key)
plan = kept.plan
stream = cupy.cuda.get_current_stream()
ptr = stream.ptr
word = _soft_ecc_cupy.check_word()
small = cupy.zeros(4, cupy.uint64)


def import_cupy():
    import cupy  # noqa: F401, F811



def m(name, stmt, n=20000):
    best = min(timeit.repeat(stmt, number=n, repeat=5, globals=globals())) / n * 1e6
    print(f"{name:34s} {best:7.3f} us", flush=True)


m("python: empty function call", "(lambda: None)()", 200000)
m("key", "D.key((image, t), (3, 1, 'box'), 40.0)")
m("get", "D.get(key)")
m("lambda_and_halfwidth", "_soft_ecc._lambda_and_halfwidth(kept.dtype, 40.0)")
m("_image_view", "_ecc_cupy._image_view(image)")
m("cupy.cuda.get_current_stream()", "cupy.cuda.get_current_stream()")
m("stream.ptr", "stream.ptr")
m("runtime.getDevice()", "cupy.cuda.runtime.getDevice()")
m("launch._current_device()", "launch._current_device()")
m("a.data", "image.data")
m("a.data.ptr", "image.data.ptr")
m("a.data.device_id", "image.data.device_id")
m("a.shape", "image.shape")
m("_c_contiguous(a)", "launch._c_contiguous(image)")
m("workspace get", "plan._workspaces.get('forward', plan.words, np.uint64, ptr)")
m("check_word()", "_soft_ecc_cupy.check_word()")
m("word.arm(stream)", "word.arm(stream)")
m("cupy.ndarray((256,), float32)", "cupy.ndarray((256,), np.float32)", 5000)
m("import cupy (in a function)", "import_cupy()")
# the first launch's slots (the list sweep: 7)
sweep = plan._list
block = sweep._block()
m("slots write (7)", "sweep._write(block, (image, t, small, word, 1, small, small))")
m("PreparedLaunch._write_and_launch w/o launch", "sweep._write(getattr(sweep._local, 'block', None), "
  "(image, t, small, word, 1, small, small))")
