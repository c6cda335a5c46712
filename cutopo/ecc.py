"""Euler characteristic curves of 2D/3D images: exact, integer, batched, on NumPy or CuPy arrays."""
from __future__ import annotations

import types

import numpy as np

from . import _ecc_cupy, _ecc_numpy, _stream
from ._array import is_cupy_array
from ._checks import (check_boundary, check_connectivity, check_image, check_result_memory,
                      check_thresholds, is_count, linear_thresholds, same_array_type)

__all__ = ["ecc", "euler_contributions", "linear_thresholds", "soft_ecc", "expected_euler", "ect",
           "soft_ect"]


def ecc(image, thresholds, *, ndim=None, connectivity=1, boundary="box", device=None,
        max_slab_bytes=None):
    """Exact Euler characteristic curve of the sublevel filtration of an image.

    Entry k of the result is the Euler characteristic of the sublevel set
    ``{x : image[x] <= thresholds[k]}``, for every image of the batch, in one pass.

    Parameters
    ----------
    image : ndarray, shape (*batch, *spatial)
        NumPy or CuPy array of dtype bool, uint8, uint16, int16, int32, float16, float32 or
        float64 (NumPy arrays in either byte order: big-endian data are converted). The last
        ``ndim`` axes are spatial; leading axes are a batch. NaN pixels never enter a sublevel
        set (they act as +inf).
    thresholds : int or 1-D array
        Sorted (non-decreasing), finite threshold values, or a count ``n`` meaning ``n`` evenly
        spaced thresholds from the image's finite minimum to its finite maximum, inclusive
        (see :func:`linear_thresholds`; computed once per call and shared by the batch).
    ndim : {None, 2, 3}, optional
        Number of trailing spatial axes. ``None`` means ``image.ndim``, which must be 2 or 3.
    connectivity : {1, ndim}, optional
        ``1``: pixels are the vertices of a cubical complex and every cell takes the largest
        value of its vertices (V construction; 4-connected foreground in 2D, 6-connected in
        3D). ``ndim``: pixels are the top cells and every lower cell takes the smallest value
        of the pixels around it (T construction; 8- / 26-connected). The curve equals
        ``skimage.measure.euler_number(image <= t, connectivity=connectivity)`` at every t
        (with ``boundary="box"``).
    boundary : {"box", "periodic"}, optional
        ``"box"`` (default): the complex of the image's box; positions outside it are empty,
        and the curve ends at 1 once every pixel is in (the box is contractible).
        ``"periodic"``: the cubical complex of the torus, every spatial axis wrapping around
        (simulation and cosmology boxes). V: the cells spanning the wrap (e.g. the edge between
        the last and the first pixel of a row) are included, with the max of their vertices.
        T: the faces on the wrap are shared by the last and the first pixel and take the min
        of them. The torus has Euler characteristic 0 in 2D and 3D, so the curve ends at 0
        once every pixel is in.
        Every spatial axis must have length >= 3 (with 1 or 2 the torus complex
        degenerates). CuPy inputs run the box kernel on a copy padded by one wrapped pixel per
        side (that much more device memory); streamed through the GPU, each slab is padded so
        on the device (the slab bound then counts each voxel twice).
    device : {None, "cpu", "cuda"}, optional
        Where a host input is computed. ``None`` (default): where it lives (NumPy arrays,
        memmaps and other host array-likes on the CPU, CuPy arrays on their GPU). ``"cuda"``:
        a host input is streamed through the current GPU (see Out-of-core inputs); the result
        is still a NumPy array. ``"cpu"`` with a CuPy array raises TypeError.
    max_slab_bytes : int, optional
        Stream a host input in slabs that take at most this many bytes (see Out-of-core
        inputs); given for an in-memory NumPy array, it bounds the working memory of the
        CPU path. Default, for inputs that stream: 256 MiB on the CPU, 128 MiB on the GPU (so
        that several slabs keep the copy/compute pipeline busy), or 8 planes if that is more.

    Returns
    -------
    curve : ndarray of int64, shape (*batch, T)
        Same array type as ``image`` (NumPy for every streamed host input).

    Out-of-core inputs
    ------------------
    A ``numpy.memmap``, or any object that has ``shape``, ``dtype`` and NumPy-style slicing
    through ``__getitem__`` but is not an in-memory NumPy or CuPy array (a Zarr array, an h5py
    dataset, ...), is **streamed**: read in slabs of planes along the first spatial axis, each
    with a one-plane halo on both sides, never whole. So is a NumPy array with
    ``device="cuda"`` or with ``max_slab_bytes``. Each slab adds the contributions of the
    pixels of its own planes to one integer histogram (the halo planes are only neighbours),
    so the result equals the in-memory result exactly. Small images of a batch are read whole,
    several per slab. A threshold count costs one more pass (the minimum and maximum).

    Memory bound, with ``S = max_slab_bytes``: on the CPU a slab's input plus its keys (2 bytes
    per pixel, 4 with 65535 thresholds or more) take at most S, and the temporaries about 8 MiB
    more (a slab is counted in tiles of at most 2^17 pixels, planes and rows split as needed, so
    this holds for planes of any size), plus the (*batch, T) int64 histogram. On the GPU a
    slab's input takes at most S; the call allocates two device slab buffers and two pinned host
    buffers of that size (fewer bytes when the input is smaller), plus the (*batch, T) int64
    histogram; a source that is already pinned (``cupyx.empty_pinned``) is copied to the device
    directly, without the host buffers; a pageable one is read into them by host threads (its
    throughput is then bounded by the host's memory bandwidth: each byte is read, written to
    pinned memory and read again by the copy engine). While the GPU histograms slab k, slab
    k + 1 is copied (second CUDA stream) and slab k + 2 read into pinned memory. A slab needs
    at least one plane besides its two halo planes: a smaller S raises ValueError. A threshold
    count's minimum/maximum pass reads the same slabs, input only (no larger S needed than with
    explicit thresholds). Periodic slabs read their halo planes modulo the first axis' length
    and are padded along the other axes.

    Notes
    -----
    The comparison ``image <= t`` is made in ``numpy.result_type(image, thresholds)`` on both
    backends, so GPU and CPU results are identical. The curve is the cumulative histogram of
    the contribution map (:func:`euler_contributions`) over the threshold bins; the CUDA
    kernel forms each pixel's contribution on its threshold bin, which yields the same curve
    (the sublevel set at ``t_k`` is exactly the set of pixels whose bin is at most k).

    Convention: array axes are spatial axes in C order (``(rows, cols)`` in 2D,
    ``(planes, rows, cols)`` in 3D); positions outside the image are empty
    (``boundary="box"``) or the image repeats (``boundary="periodic"``).

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> image = np.array([[0, 2, 0],
    ...                   [2, 2, 2],
    ...                   [0, 2, 0]], dtype=np.uint8)
    >>> cutopo.ecc(image, [0, 1, 2])          # four isolated zeros, then one square
    array([4, 4, 1])
    >>> cutopo.ecc(image, [0, 1, 2], connectivity=2)
    array([4, 4, 1])

    On the torus the four corners touch across the wrap and form one filled square; the whole
    torus has Euler characteristic 0:

    >>> cutopo.ecc(image, [0, 1, 2], boundary="periodic")
    array([1, 1, 0])
    >>> ring = np.array([[1, 1, 1],
    ...                  [0, 0, 0],
    ...                  [1, 1, 1]], dtype=np.uint8)
    >>> cutopo.ecc(ring, [0, 1], boundary="periodic")   # a full row wraps into a circle
    array([0, 0])

    A volume on disk, streamed in slabs of at most 1 MiB (the result is the in-memory one):

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "vol.u8")
    >>> vol = np.memmap(path, dtype=np.uint8, mode="w+", shape=(64, 128, 128))
    >>> vol[:] = np.random.default_rng(0).integers(0, 4, vol.shape)
    >>> curve = cutopo.ecc(vol, [0, 1, 2, 3], max_slab_bytes=1 << 20)
    >>> bool((curve == cutopo.ecc(np.asarray(vol), [0, 1, 2, 3])).all())
    True

    References
    ----------
    .. [1] H. Wang, H. Wagner, C. Chen, "GPU computation of the Euler characteristic curve for
       imaging data", SoCG 2022.
    .. [2] J. Ohser, W. Nagel, K. Schladitz, "The Euler number of discretized sets - on the
       choice of adjacency in homogeneous lattices", 2002.
    """
    key = None
    if device is None and max_slab_bytes is None:  # a repeated CuPy call skips the checks
        key = _ecc_cupy.repeated_key(image, thresholds, ndim, connectivity, boundary)
        out = None if key is None else _ecc_cupy.repeated_ecc(key, image)
        if out is not None:
            return out
    streamed, backend, slab = _stream.route(image, device, max_slab_bytes, op="ecc")
    if streamed:
        return _streamed_ecc(image, thresholds, ndim, connectivity, boundary, backend, slab)
    image, ndim = check_image(image, ndim)
    tconn = check_connectivity(connectivity, ndim)
    periodic = check_boundary(boundary, image, ndim)
    same_array_type(image, [("thresholds", thresholds)])
    t, _ = check_thresholds(thresholds, image)
    if is_cupy_array(image):
        return _ecc_cupy.ecc(image, t, ndim, tconn, periodic, key)
    check_result_memory(image.shape[:image.ndim - ndim], (t.size,), 16)  # histogram, curve
    return _ecc_numpy.ecc(image, t, ndim, tconn, periodic)


def _streamed_ecc(image, thresholds, ndim, connectivity, boundary, backend, slab):
    """ecc of a host source read in slabs (cutopo._stream); same checks as the in-memory call."""
    src = _stream.check_source(image, ndim)
    tconn = check_connectivity(connectivity, src.ndim)
    periodic = check_boundary(boundary, types.SimpleNamespace(shape=src.shape, ndim=len(src.shape)),
                              src.ndim)
    same_array_type(image, [("thresholds", thresholds)])
    probe = np.empty(0, dtype=src.dtype)
    if is_count(thresholds):
        thresholds = _stream.linear_thresholds(src, thresholds,
                                               _stream.ecc_slab_bytes(slab, backend, src))
    t, _ = check_thresholds(thresholds, probe)
    return _stream.ecc(src, t, tconn, periodic, backend, slab)


def euler_contributions(image, *, ndim=None, connectivity=1, boundary="box"):
    """Per-pixel Euler characteristic contributions c(p) of the sublevel filtration.

    Order the pixels by (value, linear C-order index), NaN as +inf. In the V construction
    (``connectivity=1``) every cell is owned by its latest vertex; in the T construction
    (``connectivity=ndim``) every lower cell is owned by the earliest pixel around it. c(p) is
    the sum of (-1)^dim over the cells p owns, so the ECC at t is the sum of c over the pixels
    with value <= t, and ``c.sum()`` over an image is 1 (the Euler characteristic of a box).

    With ``boundary="periodic"`` the cells are those of the torus complex (the cells spanning
    the wrap included) and the neighbours of a border pixel are the wrapped-around pixels,
    still compared by (value, real linear index); ``c.sum()`` is then 0 per image (the Euler
    characteristic of the torus).

    Parameters
    ----------
    image : ndarray, shape (*batch, *spatial)
        As for :func:`ecc`.
    ndim : {None, 2, 3}, optional
    connectivity : {1, ndim}, optional
    boundary : {"box", "periodic"}, optional
        As for :func:`ecc` (``"periodic"``: every spatial axis >= 3; NumPy and CuPy inputs
        give the same map, ties across the wrap included).

    Returns
    -------
    c : ndarray of int8, same shape and array type as ``image``
        Values lie in [-3, 1] in 2D, [-5, 7] (V) or [-7, 5] (T) in 3D.

    Convention: as for :func:`ecc`.

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> cutopo.euler_contributions(np.array([[1.0, 0.0], [0.0, 1.0]]))
    array([[-1,  1],
           [ 1,  0]], dtype=int8)
    >>> c = cutopo.euler_contributions(np.arange(9.0).reshape(3, 3), boundary="periodic")
    >>> int(c.sum())
    0

    References
    ----------
    .. [1] H. Wang, H. Wagner, C. Chen, "GPU computation of the Euler characteristic curve for
       imaging data", SoCG 2022 (the same ownership rule for the T construction).
    """
    image, ndim = check_image(image, ndim)
    tconn = check_connectivity(connectivity, ndim)
    periodic = check_boundary(boundary, image, ndim)
    if is_cupy_array(image):
        return _ecc_cupy.euler_contributions(image, ndim, tconn, periodic)
    return _ecc_numpy.euler_contributions(image, ndim, tconn, periodic)


# The differentiable members of the family live in modules of their own (one op each).
from ._ect import ect, soft_ect  # noqa: E402
from ._expected_euler import expected_euler  # noqa: E402
from ._soft_ecc import soft_ecc  # noqa: E402
