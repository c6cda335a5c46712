"""A/B of exact-ECC histogram kernels in one process: compile-time variants and a git revision.

    python benchmarks/ab_ecc.py [--variant NAME=FLAGS ...] [--setting NAME=ATTR=VALUE ...]
                                [--against REV] [--only TEXT] [--small] [--rounds N] [--reps N]

Host and device speed move between processes on the device machines (up to 2x on the host,
~10 % on the GPU), so kernel variants are compared here in one process, their launches
alternating: each variant's histogram plan (cutopo._ecc_cupy.HistogramPlan, with its own
launch geometry) is captured once in a CUDA graph, then the graphs are replayed in turn for
--rounds rounds of --reps replays each. A row prints each variant's median GPU time of one
replay between two events (us), its ratio to the first variant and whether every variant's
curves equal the first's.

Variants: "base" (the working tree) always, then each --variant NAME=FLAGS, FLAGS being
space-separated -D options of ecc.cu (e.g. --variant "4 blocks=-DCUTOPO_ECC_MIN_BLOCKS=4") and
ATTR=VALUE settings as below (e.g. --variant "both=-DCUTOPO_ECC_MIN_BLOCKS_3D=4
HIST_ZCHUNK_MAX=32"), each --setting NAME=ATTR=VALUE a plan built with a constant of
cutopo._ecc_cupy set to a Python literal (e.g. --setting "2 waves=HIST_WAVES_2D=2" or
--setting "64 rows=HIST_TALL_ROWS={1: 8, 2: 8, 4: 8, 8: 8}"), and with --against
REV the kernel sources of that revision (git show REV:cuda_src/...; or of a tree REV holding
cuda_src/, e.g. unpacked by git archive where there is no .git), compiled as a family of their
own and launched with this tree's geometry and arguments (a revision whose ecc_histogram takes
this tree's parameters).
--small: one-wave cases (128^2 to 2048^2, bool too, 64^3 and 128^3) instead of the large ones;
--mid: 2D sizes from 2048 x 4096 to 4096 x 8192 and batches of 8-32 x 1024^2 (the 64-row tiles'
threshold).
--smooth: smooth images instead of white noise (a few random plane waves per image, in [0, 1]
or [0, 255]): most pixels contribute nothing there and neighbours share their bins, where the
histogram's updates and their skipping weigh otherwise than on noise.
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench_ecc import make_image, replay_ms  # noqa: E402  (benchmarks/ is the script's directory)

T = 256
CASES = [(f"2d {n}^2 {d}", (n, n), 2, d, False) for d in ("float32", "uint8") for n in (1024, 4096, 8192)]
CASES += [(f"2d 64x1024^2 {d}", (64, 1024, 1024), 2, d, False) for d in ("float32", "uint8")]
CASES += [("2d 8192^2 float32 T", (8192, 8192), 2, "float32", True),
          ("2d 8192^2 float64", (8192, 8192), 2, "float64", False)]
CASES += [(f"3d {n}^3 {d}", (n,) * 3, 3, d, False) for d in ("float32", "uint8") for n in (256, 512, 1024)]
# Inputs that bin through the comparison types' other paths: float16 (float32 thresholds: compared
# in float32), uint16 (microscopy; float64 thresholds over its range compare in float64).
CASES += [("2d 8192^2 float16", (8192, 8192), 2, "float16", False),
          ("2d 8192^2 uint16", (8192, 8192), 2, "uint16", False),
          ("2d 8192^2 int16", (8192, 8192), 2, "int16", False),
          ("2d 8192^2 int32", (8192, 8192), 2, "int32", False),
          ("2d 8192^2 bool", (8192, 8192), 2, "bool", False),
          ("3d 512^3 uint16", (512,) * 3, 3, "uint16", False),
          ("3d 256^3 float64", (256,) * 3, 3, "float64", False),
          ("3d 512^3 float64", (512,) * 3, 3, "float64", False)]
# --small: one-wave launches, where the blocks' final atomics weigh
SMALL = [(f"2d {n}^2 {d}", (n, n), 2, d, False) for d in ("float32", "uint8", "bool")
         for n in (128, 512, 1024, 2048)]
SMALL += [("2d 8x256^2 float32", (8, 256, 256), 2, "float32", False),
          ("2d 1024^2 float32 T", (1024, 1024), 2, "float32", True)]
SMALL += [(f"3d {n}^3 {d}", (n,) * 3, 3, d, False) for d in ("float32", "uint8") for n in (64, 128)]
# --mid: 2D sizes around the choice of tall tiles (HIST_TALL_MIN_TILES)
MID = [(f"2d {ny}x{nx} {d}", (ny, nx), 2, d, False) for d in ("float32", "uint8")
       for ny, nx in ((2048, 4096), (4096, 4096), (2048, 8192), (6144, 6144), (4096, 8192))]
MID += [(f"2d {b}x1024^2 float32", (b, 1024, 1024), 2, "float32", False) for b in (8, 16, 32)]


def smooth_image(cp, shape, dtype, seed, waves=3):
    """A smooth image of ``shape`` (float32 in [0, 1], or uint8 in [0, 255] for "uint8"): the
    sum of ``waves`` plane waves of random phase, 2 to 8 periods along each axis, rescaled to
    the range."""
    rs = np.random.default_rng(seed)
    grids = cp.meshgrid(*[cp.arange(n, dtype=cp.float32) / n for n in shape], indexing="ij", sparse=True)
    field = cp.zeros(shape, dtype=cp.float32)
    for _ in range(waves):
        phase = float(rs.uniform(0, 2 * np.pi))
        arg = sum(float(rs.uniform(2, 8)) * g for g in grids)
        field += cp.cos(2 * np.pi * arg + phase)
    field = (field - field.min()) / (field.max() - field.min())
    return (field * 255).astype(cp.uint8) if dtype == "uint8" else field


def old_family(rev: str) -> str:
    """The ecc family's source at git revision ``rev``, or in the tree ``rev`` names (a directory
    holding cuda_src/, e.g. a `git archive` unpacked where the device has no .git), its headers
    inlined (the loader's way)."""
    from cutopo._cuda import source

    if Path(rev, "cuda_src", "ecc.cu").is_file():
        path = Path(rev, "cuda_src", "ecc.cu").resolve()
        return source._inline(path, {path})
    root = Path(__file__).resolve().parents[1]
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "cuda_src/"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    tmp = Path(tempfile.mkdtemp(prefix="cutopo-ab-"))
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        (tmp / Path(name).name).write_text(text)
    path = (tmp / "ecc.cu").resolve()
    return source._inline(path, {path})


def capture(cp, fn):
    """A CUDA graph of fn() on a stream of its own (fn ran once before, to compile and warm)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    return graph, stream


def plan_for(variant, image, t, ndim, tconn):
    """variant: ("build", (options, {attr: value})), the -D options and the constants of
    cutopo._ecc_cupy to build with, or ("family", name): the plan, built as that variant."""
    from cutopo import _ecc_cupy

    kind, value = variant
    family, options = _ecc_cupy.FAMILY, _ecc_cupy.PROFILE_OPTIONS
    saved = {}
    try:
        if kind == "family":
            _ecc_cupy.FAMILY = value
        else:
            _ecc_cupy.PROFILE_OPTIONS, settings = value
            for attr, v in settings.items():
                saved[attr] = getattr(_ecc_cupy, attr)
                setattr(_ecc_cupy, attr, v)
        return _ecc_cupy.HistogramPlan(tuple(image.shape[-ndim:]), int(np.prod(image.shape[:-ndim])),
                                       image.dtype, t, ndim, tconn)
    finally:
        _ecc_cupy.FAMILY, _ecc_cupy.PROFILE_OPTIONS = family, options
        for attr, v in saved.items():
            setattr(_ecc_cupy, attr, v)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=FLAGS (space-separated -D options and ATTR=VALUE settings)")
    p.add_argument("--setting", action="append", default=[],
                   help="NAME=ATTR=VALUE (a constant of cutopo._ecc_cupy, a Python literal)")
    p.add_argument("--against", help="a git revision (or a tree with cuda_src/) whose kernel sources form one more variant")
    p.add_argument("--small", action="store_true", help="the one-wave cases instead of the large ones")
    p.add_argument("--mid", action="store_true", help="2D sizes around the tall tiles' threshold")
    p.add_argument("--smooth", action="store_true", help="smooth images instead of white noise")
    p.add_argument("--only", help="run the cases whose name contains this")
    p.add_argument("--bins", type=int, default=T,
                   help="thresholds, evenly spaced over 0..1 (floats) or the integer dtype's span "
                        "(uint8: 256 makes every byte its own bin, any other count does not)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)

    import cupy as cp

    from cutopo import _ecc_cupy
    from cutopo._checks import check_thresholds
    from cutopo._cuda import compile as compile_, launch

    if not cp.cuda.is_available():
        print("# no GPU: nothing to compare")
        return 0
    launch.PREPARE_REPEATS = False  # every plan launches its own kernel
    variants = {"base": ("build", ((), {}))}
    for item in args.variant:
        name, _, flags = item.partition("=")
        options = tuple(f for f in flags.split() if f.startswith("-"))
        settings = (f.split("=") for f in flags.split() if not f.startswith("-"))
        variants[name] = ("build", (options, {attr: ast.literal_eval(v) for attr, v in settings}))
    for item in args.setting:
        name, attr, value = item.split("=", 2)
        variants[name] = ("build", ((), {attr: ast.literal_eval(value)}))
    if args.against:
        source = old_family(args.against)
        own = compile_.family_source
        compile_.family_source = lambda family: source if family == "ecc_ab_old" else own(family)
        variants[args.against] = ("family", "ecc_ab_old")

    print("| case | " + " | ".join(f"{v} us" for v in variants) + " | "
          + " | ".join(f"{v} / base" for v in list(variants)[1:]) + " | equal |")
    print("|---" * (2 * len(variants) + 1) + "|")
    for name, shape, ndim, dtype, tconn in (SMALL if args.small else MID if args.mid else CASES):
        if args.only and args.only not in name:
            continue
        seed = np.random.SeedSequence().entropy % 2**32
        make = smooth_image if args.smooth else make_image
        image = make(cp, shape, "float32" if dtype.startswith("float") else "uint8", seed)
        if dtype == "uint16":
            image = (image.astype(cp.uint16) << 8) | make_image(cp, shape, "uint8", seed + 1)
        image = image > 127 if dtype == "bool" else image.astype(dtype)
        top = {"uint8": 255, "uint16": 65535, "int16": 255, "int32": 255}.get(dtype, 1)
        t = np.linspace(0, top, args.bins)
        t, _ = check_thresholds(t.astype(np.float32) if dtype in ("float32", "float16") else t,
                                np.empty(0, dtype=image.dtype))  # as cutopo.ecc compares
        flat = _ecc_cupy._image_view(image).reshape((-1,) + image.shape[-ndim:])
        plans = {v: plan_for(spec, image, t, ndim, tconn) for v, spec in variants.items()}
        curves = {v: plan(flat).get() for v, plan in plans.items()}
        graphs = {v: capture(cp, lambda plan=plan: plan(flat)) for v, plan in plans.items()}
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                times[v].append(replay_ms(cp, *graphs[v], args.reps) * 1e3)
        med = {v: float(np.median(ts)) for v, ts in times.items()}
        equal = all(np.array_equal(curves["base"], c) for c in curves.values())
        print(f"| {name} | " + " | ".join(f"{med[v]:.1f}" for v in variants) + " | "
              + " | ".join(f"{med[v] / med['base']:.2f}" for v in list(variants)[1:])
              + f" | {'yes' if equal else 'NO'} |", flush=True)
        image = flat = plans = graphs = None
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
