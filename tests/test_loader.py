"""The kernel layer's pure-Python parts: source assembly, launch argument conversion, planning helpers.

None of these need a GPU (the launch helper imports CuPy, which imports fine without one).
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

import cutopo
from cutopo._cuda import source

_INCLUDE_LINE = re.compile(r'^\s*#\s*include\s+"', re.MULTILINE)


# ---------------------------------------------------------------------------------------------
# source


def test_source_dir_holds_the_kernels():
    d = source.source_dir()
    assert (d / "ecc.cu").is_file()
    assert (d / "common.cuh").is_file()


def test_family_source_inlines_project_headers():
    d = source.source_dir()
    raw = (d / "ecc.cu").read_text()
    assert _INCLUDE_LINE.search(raw), "ecc.cu no longer includes a project header (update this test)"
    text = source.family_source("ecc")
    assert not _INCLUDE_LINE.search(text)
    assert (d / "common.cuh").read_text() in text
    # The family's own text survives, minus the include lines.
    for line in raw.splitlines():
        if line.strip() and not _INCLUDE_LINE.match(line):
            assert line in text
    assert source.family_source("ecc") is text  # memoized


def test_family_source_inlines_each_header_once(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    (tmp_path / "fam.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n  #  include "a.cuh"  \nint f;\n')
    monkeypatch.setattr(source, "source_dir", lambda: tmp_path)
    source.family_source.cache_clear()
    try:
        text = source.family_source("fam")
    finally:
        source.family_source.cache_clear()
    assert not _INCLUDE_LINE.search(text)
    assert text.count("int a;") == 1 and text.count("int b;") == 1 and "int f;" in text
    assert text.index("int b;") < text.index("int a;") < text.index("int f;")


@pytest.mark.parametrize("family", ["nope", "common", "ECC", "../ecc"])
def test_unknown_family(family):
    with pytest.raises(ValueError, match="family"):
        source.family_source(family)


# ---------------------------------------------------------------------------------------------
# launch._convert: scalar conversion and array checks, no GPU needed


@pytest.fixture
def launch_mod():
    pytest.importorskip("cupy")
    from cutopo._cuda import launch

    return launch


@pytest.fixture
def sig(launch_mod):
    return launch_mod.Signature("ecc", "cutopo::ecc::test_kernel", ("int32", "int64", "float32", "float64"))


@pytest.mark.parametrize("kind, dtype", [("float32", np.float32), ("float64", np.float64)])
@pytest.mark.parametrize("value", [0.1, 1e-3, -2.5, 3, np.float64(0.7), np.int16(-4), np.float16(1.5)])
def test_convert_float_kinds(launch_mod, sig, kind, dtype, value):
    out = launch_mod._convert(value, kind, 0, sig)
    assert type(out) is dtype
    assert out == dtype(value)


def test_convert_float32_rounds_like_numpy(launch_mod, sig):
    out = launch_mod._convert(0.1, "float32", 2, sig)
    assert type(out) is np.float32 and out == np.float32(0.1) and float(out) != 0.1


@pytest.mark.parametrize("kind, dtype", [("int32", np.int32), ("int64", np.int64)])
@pytest.mark.parametrize("value", [0, 7, -7, np.int8(5), np.uint16(65535), np.int64(-(2**31))])
def test_convert_int_kinds(launch_mod, sig, kind, dtype, value):
    out = launch_mod._convert(value, kind, 0, sig)
    assert type(out) is dtype and int(out) == int(value)


@pytest.mark.parametrize("kind", ["int32", "int64"])
@pytest.mark.parametrize("value", [1.0, 2.5, np.float32(3.0), True, False, np.bool_(True), "3", None])
def test_convert_int_kind_rejects_non_integers(launch_mod, sig, kind, value):
    with pytest.raises(launch_mod.LaunchError, match="argument 1"):
        launch_mod._convert(value, kind, 1, sig)


@pytest.mark.parametrize("kind, value", [("int32", 2**31), ("int32", -(2**31) - 1), ("int32", 2**40),
                                         ("int64", 2**63), ("int64", -(2**63) - 1),
                                         ("int32", np.int64(2**31)), ("int32", np.uint64(2**63))])
def test_convert_int_range(launch_mod, sig, kind, value):
    with pytest.raises(launch_mod.LaunchError, match="overflow"):
        launch_mod._convert(value, kind, 3, sig)


def test_convert_int_range_edges(launch_mod, sig):
    assert launch_mod._convert(2**31 - 1, "int32", 0, sig) == 2**31 - 1
    assert launch_mod._convert(-(2**31), "int32", 0, sig) == -(2**31)
    assert launch_mod._convert(2**63 - 1, "int64", 0, sig) == 2**63 - 1


@pytest.mark.parametrize("value", ["1.0", None, [1.0], 1 + 2j])
def test_convert_float_kind_rejects_non_numbers(launch_mod, sig, value):
    with pytest.raises(launch_mod.LaunchError, match="argument 2"):
        launch_mod._convert(value, "float32", 2, sig)


def test_convert_pointer_kinds_reject_numpy_arrays(launch_mod, sig):
    with pytest.raises(launch_mod.LaunchError, match="cupy.ndarray"):
        launch_mod._convert(np.zeros(3, np.int64), "ptr:int64", 0, sig)
    with pytest.raises(launch_mod.LaunchError, match="unknown parameter kind"):
        launch_mod._convert(1, "uint8", 0, sig)


def test_launch_checks_argument_count(launch_mod, sig):
    with pytest.raises(launch_mod.LaunchError, match="arguments"):
        launch_mod.launch(sig, 1, 32, (1, 2, 3.0))


def test_parameter_block_packs_scalars_as_the_driver_reads_them(launch_mod):
    """Slot i: 8 bytes at pointers[i]; a 4-byte kind in the low half (little-endian), the
    other half untouched; 8-byte kinds fill the slot. The launch itself: test_launch_gpu."""
    import ctypes

    kinds = ("int32", "float32", "int64", "float64", "int32")
    values = (np.int32(-7), np.float32(0.1), np.int64(-(2**40) - 3), np.float64(-2.5e-300),
              np.int32(2**31 - 1))
    block = launch_mod.ParameterBlock(np.full(len(kinds), 0xAB, dtype=np.uint64))
    for i, (k, v) in enumerate(zip(kinds, values)):
        block.write(i, k, v)
    for i, (k, v) in enumerate(zip(kinds, values)):
        raw = ctypes.string_at(int(block.pointers[i]), 8)
        want = np.asarray(v).tobytes()
        assert raw[:len(want)] == want, k
        if len(want) == 4:
            assert raw[4:] == np.uint64(0xAB).tobytes()[4:]
    assert block.address == block.pointers.ctypes.data
    # a copy of the template per block: writing one leaves the other (and the template) alone
    template = np.zeros(2, dtype=np.uint64)
    a, b = launch_mod.ParameterBlock(template), launch_mod.ParameterBlock(template)
    a.write(0, "int64", np.int64(5))
    assert int(b.i64[0]) == 0 and int(template[0]) == 0


def test_null_pointer_is_a_checked_pointer_value(launch_mod, sig):
    """NULL passes the check of any pointer kind (never of a scalar kind) and packs as 0."""
    assert launch_mod._convert(launch_mod.NULL, "ptr:float32", 0, sig) is launch_mod.NULL
    with pytest.raises(launch_mod.LaunchError, match="integer"):
        launch_mod._convert(launch_mod.NULL, "int32", 0, sig)
    block = launch_mod.ParameterBlock(np.full(2, 0xAB, dtype=np.uint64))
    block.write(1, "ptr:float64", launch_mod.NULL)
    assert int(block.u64[1]) == 0 and int(block.u64[0]) == 0xAB


def test_slot_writers_store_the_kernel_parameter_bytes(launch_mod):
    """ParameterBlock.writer (a prepared launch's call-time slots; write() goes through it too)
    stores each kind as cuLaunchKernel reads it: pointers and 8-byte scalars fill the slot,
    4-byte scalars its low half (the high half keeps the template's bytes), NULL is 0 in both
    pointer kinds."""
    import struct

    class Pointer:  # what the writers read of a CuPy array
        def __init__(self, ptr):
            self.data = type("Memory", (), {"ptr": ptr})()

    fill = 0xABABABABABABABAB
    cases = [("ptr:float32", Pointer(0xDEAD0000), struct.pack("<Q", 0xDEAD0000)),
             ("ptr:uint64", launch_mod.NULL, struct.pack("<Q", 0)),
             (launch_mod.HOST_WORD, launch_mod.NULL, struct.pack("<Q", 0)),
             ("int32", np.int32(-7), struct.pack("<i", -7) + struct.pack("<Q", fill)[4:]),
             ("float32", np.float32(2.5), struct.pack("<f", 2.5) + struct.pack("<Q", fill)[4:]),
             ("int64", -(1 << 40), struct.pack("<q", -(1 << 40))),
             ("float64", 0.1, struct.pack("<d", 0.1))]
    block = launch_mod.ParameterBlock(np.full(len(cases), fill, dtype=np.uint64))
    for i, (kind, value, _) in enumerate(cases):
        if i % 2:
            block.write(i, kind, value)
        else:
            view, index, getter = block.writer(i, kind)
            view[index] = value if getter is None else getter(value)
    assert block.u64.tobytes() == b"".join(want for _, _, want in cases)


def test_generated_slots_writer_stores_what_the_writers_store(launch_mod, rng):
    """slots_writer (a prepared launch's repeated calls) writes the same bytes as
    ParameterBlock.writer's triples for every kind, in any slot order and with fixed slots
    between, leaves the fixed slots alone, and raises for a wrong count of values."""

    class Pointer:
        def __init__(self, ptr):
            self.data = type("Memory", (), {"ptr": ptr})()

    class Word:
        def __init__(self, ptr):
            self.device_ptr = ptr

    makers = {"ptr:float32": lambda: Pointer(int(rng.integers(1, 1 << 48))),
              "ptr:uint64": lambda: launch_mod.NULL,
              launch_mod.HOST_WORD: lambda: Word(int(rng.integers(1, 1 << 48))),
              "int32": lambda: np.int32(rng.integers(-(1 << 31), 1 << 31)),
              "float32": lambda: np.float32(rng.standard_normal()),
              "int64": lambda: np.int64(rng.integers(-(1 << 62), 1 << 62)),
              launch_mod.CALL_INT64: lambda: np.int64(rng.integers(-(1 << 62), 1 << 62)),
              "float64": lambda: np.float64(rng.standard_normal())}
    kinds = list(makers) * 2
    order = rng.permutation(len(kinds))
    n = len(kinds) + 3
    slots = tuple((int(i) + 1, kinds[k]) for k, i in enumerate(order))  # slot 0, the last two: fixed
    values = [makers[kind]() for _, kind in slots]
    fill = np.full(n, 0xABABABABABABABAB, dtype=np.uint64)
    want, got = launch_mod.ParameterBlock(fill), launch_mod.ParameterBlock(fill)
    for (i, kind), v in zip(slots, values):
        want.write(i, kind, v)
    write = launch_mod.slots_writer(slots)
    write(got, tuple(values))
    assert got.u64.tobytes() == want.u64.tobytes()
    assert int(got.u64[0]) == int(got.u64[-1]) == 0xABABABABABABABAB
    assert launch_mod.slots_writer(slots) is write  # made once per layout
    with pytest.raises(ValueError):
        write(got, tuple(values[:-1]))
    launch_mod.slots_writer(())(got, ())


def test_prepared_launch_keys(launch_mod):
    """launch()'s memo of prepared launches tells apart every scalar that converts differently
    (1, 1.0 and True; 0.0 and -0.0; int32 and int64 values), ignores the arrays, and leaves out
    launches it must not prepare: more than 48 KB of shared memory (a per-kernel limit) and
    unhashable arguments (whose conversion error comes from the plain path)."""
    sig = launch_mod.Signature("ecc", "cutopo::ecc::test_kernel",
                               ("ptr:float32", "int32", "float64", launch_mod.HOST_WORD, "int64"))
    slots = launch_mod._slots(sig)
    assert slots[0] == (0, 3)
    assert slots[1](("a", 1, 2.0, "w", 4)) == (1, 2.0, 4) and slots[2](("a", 1, 2.0, "w", 4)) == (2.0,)
    one = launch_mod.Signature("ecc", "k1", ("ptr:float32", "float32"))
    none = launch_mod.Signature("ecc", "k0", ("ptr:float32",))
    assert launch_mod._slots(one)[1](("a", 5.0)) == (5.0,) and launch_mod._slots(none)[2](("a",)) == ()
    assert hash(sig) == hash(launch_mod.Signature(sig.family, sig.name, sig.params)) and sig != one

    def key(args, shared_mem=0, grid=4):
        return launch_mod._prepared_key(sig, grid, 256, shared_mem, (), 0, args, slots)

    base = key((object(), 3, 0.5, None, 7))
    assert base is not None and base == key((object(), 3, 0.5, launch_mod.NULL, 7))  # arrays ignored
    variants = [(object(), 3, -0.5, None, 7), (object(), 3, 0.5, None, 8), (object(), 4, 0.5, None, 7),
                (object(), 3, np.float32(0.5), None, 7), (object(), np.int32(3), 0.5, None, 7),
                (object(), True, 0.5, None, 7), (object(), 3.0, 0.5, None, 7)]
    keys = [key(v) for v in variants] + [key((object(), 3, 0.5, None, 7), grid=5), base]
    assert len(set(keys)) == len(keys)
    assert key((None, 1, 0.0, None, 7)) != key((None, 1, -0.0, None, 7))
    assert key((None, 1, 0.0, None, 7), shared_mem=48 * 1024) is not None
    assert key((None, 1, 0.0, None, 7), shared_mem=48 * 1024 + 1) is None
    # unhashable: its key cannot be looked up (no prepared launch), the plain path's error follows
    with pytest.raises(TypeError):
        hash(key((None, [1], 0.0, None, 7)))
    hash(base)
    assert key((None, 1, "x", None, 7)) is None            # copysign of a string
    assert key((None, 1, 1 + 2j, None, 7)) is None


def test_signature_pickles_with_this_process_hash(launch_mod):
    """A Signature keeps its hash; one pickled by another process (another string-hash seed)
    must come back with this process's hash, or the launch tables would never find it."""
    import pickle
    import subprocess
    import sys

    code = ("import pickle, sys; from cutopo._cuda.launch import Signature; "
            "sys.stdout.buffer.write(pickle.dumps(Signature('cpab', 'k<float>', ('ptr:float32', "
            "'int64'), True)))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    blob = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    got = pickle.loads(blob)
    want = launch_mod.Signature("cpab", "k<float>", ("ptr:float32", "int64"), True)
    assert got == want and hash(got) == hash(want) and {want: 1}[got] == 1


def test_call_int64_kind_is_a_call_time_argument(launch_mod, sig):
    """CALL_INT64 (an int64 that changes at every call, a check's token) converts and packs as
    an int64 and stays out of the prepared launches' key: calls that differ only in it share
    one prepared launch, which takes it at call time like the arrays."""
    call = launch_mod.CALL_INT64
    assert launch_mod._convert(7, call, 0, sig) == np.int64(7)
    for bad in (1.0, True, 2 ** 63, "7"):
        with pytest.raises(launch_mod.LaunchError):
            launch_mod._convert(bad, call, 0, sig)
    tsig = launch_mod.Signature("ecc", "cutopo::ecc::test_kernel", ("ptr:float32", "int32", call))
    slots = launch_mod._slots(tsig)
    assert slots[0] == (0, 2) and slots[1]((None, 5, 99)) == (5,)
    keys = {launch_mod._prepared_key(tsig, 4, 256, 0, (), 0, (None, 5, token), slots)
            for token in (1, 2, 2 ** 62)}
    assert len(keys) == 1
    block = launch_mod.ParameterBlock(np.zeros(3, dtype=np.uint64))
    block.write(2, call, np.int64(-3))
    assert block.i64[2] == -3


def test_host_word_kind_takes_a_pinned_word_or_null(launch_mod, sig):
    """The host-word parameter kind (a kernel's check flags written straight into page-locked
    memory) takes a PinnedWord or NULL, nothing else: an array or an address would reach the
    kernel as a pointer it writes through."""
    assert launch_mod._convert(launch_mod.NULL, launch_mod.HOST_WORD, 0, sig) is launch_mod.NULL
    for bad in (0, 12345, np.zeros(1, dtype=np.uint64), None):
        with pytest.raises(launch_mod.LaunchError, match="PinnedWord or NULL"):
            launch_mod._convert(bad, launch_mod.HOST_WORD, 0, sig)
    block = launch_mod.ParameterBlock(np.full(2, 0xAB, dtype=np.uint64))
    block.write(0, launch_mod.HOST_WORD, launch_mod.NULL)
    assert int(block.u64[0]) == 0 and int(block.u64[1]) == 0xAB


# ---------------------------------------------------------------------------------------------
# launch._fit_shared_carveout: the shared-memory share asked for, with a fake kernel and device


class _FakeKernel:
    def __init__(self, static_shared):
        self.shared_size_bytes = static_shared
        self.preferred_shared_memory_carveout = -1
        self.kernel = type("Function", (), {"ptr": 1234})()


@pytest.mark.parametrize("static, dynamic, per_sm, want", [
    (14336, 0, 4, 27),       # 4 x (14 KB + 1 KB reserved) = 61440 B of 233472: 26.3 % -> 27
    (26624, 0, 3, 36),       # 3 x 27648 = 82944 B: 35.5 % -> 36
    (0, 0, 8, 4),            # the reserved 1 KB per block alone
    (0, 0, 0, 1),            # an occupancy of 0 still asks for one block's share
    (4096, 100000, 3, 100),  # more than the multiprocessor has: all of it
])
def test_fit_shared_carveout_asks_for_what_the_resident_blocks_use(launch_mod, monkeypatch,
                                                                   static, dynamic, per_sm, want):
    import cupy

    kernel = _FakeKernel(static)
    calls, carveouts_seen = [], []

    def occupancy(ptr, block, shared):
        calls.append((ptr, block, shared))
        carveouts_seen.append(kernel.preferred_shared_memory_carveout)
        return per_sm

    sig = launch_mod.Signature("cpab", f"fake<{static}, {dynamic}, {per_sm}>", (), fit_shared=True)
    monkeypatch.setattr(launch_mod, "_kernel", lambda device, s, options: kernel)
    monkeypatch.setattr(launch_mod, "_device_attributes",
                        lambda device: {"MaxSharedMemoryPerMultiprocessor": 233472,
                                        "ReservedSharedMemoryPerBlock": 1024})
    monkeypatch.setattr(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", occupancy)
    launch_mod._fit_shared_carveout.cache_clear()
    try:
        assert launch_mod._fit_shared_carveout(0, sig, (), 256, dynamic) == want
    finally:
        launch_mod._fit_shared_carveout.cache_clear()
    assert kernel.preferred_shared_memory_carveout == want
    assert calls == [(1234, 256, dynamic)]   # the launch's own block size and dynamic shared
    assert carveouts_seen == [100]           # the query saw all of the shared memory


def test_only_the_cpab_backwards_ask_for_a_carveout(launch_mod):
    from cutopo.cpab import _integrate_cupy, _warp_cupy

    assert not launch_mod.Signature("ecc", "k", ()).fit_shared
    assert _integrate_cupy._backward_sig("float32", 2, True, "queue").fit_shared
    assert _warp_cupy._backward_sig("float32", "float32", "float32", 3, True, False).fit_shared
    assert not _integrate_cupy._forward_sig("float32", 2, True).fit_shared


# ---------------------------------------------------------------------------------------------
# _ecc_cupy pure helpers


@pytest.fixture
def ecc_cupy():
    pytest.importorskip("cupy")
    from cutopo import _ecc_cupy

    return _ecc_cupy


@pytest.mark.parametrize("dtype, ctype, cmp", [
    ("float16", "float", "float32"),
    ("float32", "float", "float32"),
    ("float64", "double", "float64"),
    ("int64", "long long", "int64"),
    ("uint64", "unsigned long long", "uint64"),
    ("bool", "long long", "int64"),
    ("uint8", "long long", "int64"),
    ("int16", "long long", "int64"),
    ("uint32", "long long", "int64"),
])
def test_compare_type(ecc_cupy, dtype, ctype, cmp):
    assert ecc_cupy._compare_type(np.dtype(dtype)) == (ctype, np.dtype(cmp))


def test_compare_type_covers_every_result_type(ecc_cupy):
    """Every comparison dtype the checks can produce maps to a C type that holds it exactly."""
    from cutopo._checks import IMAGE_DTYPES

    tdtypes = [np.dtype(d) for d in ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32",
                                     "uint64", "int64", "float16", "float32", "float64")]
    for idt in IMAGE_DTYPES:
        for tdt in tdtypes:
            dt = np.result_type(idt, tdt)
            ctype, npdt = ecc_cupy._compare_type(dt)
            if dt.kind == "f":
                assert npdt.kind == "f" and npdt.itemsize >= max(dt.itemsize, 4)
            else:
                assert npdt.kind in "iu" and npdt.itemsize == 8
                info = np.iinfo(dt) if dt.kind != "b" else np.iinfo(np.uint8)
                assert np.iinfo(npdt).min <= info.min and info.max <= np.iinfo(npdt).max


def test_uniform_estimate(ecc_cupy, rng):
    ue = ecc_cupy._uniform_estimate
    assert ue(np.array([0.0])) is None
    assert ue(np.array([0.0, 1.0])) is None           # fewer than 3 thresholds
    assert ue(np.array([2.0, 2.0, 2.0])) is None      # no spread
    assert ue(np.array([0.0, 0.1, 10.0])) is None     # far from even
    # a span beyond float64 (the kernel's guess would then start every search at bin 1)
    assert ue(np.array([-1e308, 0.0, 1e308])) is None
    # 1/dt or 1/(T dt) beyond float32 or float64 (infinite, or denormal: -ftz=true flushes
    # it), or float32 spacings under 2^-100 (denormal values, flushed, would move the guess)
    for t in (np.array([0, 1e-44, 2e-44, 3e-44], np.float32), np.array([-3e38, 0, 3e38], np.float32),
              np.array([0, 5e-324, 1e-323]), np.linspace(0, 2.0 ** -90, 2 ** 11 + 1).astype(np.float32)):
        assert ue(t) is None, t
    assert ue(np.linspace(0, 2.0 ** -90, 2 ** 11 + 1)) is not None  # the float64 guess takes it
    assert ue(np.linspace(0, 2.0 ** -90, 2 ** 9 + 1).astype(np.float32)) is not None  # dt = 2^-99
    t0 = rng.normal()
    dt = rng.uniform(0.01, 5)
    t = t0 + dt * np.arange(50)
    est = ue(t)
    assert est is not None
    assert est[0] == pytest.approx(t0) and est[1] == pytest.approx(1 / dt)
    assert type(est[0]) is float and type(est[1]) is float
    # small jitter of the inner thresholds (< dt/4) keeps the estimate, larger drops it
    small = t.copy()
    small[1:-1] += rng.uniform(-0.2, 0.2, t.size - 2) * dt
    assert ue(small) is not None
    jitter = t.copy()
    jitter[7] += 0.3 * dt
    assert ue(jitter) is None
    # integer and float32 tables
    est = ue(np.arange(3, 30, 3, dtype=np.int64))
    assert est == pytest.approx((3.0, 1 / 3))
    assert ue(np.linspace(-1, 1, 11).astype(np.float32)) == pytest.approx((-1.0, 5.0))


@pytest.mark.parametrize("image_dtype", ["uint16", "int16"])
@pytest.mark.parametrize("t_dtype", ["float16", "float32", "float64", "int8", "int16", "uint16",
                                     "int32", "uint32", "int64", "uint64"])
def test_integer_threshold_table_keeps_every_comparison(ecc_cupy, rng, image_dtype, t_dtype):
    """16-bit integer images bin against int32 bounds floor(t), clipped past their range: for
    every value of the image dtype, the bin (the first k with v <= t_k) from those bounds equals
    numpy.searchsorted of the thresholds in the comparison dtype, as the NumPy path compares."""
    info = np.iinfo(image_dtype)
    tdt = np.dtype(t_dtype)
    cmp = np.result_type(np.dtype(image_dtype), tdt)
    if tdt.kind == "f":
        lo, hi = max(float(np.finfo(tdt).min), -1e6), min(float(np.finfo(tdt).max), 1e6)
        t = np.concatenate([rng.uniform(info.min - 300, info.max + 300, 60),
                            rng.integers(info.min, info.max, 20) + rng.choice([0.0, 0.5, -0.25], 20),
                            [lo, hi, -0.0, 0.0, info.min - 0.5, info.max + 0.5]])
        t = np.clip(t, lo, hi).astype(tdt)
    else:
        ti = np.iinfo(tdt)
        t = np.concatenate([rng.integers(max(ti.min, info.min - 300), min(ti.max, info.max + 300), 80,
                                         endpoint=True).astype(tdt), np.array([ti.min, ti.max], dtype=tdt)])
    t = np.sort(t).astype(cmp)
    table = ecc_cupy._integer_threshold_table(t)
    assert table.dtype == np.int32 and table.shape == (t.size + 1, 2)
    assert table[0, 0] == np.iinfo(np.int32).min and table[-1, 1] == np.iinfo(np.int32).max
    np.testing.assert_array_equal(table[1:, 0], table[:-1, 1])
    v = np.arange(info.min, info.max + 1).astype(image_dtype)
    want = np.searchsorted(t, v.astype(cmp), side="left")
    got = np.searchsorted(table[:-1, 1], v.astype(np.int32), side="left")
    np.testing.assert_array_equal(got, want)


def test_packed_keys_only_where_their_shared_memory_fits_the_device(ecc_cupy):
    """The packed sweep keeps 4-byte tables in shared memory whatever T: a device that gives a
    block 48 KB (before Volta) takes 32-bit keys for the largest T, one of 99 KB or more the
    packed sweep up to PACKED_MAX_BINS; 8-byte tables (float64 comparisons) may stay in global
    memory, so no device limit moves their keys."""
    def key(T, cmp, optin):  # with the table of T thresholds the host makes (Bounds: two values)
        return ecc_cupy.histogram_key_ctype(T, cmp, (T + 1) * (16 if cmp == "double" else 8), optin)

    T = ecc_cupy.PACKED_MAX_BINS
    for cmp in ("float", "int"):
        assert key(256, cmp, 48 * 1024) == "unsigned short"
        assert key(T, cmp, 48 * 1024) == "unsigned int"
        assert key(T, cmp, 99 * 1024) == key(T, cmp, 227 * 1024) == "unsigned short"
        assert key(T + 1, cmp, 227 * 1024) == "unsigned int"
        assert ecc_cupy.threshold_table_in_shared((T + 1) * 8, "unsigned short", cmp)
        fits = [n for n in range(1, T + 1) if key(n, cmp, 48 * 1024) == "unsigned short"]
        assert fits == list(range(1, fits[-1] + 1)) and 2048 < fits[-1] < T
    assert key(T, "double", 48 * 1024) == "unsigned short"
    assert not ecc_cupy.threshold_table_in_shared((T + 1) * 16, "unsigned short", "double")
    assert ecc_cupy.threshold_table_in_shared(1024 * 16, "unsigned short", "double")


def test_registered_instances_cover_every_input_type(ecc_cupy):
    from cutopo._cuda.compile import registered_instances

    names = registered_instances()["ecc"]
    assert len(names) == len(set(names))
    for ctype in set(ecc_cupy._INPUT_CTYPE.values()):
        for ndim in (2, 3):
            for tconn in ("true", "false"):
                assert any(n.startswith("cutopo::ecc::ecc_histogram<" + ctype + ",")
                           and n.endswith(f", {ndim}, {tconn}>") for n in names), (ctype, ndim, tconn)
                assert any(n.startswith("cutopo::ecc::ecc_contributions<" + ctype + ",")
                           and n.endswith(f", {ndim}, {tconn}>") for n in names), (ctype, ndim, tconn)
    assert "cutopo::ecc::ecc_cumsum" in names
    assert set(ecc_cupy._INPUT_CTYPE) == {np.dtype(d) for d in
                                         ("bool", "uint8", "uint16", "int16", "int32", "float16",
                                          "float32", "float64")}
    assert cutopo  # the package imports without a GPU


@pytest.mark.nvrtc
def test_ab_ecc_builds_a_revisions_family_without_a_gpu(monkeypatch, capsys, tmp_path):
    """benchmarks/ab_ecc.py: a git revision's ecc.cu (or a tree's) with its headers inlined (a
    self-contained source that compiles for sm_90), and no GPU: nothing compared, exit 0."""
    import pathlib
    import shutil
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import ab_ecc

    src = ab_ecc.old_family("HEAD")
    assert '#include "' not in src and "ecc_histogram" in src and "finite_range" in src
    # a tree in place of a revision (the device machines have no .git): its own sources
    tree = tmp_path / "old"
    shutil.copytree(root / "cuda_src", tree / "cuda_src")
    ecc_cu = tree / "cuda_src" / "ecc.cu"
    ecc_cu.write_text("// the old tree's\n" + ecc_cu.read_text())
    tree_src = ab_ecc.old_family(str(tree))
    assert "// the old tree's" in tree_src and '#include "' not in tree_src and "finite_range" in tree_src
    from cutopo._cuda import compile as compile_

    monkeypatch.setattr(compile_, "family_source",
                        lambda family, own=compile_.family_source: src if family == "ecc_ab_old" else own(family))
    cubin, _ = compile_.compile_offline(
        "ecc_ab_old", ["cutopo::ecc::ecc_histogram<float, float, unsigned short, 2, false>"], "90")
    assert cubin[:4] == b"\x7fELF"
    import cupy

    if not cupy.cuda.is_available():
        assert ab_ecc.main(["--only", "nothing"]) == 0
        assert "no GPU" in capsys.readouterr().out
    sys.modules.pop("ab_ecc", None)


@pytest.mark.nvrtc
def test_ab_cpab_variants_compile_without_a_gpu(monkeypatch, capsys):
    """benchmarks/ab_cpab.py: its variants are -D switches of cpab.cu, which must keep
    compiling (the float64 adjoint and queue entries, entry-major queue entries, the backward's
    blocks per SM); bad
    arguments are refused, and without a GPU nothing is compared, exit 0."""
    import pathlib
    import sys

    from cutopo._cuda import compile as compile_
    from cutopo.cpab import _integrate_cupy as icp

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import ab_cpab

    assert ab_cpab.parse_variants(["a=-DX=1 -DY"]) == {"base": (), "a": ("-DX=1", "-DY")}
    for bad in (["base=-DX"], ["noflags"], ["a=-DX", "a=-DY"]):
        with pytest.raises(SystemExit):
            ab_cpab.parse_variants(bad)
    with pytest.raises(SystemExit):
        ab_cpab.main(["--case", "4d"])
    names = [icp._backward_sig(t, K, True, "queue").name for t in ("float32", "float64") for K in (2, 3)]
    for flags in (("-DCUTOPO_CPAB_ADJOINT_DOUBLE=1",), ("-DCUTOPO_QUEUE_DOUBLE_ENTRIES=1",),
                  ("-DCUTOPO_PROFILE_MOMENTS=1",), ("-DCUTOPO_PROFILE_MOMENTS=2",),
                  ("-DCUTOPO_BACKWARD_MIN_BLOCKS_2D=5", "-DCUTOPO_BACKWARD_MIN_BLOCKS_3D=4")):
        cubin, _ = compile_.compile_offline(icp.FAMILY, names, "90", flags)
        assert cubin[:4] == b"\x7fELF"
    import cupy

    if not cupy.cuda.is_available():
        assert ab_cpab.main([]) == 0
        assert "no GPU" in capsys.readouterr().out
    sys.modules.pop("ab_cpab", None)
