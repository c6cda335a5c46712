"""The ``cutopo`` command-line program.

``cutopo ecc`` computes Euler characteristic curves: of two bundled samples when given no
path (a table, and a plot in ``--out``), or of image files (a CSV, optionally an ``.npy``).

Subcommands are registered in :data:`COMMANDS`: each entry is a function that adds its
subparser to the ``add_subparsers()`` object and sets ``run=<function(args) -> int>`` with
``set_defaults``. :func:`main` parses, calls ``args.run(args)`` and turns :class:`CLIError`
(and ValueError, TypeError, OSError and RuntimeError) into a message on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import __version__

EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: printed as ``cutopo <command>: error: <message>``, exit code 2."""


# --------------------------------------------------------------------------------------------
# Shared helpers


class _Reporter:
    """Prints results to stdout and notes to stderr, nothing under ``--quiet``."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, message: str = "") -> None:
        if not self.quiet:
            print(message)

    def note(self, message: str) -> None:
        if not self.quiet:
            from tqdm import tqdm

            tqdm.write(f"note: {message}", file=sys.stderr)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _resolve_device(device: str) -> str:
    from ._array import gpu_available

    if device == "auto":
        return "gpu" if gpu_available() else "cpu"
    if device == "gpu" and not gpu_available():
        raise CLIError("--device gpu: CuPy sees no CUDA device (install cutopo with the "
                       "[cuda12] or [cuda13] extra on a machine with an NVIDIA GPU, or use --device cpu)")
    return device


def _ensure_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


# --------------------------------------------------------------------------------------------
# cutopo ecc

DEFAULT_COUNT = 256
DEFAULT_OUT = "cutopo_out"

ECC_DESCRIPTION = """\
Exact Euler characteristic curves (ECC) of 2-D images and 3-D stacks: entry k is the Euler
characteristic of the sublevel set {f <= t_k}.

Without PATHS: the ECCs of two bundled samples (skimage.data.coins(), 303x384 uint8, and a
Gaussian-smoothed 128^3 float32 volume made from skimage.data.binary_blobs) are printed as a
table and plotted to DIR/ecc_curves.png.

With PATHS (.png, .jpg, .tif, .tiff, .npy; 2-D images or 3-D stacks): the ECC of every file is
written to a CSV (DIR/ecc.csv, or --csv FILE) and the curves are plotted to DIR/ecc_curves.png.
RGB(A) images are converted to grey (skimage.color.rgb2gray, alpha dropped).
"""

ECC_EPILOG = """\
thresholds:
  --thresholds N alone       N thresholds per image, evenly spaced from that image's finite
                             minimum to its finite maximum (cutopo.linear_thresholds), so each
                             file has its own thresholds. The CSV then has two rows per file:
                             header  path,shape,dtype,quantity,0,1,...,N-1
                             rows    <path>,<shape>,<dtype>,threshold,<t_0>,...,<t_N-1>
                                     <path>,<shape>,<dtype>,chi,<chi_0>,...,<chi_N-1>
  --range LO HI              N thresholds numpy.linspace(LO, HI, N), shared by all files.
  --thresholds-file FILE     the sorted values of FILE (.npy, or text: numbers separated by
                             whitespace, commas or newlines; '#' starts a comment), shared.
  With shared thresholds the CSV has one row per file:
                             header  path,shape,dtype,<t_0>,...,<t_N-1>
                             rows    <path>,<shape>,<dtype>,<chi_0>,...,<chi_N-1>
  --npy FILE needs shared thresholds (--range or --thresholds-file): it holds the (files, N)
  int64 array of curves, in the order of PATHS.

  shape and dtype are those of the analysed (grey) image; shape is written as 303x384.

exit status: 0 on success, 2 on a usage error, a missing or unreadable file, or a bad
thresholds file (with a message on stderr).
"""


@dataclass
class _Thresholds:
    """Either a per-image count or one explicit, shared set of values."""

    count: Optional[int] = None
    values: Optional[np.ndarray] = None
    source: str = ""

    @property
    def shared(self) -> bool:
        return self.values is not None

    @property
    def size(self) -> int:
        return self.count if self.values is None else int(self.values.size)


@dataclass
class _Result:
    name: str
    shape: tuple
    dtype: np.dtype
    thresholds: np.ndarray
    curve: np.ndarray
    seconds: float = float("nan")
    device: str = "cpu"
    connectivity: int = 1


def add_ecc_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ecc", help="Euler characteristic curves of images (bundled samples without PATHS)",
        description=ECC_DESCRIPTION, epilog=ECC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATHS",
                   help="image files: .png, .jpg, .tif, .tiff or .npy (2-D or 3-D)")
    g = p.add_argument_group("thresholds")
    g.add_argument("--thresholds", type=_positive_int, default=None, metavar="N",
                   help=f"number of thresholds (default {DEFAULT_COUNT}); per image unless --range")
    g.add_argument("--range", type=_finite_float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="N evenly spaced thresholds from LO to HI, shared by all images")
    g.add_argument("--thresholds-file", default=None, metavar="FILE",
                   help="sorted threshold values from a .npy or text file, shared by all images")
    c = p.add_argument_group("computation")
    c.add_argument("--connectivity", choices=("1", "full"), default="1",
                   help="1: V construction (4-/6-connected foreground); full: connectivity=ndim, "
                        "T construction (8-/26-connected). Default 1")
    c.add_argument("--boundary", choices=("box", "periodic"), default="box",
                   help="box: the image is all there is; periodic: the torus, every axis wrapping "
                        "around (simulation boxes; every axis >= 3; on every --device, in "
                        "memory, in slabs (--stream) and with --scheduler). Default box")
    c.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: the GPU when CuPy sees one, else NumPy (default auto)")
    c.add_argument("--stream", action="store_true",
                   help="read .npy, .tif/.tiff and .zarr inputs in slabs instead of loading them "
                        "(for stacks larger than memory); always on for .zarr and --scheduler")
    c.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="compute with cutopo.dask on this dask.distributed scheduler (e.g. "
                        "tcp://host:8786; needs cutopo[dask]); the workers read the files by path")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder for ecc_curves.png and ecc.csv (default {DEFAULT_OUT}/)")
    o.add_argument("--csv", default=None, metavar="FILE",
                   help="write the CSV here instead of DIR/ecc.csv (also for the samples)")
    o.add_argument("--npy", default=None, metavar="FILE",
                   help="also write the (files, N) int64 curves; needs --range or --thresholds-file")
    o.add_argument("--no-plot", action="store_true", help="do not write ecc_curves.png")
    o.add_argument("--quiet", action="store_true", help="print nothing but errors; no progress bar")
    p.set_defaults(run=run_ecc)
    return p


def _threshold_spec(args) -> _Thresholds:
    if args.thresholds_file is not None:
        if args.range is not None:
            raise CLIError("--range and --thresholds-file cannot be combined")
        if args.thresholds is not None:
            raise CLIError("--thresholds N and --thresholds-file cannot be combined "
                           "(the file gives the thresholds)")
        from ._io import read_thresholds

        try:
            values = read_thresholds(args.thresholds_file)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
        return _Thresholds(values=values, source=args.thresholds_file)
    count = DEFAULT_COUNT if args.thresholds is None else args.thresholds
    if args.range is not None:
        lo, hi = args.range
        if lo > hi:
            raise CLIError(f"--range LO HI needs LO <= HI, got {lo:g} > {hi:g}")
        from ._checks import evenly_spaced  # linspace, also where HI - LO overflows

        return _Thresholds(values=evenly_spaced(lo, hi, count), source=f"--range {lo:g} {hi:g}")
    return _Thresholds(count=count, source="per image")


def _samples():
    """(name, loader) of the bundled samples."""

    def coins():
        from skimage import data

        return data.coins()

    def blobs3d():
        from scipy.ndimage import gaussian_filter
        from skimage import data

        blobs = data.binary_blobs(length=128, n_dim=3, volume_fraction=0.3, rng=0)
        return gaussian_filter(blobs.astype(np.float32), sigma=2)

    return [("coins", coins), ("blobs3d", blobs3d)]


def _check_paths(paths) -> None:
    from ._io import SUPPORTED_EXTENSIONS

    for path in paths:
        if not os.path.exists(path):
            raise CLIError(f"{path}: no such file")
        if os.path.isdir(path) and path.rstrip("/\\").lower().endswith(".zarr"):
            continue  # a Zarr array is a folder
        if not os.path.isfile(path):
            raise CLIError(f"{path}: not a file")
        ext = os.path.splitext(path)[1].lower()
        if ext not in SUPPORTED_EXTENSIONS:
            raise CLIError(f"{path}: unsupported file type {ext or '(no extension)'!r} "
                           f"(use {', '.join(SUPPORTED_EXTENSIONS)})")


def _compute(name, image, spec: _Thresholds, connectivity: str, device: str, *, timed: bool,
             boundary="box") -> _Result:
    """The ECC of one host image on ``device``; ``timed`` adds a warm-up on the GPU and a timing."""
    import cutopo
    from ._array import to_device, to_numpy

    conn = 1 if connectivity == "1" else image.ndim
    x = to_device(image, device)
    try:
        if spec.shared:
            thresholds = to_device(spec.values, device)
            values = spec.values
        else:
            thresholds = spec.count
            values = to_numpy(cutopo.linear_thresholds(x, spec.count))
        if timed and device == "gpu":  # the first call compiles the kernel: keep it out of the timing
            to_numpy(cutopo.ecc(x, thresholds, connectivity=conn, boundary=boundary))
        start = time.perf_counter()
        curve = to_numpy(cutopo.ecc(x, thresholds, connectivity=conn, boundary=boundary))
        seconds = time.perf_counter() - start
    except (ValueError, TypeError) as exc:
        raise CLIError(f"{name}: {exc}") from None
    return _Result(name=name, shape=tuple(image.shape), dtype=image.dtype, thresholds=np.asarray(values),
                   curve=np.asarray(curve, dtype=np.int64), seconds=seconds, device=device,
                   connectivity=conn)


def _streams(path, args) -> bool:
    """Whether a file is read in slabs: --stream, --scheduler, or a Zarr folder."""
    return (args.stream or args.scheduler is not None
            or path.rstrip("/\\").lower().endswith(".zarr"))


def _compute_streamed(path, spec: _Thresholds, connectivity: str, device: str, scheduler,
                      boundary="box") -> _Result:
    """The ECC of a file read in slabs (cutopo.ecc streaming), or with cutopo.dask on a
    dask.distributed scheduler when ``scheduler`` is an address."""
    import cutopo
    from . import _stream
    from ._array import to_numpy
    from ._io import LazyFile

    name = os.fspath(path)
    try:
        src = LazyFile(name)
    except ImportError as exc:
        raise CLIError(f"{name}: {exc} (pip install zarr)") from None
    conn = 1 if connectivity == "1" else src.ndim
    start = time.perf_counter()
    try:
        if scheduler is not None:
            curve, values = _compute_on_scheduler(src, spec, conn, device, scheduler, boundary)
        else:
            values = spec.values
            if not spec.shared:
                source = _stream.check_source(src, None)
                values = _stream.linear_thresholds(
                    source, spec.count,
                    _stream.ecc_slab_bytes(None, "cuda" if device == "gpu" else "cpu", source))
            curve = cutopo.ecc(src, values, connectivity=conn, boundary=boundary,
                               device="cuda" if device == "gpu" else "cpu")
    except (ValueError, TypeError) as exc:
        raise CLIError(f"{name}: {exc}") from None
    return _Result(name=name, shape=tuple(src.shape), dtype=src.dtype, thresholds=np.asarray(values),
                   curve=np.asarray(to_numpy(curve), dtype=np.int64),
                   seconds=time.perf_counter() - start, device=device, connectivity=conn)


def _compute_on_scheduler(src, spec: _Thresholds, conn: int, device: str, scheduler,
                          boundary="box"):
    """(curve, thresholds) of a LazyFile with cutopo.dask on a dask.distributed scheduler."""
    try:
        import dask.array as da
        import distributed

        import cutopo.dask as cd
    except ImportError as exc:
        raise CLIError(f"--scheduler needs Dask: pip install 'cutopo[dask]' ({exc})") from None
    try:
        client = distributed.Client(scheduler, timeout="30s")
    except OSError as exc:
        raise CLIError(f"--scheduler {scheduler}: cannot connect ({exc})") from None
    with client:
        return _scheduled_ecc(client, da, cd, src, spec, conn, device, boundary)


def _scheduled_ecc(client, da, cd, src, spec: _Thresholds, conn: int, device: str,
                   boundary="box"):
    plane = math.prod(src.shape[1:]) * src.dtype.itemsize
    darr = da.from_array(src, chunks=(max(1, (128 << 20) // plane),) + tuple(src.shape[1:]),
                         asarray=True, fancy=False)
    if device == "gpu":  # CuPy chunks on the workers' GPUs
        import cupy

        darr = darr.map_blocks(cupy.asarray, meta=cupy.empty((0,) * src.ndim, dtype=src.dtype))
    values = spec.values if spec.shared else cd._linear_thresholds(darr, spec.count)
    curve = client.compute(cd.ecc(darr, values, connectivity=conn, boundary=boundary)).result()
    return curve, values


def _fmt_value(v, dtype) -> str:
    """Exact text of a threshold: integers as such, floats as the shortest repr of their value."""
    if dtype.kind in "iub":
        return str(int(v))
    return repr(float(v))


def _fmt_shape(shape) -> str:
    return "x".join(str(s) for s in shape)


def write_csv(path: str, results: list[_Result], shared: bool) -> None:
    _ensure_parent(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if shared:
            t = results[0].thresholds
            w.writerow(["path", "shape", "dtype"] + [_fmt_value(v, t.dtype) for v in t])
            for r in results:
                w.writerow([r.name, _fmt_shape(r.shape), r.dtype.name] + [str(int(v)) for v in r.curve])
        else:
            T = results[0].curve.size if results else 0
            w.writerow(["path", "shape", "dtype", "quantity"] + [str(k) for k in range(T)])
            for r in results:
                head = [r.name, _fmt_shape(r.shape), r.dtype.name]
                w.writerow(head + ["threshold"] + [_fmt_value(v, r.thresholds.dtype) for v in r.thresholds])
                w.writerow(head + ["chi"] + [str(int(v)) for v in r.curve])


def plot_curves(path: str, results: list[_Result], *, per_result: bool, title: str,
                max_curves: int = 200) -> int:
    """Plot the curves (one subplot each, or all in one axes); returns how many were drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    _ensure_parent(path)
    if per_result:
        n = len(results)
        fig = Figure(figsize=(4.8 * n, 4.0), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, n, squeeze=False)[0]
        for ax, r in zip(axes, results):
            ax.plot(r.thresholds, r.curve, lw=1.5)
            ax.axhline(0, color="0.6", lw=0.8, zorder=0)
            ax.set_title(f"{r.name}  {_fmt_shape(r.shape)} {r.dtype.name}")
            ax.set_xlabel("threshold t")
            ax.set_ylabel(r"$\chi(\{f \leq t\})$")
            ax.grid(alpha=0.3)
        drawn = n
    else:
        fig = Figure(figsize=(7.0, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        shown = results[:max_curves]
        for r in shown:
            ax.plot(r.thresholds, r.curve, lw=1.0, alpha=0.9 if len(shown) <= 10 else 0.4,
                    label=os.path.basename(r.name))
        ax.axhline(0, color="0.6", lw=0.8, zorder=0)
        ax.set_xlabel("threshold t")
        ax.set_ylabel(r"$\chi(\{f \leq t\})$")
        ax.grid(alpha=0.3)
        if len(shown) <= 10:
            ax.legend(fontsize="small")
        drawn = len(shown)
        if drawn < len(results):
            title += f" (first {drawn} of {len(results)} files)"
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    return drawn


def _chi_points(r: _Result, n: int = 5) -> str:
    T = r.curve.size
    ks = sorted(set(int(round(q * (T - 1))) for q in np.linspace(0, 1, n)))
    return "  ".join(f"χ({r.thresholds[k]:.4g})={int(r.curve[k])}" for k in ks)


def _print_table(rep: _Reporter, results: list[_Result]) -> None:
    rows = [("sample", "shape", "dtype", "device", "thresholds", "χ at 5 of them", "ms")]
    for r in results:
        t = r.thresholds
        rows.append((r.name, _fmt_shape(r.shape), r.dtype.name, r.device,
                     f"{t[0]:.4g} .. {t[-1]:.4g} ({t.size})", _chi_points(r), f"{1e3 * r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1])] + [row[-1].rjust(widths[-1])]
        rep.say("  ".join(cells).rstrip())


def run_ecc(args) -> int:
    rep = _Reporter(args.quiet)
    spec = _threshold_spec(args)
    if args.npy is not None and not spec.shared:
        raise CLIError("--npy needs one set of thresholds shared by all images: pass --range LO HI "
                       "or --thresholds-file FILE (--thresholds N alone gives each image its own range)")
    device = _resolve_device(args.device)
    conn_text = "1" if args.connectivity == "1" else "full (ndim)"
    results: list[_Result] = []

    if not args.paths:
        for name, load in _samples():
            results.append(_compute(name, load(), spec, args.connectivity, device, timed=True,
                                    boundary=args.boundary))
        rep.say(f"cutopo {__version__}: Euler characteristic curves, connectivity {conn_text}, "
                f"boundary {args.boundary}, thresholds {spec.source}")
        _print_table(rep, results)
    else:
        from tqdm import tqdm

        from ._io import read_image

        _check_paths(args.paths)
        with tqdm(args.paths, desc="ecc", unit="file", disable=args.quiet, file=sys.stderr) as bar:
            for path in bar:
                if _streams(path, args):
                    results.append(_compute_streamed(path, spec, args.connectivity, device,
                                                     args.scheduler, args.boundary))
                    continue
                try:
                    image = read_image(path, note=rep.note)
                except Exception as exc:  # decoders raise many kinds: report, exit 2
                    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise CLIError(message if message.startswith(f"{path}:")
                                   else f"{path}: cannot read ({message})") from None
                results.append(_compute(path, image, spec, args.connectivity, device, timed=False,
                                        boundary=args.boundary))
        rep.say(f"{len(results)} file(s), {spec.size} thresholds ({spec.source}), "
                f"connectivity {conn_text}, boundary {args.boundary}, device {device}")

    csv_path = args.csv if args.csv is not None else (
        os.path.join(args.out, "ecc.csv") if args.paths else None)
    if csv_path is not None:
        write_csv(csv_path, results, spec.shared)
        rep.say(f"wrote {csv_path}")
    if args.npy is not None:
        _ensure_parent(args.npy)
        np.save(args.npy, np.stack([r.curve for r in results]).astype(np.int64))
        rep.say(f"wrote {args.npy}")
    if not args.no_plot:
        png = os.path.join(args.out, "ecc_curves.png")
        plot_curves(png, results, per_result=not args.paths,
                    title=f"Euler characteristic curves, connectivity {conn_text}")
        rep.say(f"wrote {png}")
    return 0


# --------------------------------------------------------------------------------------------
# Entry point

def add_register_parser(subparsers) -> argparse.ArgumentParser:
    """``cutopo register`` (CPAB registration), from its own module, imported when the parser is built."""
    from ._cli_register import add_register_parser as add

    return add(subparsers)


#: Functions adding one subcommand each to the parser's subparsers (see the module docstring).
COMMANDS: list[Callable] = [add_ecc_parser, add_register_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cutopo", description="Fast GPU/CPU topological and geometric operators.")
    parser.add_argument("--version", action="version", version=f"cutopo {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv=None) -> int:
    """Run the program on ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    try:
        return int(args.run(args))
    except (CLIError, ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"cutopo {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("cutopo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
