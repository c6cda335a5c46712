"""Image and threshold files for the command-line program.

:func:`read_image` returns a 2-D image or a 3-D stack as a NumPy array in one of the dtypes
:func:`cutopo.ecc` accepts: colour images become grey, integer types the ops do not take are
widened (or, for 64-bit integers, narrowed where no value changes), and every such change is
reported through the ``note`` callback.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

import numpy as np

from ._array import native_byte_order
from ._checks import IMAGE_DTYPES

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
TIFF_EXTENSIONS = (".tif", ".tiff")
NPY_EXTENSIONS = (".npy",)
SUPPORTED_EXTENSIONS = IMAGE_EXTENSIONS + TIFF_EXTENSIONS + NPY_EXTENSIONS

Note = Optional[Callable[[str], None]]

__all__ = ["read_image", "read_thresholds", "SUPPORTED_EXTENSIONS"]


def _extension(path) -> str:
    return os.path.splitext(os.fspath(path))[1].lower()


def read_image(path, *, note: Note = None) -> np.ndarray:
    """Read a 2-D image or a 3-D stack from a PNG, JPEG, TIFF or NPY file.

    PNG/JPEG files are read with ``skimage.io.imread``, TIFF files with ``tifffile`` (first
    series; its axes tell colour samples from planes), NPY files with ``numpy.load``.
    RGB(A) images become grey through ``skimage.color.rgb2gray`` (float64 in [0, 1]; alpha is
    dropped), grey+alpha images keep their grey channel. NPY arrays are taken as they are (no
    colour conversion). Leading length-1 axes of data with more than 3 axes are dropped.

    Parameters
    ----------
    path : str or os.PathLike
    note : callable, optional
        Called with a one-line message for every conversion made.

    Returns
    -------
    image : numpy.ndarray, 2-D or 3-D, of a dtype :func:`cutopo.ecc` accepts

    Raises
    ------
    ValueError
        The extension is not supported, the data are not 2-D or 3-D, or the dtype cannot be
        converted; the message names the path.
    OSError
        The file cannot be opened or decoded.
    """
    note = note or (lambda message: None)
    name = os.fspath(path)
    ext = _extension(path)
    if ext in NPY_EXTENSIONS:
        try:
            data = np.load(name, allow_pickle=False)
        except ValueError as exc:  # pickled object arrays, corrupt headers
            raise ValueError(f"{name}: cannot read as a NumPy array ({exc})") from None
        if not isinstance(data, np.ndarray):
            raise ValueError(f"{name}: expected one array in the .npy file")
        colour = None
    elif ext in TIFF_EXTENSIONS:
        data, colour = _read_tiff(name)
    elif ext in IMAGE_EXTENSIONS:
        import skimage.io

        data = np.asarray(skimage.io.imread(name))
        colour = data.shape[-1] if data.ndim == 3 and data.shape[-1] in (2, 3, 4) else None
    else:
        supported = ", ".join(SUPPORTED_EXTENSIONS)
        raise ValueError(f"{name}: unsupported file type {ext or '(no extension)'!r} (use {supported})")

    if colour is not None:
        data = _to_grey(data, colour, name, note)
    if data.ndim > 3:
        squeezed = data.reshape(tuple(s for s in data.shape[:-3] if s != 1) + data.shape[-3:])
        if squeezed.ndim != data.ndim:
            note(f"{name}: dropped length-1 leading axes, {data.shape} -> {squeezed.shape}")
            data = squeezed
    if data.ndim not in (2, 3):
        raise ValueError(f"{name}: expected a 2-D image or a 3-D stack, got shape {data.shape}")
    if data.size == 0:
        raise ValueError(f"{name}: the image is empty (shape {data.shape})")
    return _supported_dtype(data, name, note)


def _read_tiff(name):
    """(data, number of colour samples or None) of the first series of a TIFF file.

    A samples axis ``S`` (RGB(A) or grey+alpha, contiguous or planar) is moved last and reported
    as colour; other axes (planes, pages, channels) are kept as they are.
    """
    import tifffile

    with tifffile.TiffFile(name) as tif:
        series = tif.series[0]
        data = np.asarray(series.asarray())
        axes = series.axes
        rgb = tif.pages[0].photometric == tifffile.PHOTOMETRIC.RGB
    if "S" not in axes or len(axes) != data.ndim:
        return data, None
    s = axes.index("S")
    samples = data.shape[s]
    if samples == 1:
        return np.squeeze(data, axis=s), None
    if (rgb and samples in (3, 4)) or samples == 2:
        return np.ascontiguousarray(np.moveaxis(data, s, -1)), samples
    return data, None


def _to_grey(data, channels, name, note):
    from skimage.color import rgb2gray

    if channels == 2:
        note(f"{name}: grey+alpha image, alpha channel dropped")
        return np.ascontiguousarray(data[..., 0])
    kind = "RGBA" if channels == 4 else "RGB"
    note(f"{name}: {kind} image converted to grey with skimage.color.rgb2gray (float64 in [0, 1])"
         + ("; alpha dropped" if channels == 4 else ""))
    return rgb2gray(data[..., :3])


def _supported_dtype(data, name, note):
    """``data`` in a dtype :func:`cutopo.ecc` accepts, converting without changing any value's order."""
    # Big-endian data (a TIFF in Motorola byte order, a .npy written on such a machine) first
    # take the machine's byte order: '>u2' is then uint16, not a 2-byte integer to widen.
    data = native_byte_order(np.asarray(data))
    if data.dtype in IMAGE_DTYPES:
        return data
    kind = data.dtype.kind
    if kind == "f":
        target = np.dtype(np.float64)
        if data.dtype.itemsize > 8:  # long double: the only float that float64 cannot hold
            note(f"{name}: {data.dtype} data rounded to float64 (close values may merge)")
            return data.astype(target)
    elif kind == "i" and data.dtype.itemsize == 1:  # int8
        target = np.dtype(np.int16)
    elif kind in "iu":
        lo, hi = int(data.min()), int(data.max())
        info = np.iinfo(np.int32)
        if info.min <= lo and hi <= info.max:
            target = np.dtype(np.int32)
        elif max(abs(lo), abs(hi)) <= 2 ** 53:
            target = np.dtype(np.float64)
        else:
            raise ValueError(f"{name}: {data.dtype} values up to {max(abs(lo), abs(hi))} do not fit "
                             f"int32 or float64 exactly")
    else:
        raise ValueError(f"{name}: dtype {data.dtype} is not a real number type")
    note(f"{name}: {data.dtype} data converted to {target} (no value changes)")
    return data.astype(target)


def read_thresholds(path) -> np.ndarray:
    """Threshold values from a ``.npy`` file or a text file, checked to be finite and sorted.

    Text files hold numbers separated by whitespace, commas or newlines; ``#`` starts a
    comment. ``.npy`` files keep their dtype (integer or floating).

    Raises
    ------
    ValueError
        The file is missing or unreadable, or the values are empty, not numbers, not finite, or
        not sorted in non-decreasing order; the message names the path.
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ValueError(f"{name}: no such thresholds file")
    try:
        if _extension(name) in NPY_EXTENSIONS:
            values = np.load(name, allow_pickle=False)
            if not isinstance(values, np.ndarray):
                raise ValueError("expected one array in the .npy file")
            if values.dtype.kind not in "iuf":
                raise ValueError(f"dtype {values.dtype} is not a real number type")
            if values.ndim != 1:
                raise ValueError(f"expected a 1-D array, got shape {values.shape}")
        else:
            words = []
            with open(name, encoding="utf-8") as f:
                for line in f:
                    words += line.split("#", 1)[0].replace(",", " ").split()
            try:
                values = np.array([float(w) for w in words], dtype=np.float64)
            except ValueError as exc:
                raise ValueError(f"not a number: {str(exc).split(': ', 1)[-1]}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot read thresholds ({exc})") from None
    if values.size == 0:
        raise ValueError(f"{name}: no threshold values in the file")
    if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
        raise ValueError(f"{name}: thresholds must be finite (found NaN or inf)")
    if values.size > 1 and not np.all(values[1:] >= values[:-1]):
        k = int(np.flatnonzero(values[1:] < values[:-1])[0])
        raise ValueError(f"{name}: thresholds must be sorted in non-decreasing order "
                         f"(value {k + 1} is {values[k]}, value {k + 2} is {values[k + 1]})")
    return values


# ---------------------------------------------------------------------------------------------
# Out-of-core files

ZARR_EXTENSIONS = (".zarr",)
LAZY_EXTENSIONS = NPY_EXTENSIONS + TIFF_EXTENSIONS + ZARR_EXTENSIONS


class LazyFile:
    """A 2-D image or 3-D stack on disk, read only where it is sliced (``cutopo.ecc`` streams it).

    ``.npy`` files are memory-mapped (``numpy.load(mmap_mode="r")``); TIFF files are memory-mapped
    when their data are contiguous and uncompressed (``tifffile.memmap``), else read through
    tifffile's Zarr store, page by page; ``.zarr`` folders are opened with ``zarr.open_array``.
    The object holds the path only: it pickles small, so Dask workers reopen the file where they
    run (the path must be readable there). Leading length-1 axes of data with more than 3 axes
    are dropped; colour TIFFs and dtypes the ops do not take raise ValueError (read those into
    memory instead, without streaming).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        with self._opened() as data:
            shape = tuple(int(s) for s in data.shape)
            dtype = np.dtype(data.dtype)
        self._lead = 0
        while len(shape) - self._lead > 3 and shape[self._lead] == 1:
            self._lead += 1
        self.shape = shape[self._lead:]
        self.dtype = dtype
        self.ndim = len(self.shape)
        if self.ndim not in (2, 3):
            raise ValueError(f"{self.path}: expected a 2-D image or a 3-D stack, got shape {shape}")
        if self.dtype not in IMAGE_DTYPES:
            raise ValueError(f"{self.path}: dtype {self.dtype} cannot be streamed (cutopo.ecc takes "
                             f"{', '.join(d.name for d in IMAGE_DTYPES)}); read it into memory instead")

    @contextlib.contextmanager
    def _opened(self):
        """The file's data, open for the ``with`` block. A compressed TIFF's store (an open
        file handle) is closed on exit; a memory map is released with the last view of it, by
        reference counting (the views :meth:`__getitem__` returns are not copied)."""
        ext = _extension(self.path)
        if ext in NPY_EXTENSIONS:
            yield np.load(self.path, mmap_mode="r", allow_pickle=False)
            return
        if ext in ZARR_EXTENSIONS:
            import zarr

            yield zarr.open_array(self.path, mode="r")
            return
        if ext in TIFF_EXTENSIONS:
            import tifffile

            with tifffile.TiffFile(self.path) as tif:
                if "S" in tif.series[0].axes:
                    raise ValueError(f"{self.path}: colour TIFFs cannot be streamed; read them into "
                                     "memory instead")
            try:
                data = tifffile.memmap(self.path, mode="r")
            except ValueError:  # compressed or scattered pages: read through the Zarr store
                data = None
            if data is not None:
                yield data
                return
            import zarr

            store = tifffile.imread(self.path, aszarr=True)
            try:
                yield zarr.open(store, mode="r")
            finally:
                store.close()
            return
        raise ValueError(f"{self.path}: unsupported file type {ext or '(no extension)'!r} for streaming "
                         f"(use {', '.join(LAZY_EXTENSIONS)})")

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        with self._opened() as data:
            return np.asarray(data[(0,) * self._lead + key])

    def __reduce__(self):
        return (LazyFile, (self.path,))

    def __repr__(self):
        return f"LazyFile({self.path!r}, shape={self.shape}, dtype={self.dtype})"
