"""CPAB tessellations of [0, 1]^K: cells, vertices and free vertex velocities, and point location.

The cell layouts are those of libcpab (``libcpab/core/tesselation.py``), copied unchanged into
FG-CPAB (``cpab/core/tesselation.py``), so cell numbers and the vertex order inside a cell carry
over: intervals in 1D, 4 triangles around an added centre vertex per rectangle in 2D, and 5
tetrahedra per cube in 3D with the corner labels rotated in every odd cube.

Vertices live on an integer grid: vertex ``v`` sits at ``grid[v] / (den * shape)``, with
``den = 2`` in 2D (the centre vertices fall on half cells) and ``den = 1`` otherwise. Integer
positions make the boundary tests exact and let the prior sample on a regular grid.
"""
from __future__ import annotations

import operator
import os

import numpy as np

from .._array import array_module, is_cupy_array
from .basis import affine_maps, nodal_basis
from .prior import sample_vertex_prior

__all__ = ["Tessellation", "cell_index", "ZERO_BOUNDARY"]

ZERO_BOUNDARY = ("noslip", "slip", None)

# Reference simplices: the local vertex positions of every simplex type of a box, in grid
# units, in libcpab's vertex order. libcpab names the box corners ul, ur, ll, lr: "u"/"l" the
# small/large axis-1 side, "l"/"r" (second letter) the small/large axis-0 side.

def _layout_1d():
    return np.array([[[0], [1]]])                        # one type: (left, right)


def _layout_2d():
    # half-cell units, so that the centre is on the grid; "order matters!" (libcpab)
    ul, ur, ll, lr, centre = (0, 0), (2, 0), (0, 2), (2, 2), (1, 1)
    return np.array([(centre, ul, ur),                   # 0: small axis-1 side ("top")
                     (centre, ur, lr),                   # 1: large axis-0 side ("right")
                     (centre, lr, ll),                   # 2: large axis-1 side ("bottom")
                     (centre, ll, ul)])                  # 3: small axis-0 side ("left")


def _layout_3d():
    types = []
    for odd in (False, True):
        ul, ur, ll, lr = (0, 0), (1, 0), (0, 1), (1, 1)
        if odd:                                          # libcpab: ul,ur,lr,ll <- ur,lr,ll,ul
            ul, ur, lr, ll = ur, lr, ll, ul
        # suffix 0/1: the corner on the small/large axis-2 face
        c0 = {name: (*xy, 0) for name, xy in dict(ul=ul, ur=ur, ll=ll, lr=lr).items()}
        c1 = {name: (*xy, 1) for name, xy in dict(ul=ul, ur=ur, ll=ll, lr=lr).items()}
        types += [(c1["ll"], c1["ur"], c0["ul"], c0["lr"]),   # 0: central tetrahedron, volume 1/3
                  (c1["ul"], c1["ur"], c1["ll"], c0["ul"]),   # 1-4: corner tetrahedra, volume 1/6
                  (c1["lr"], c1["ur"], c1["ll"], c0["lr"]),
                  (c0["ll"], c0["ul"], c0["lr"], c1["ll"]),
                  (c0["ur"], c0["ul"], c0["lr"], c1["ur"])]
    return np.array(types)                               # types 0-4 even cubes, 5-9 odd cubes


# ndim -> (reference simplices (types, K+1, K), grid units per box)
_LAYOUTS = {1: (_layout_1d(), 1), 2: (_layout_2d(), 2), 3: (_layout_3d(), 1)}
SIMPLICES_PER_BOX = {1: 1, 2: 4, 3: 5}

# Peak bytes per possible nonzero of the basis while it is built (measured: 23 in 3D, 33 in
# 2D, 55 in 1D, where the vertex numbering dominates); used to refuse tessellations that
# cannot fit in memory.
_BUILD_BYTES_PER_ENTRY = 64


def _memory_budget() -> int:
    """Half the physical memory (8 GiB where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 << 30


def check_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of 1 to 3 positive ints (an int n means (n,))."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    try:
        items = list(shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of 1 to 3 positive ints, got {shape!r}") from None
    out = []
    for s in items:
        if isinstance(s, (bool, np.bool_)):
            raise TypeError(f"shape must hold ints, got {shape!r}")
        try:
            out.append(operator.index(s))
        except TypeError:
            raise TypeError(f"shape must hold ints, got {shape!r}") from None
    if not 1 <= len(out) <= 3:
        raise ValueError(f"shape must have 1, 2 or 3 entries (cells per axis), got {tuple(out)}")
    if any(s <= 0 for s in out):
        raise ValueError(f"shape must hold positive cell counts, got {tuple(out)}")
    return tuple(out)


def _check_fits(shape):
    ndim = len(shape)
    n_cells = SIMPLICES_PER_BOX[ndim] * int(np.prod(shape, dtype=object))
    # The kernels address a cell's row of an item's affine table (K (K + 1) entries per cell)
    # with 32-bit offsets (cpab.cu: step), so the table must have fewer than 2^31 entries.
    per_cell = ndim * (ndim + 1)
    if n_cells * per_cell >= 2**31:
        raise ValueError(f"shape={shape}: {n_cells} cells of {per_cell} affine entries each; at "
                         f"most {(2**31 - 1) // per_cell} cells (2^31 - 1 entries) are supported")
    entries = n_cells * ndim * (ndim + 1) ** 2           # an upper bound on nnz(basis)
    need, budget = entries * _BUILD_BYTES_PER_ENTRY, _memory_budget()
    if need > budget:
        raise ValueError(f"shape={shape}: the basis of {n_cells} cells needs about "
                         f"{need / 2**30:.3g} GiB to build, more than the {budget / 2**30:.3g} GiB "
                         f"allowed (half the physical memory); use fewer cells")


def _box_indices(shape):
    """(n_boxes, K) integer box positions, axis 0 fastest (libcpab's cell order)."""
    grids = np.indices(shape[::-1], dtype=np.int64).reshape(len(shape), -1)
    return np.ascontiguousarray(grids[::-1].T)


class Tessellation:
    """A CPAB tessellation of the unit box [0, 1]^K and its nodal velocity parameters.

    The velocity field is continuous and affine on every simplex (a P1 finite-element field), so
    it is fixed by its values at the vertices. Parameters ``theta`` are those vertex velocities,
    restricted to the components the boundary condition leaves free.

    Parameters
    ----------
    shape : int or sequence of 1 to 3 ints
        Grid cells ("boxes") per axis. ``(n,)``: n intervals. ``(nx, ny)``: rectangles, each split into 4
        triangles around an added centre vertex. ``(nx, ny, nz)``: boxes, each split into 5
        tetrahedra, the corner labels rotated in boxes whose index sum is odd (libcpab/FG-CPAB).
    zero_boundary : {"noslip", "slip", None}, optional
        ``"noslip"`` (default; FG-CPAB's ``zero_boundary=True``): zero velocity on the whole
        boundary, so only interior vertices carry parameters. ``"slip"`` (libcpab's
        ``zero_boundary=True``): only the normal component vanishes; a boundary vertex keeps the
        components tangent to *every* boundary face through it, i.e. component k is free unless
        the vertex lies on x_k = 0 or x_k = 1 (an edge vertex of a cube keeps one component, a
        box corner none). ``None``: free boundary, every vertex carries K parameters (the plain
        P1 space; libcpab's ``zero_boundary=False`` adds "valid outside" constraints on top,
        which make its field's extension beyond the box continuous; they are not imposed
        here). Trajectories may then leave the box, where :func:`~cutopo.cpab.integrate`
        steps with the affine extension of the cell of each point's clamped position: in 2-D
        and 3-D a discontinuous field, so the map is not a diffeomorphism of R^K on
        trajectories that leave the box and :func:`~cutopo.cpab.log_jacobian` does not
        certify that it does not fold there (integrate's Notes, "Outside the box").

    Attributes
    ----------
    shape : tuple of int
    ndim : int
        K, the dimension of the domain.
    zero_boundary : {"noslip", "slip", None}
    n_cells : int
        C, the number of simplices: n, 4 nx ny or 5 nx ny nz.
    n_vertices : int
    n_params : int
        d: (n-1) in 1D, 2[(nx-1)(ny-1) + nx ny] in 2D and 3(nx-1)(ny-1)(nz-1) in 3D under no-slip.
    vertices : ndarray of float64, shape (n_vertices, K)
        Vertex coordinates, in FG-CPAB's order (first seen when walking the cells in order).
    cells : ndarray of int64, shape (n_cells, K + 1)
        Vertex ids of each simplex, in libcpab's order.
    dof_vertex, dof_axis : ndarray of int64, shape (n_params,)
        ``theta[j]`` is the velocity component ``dof_axis[j]`` at vertex ``dof_vertex[j]``.
    basis : scipy.sparse.csr_matrix, shape (n_cells * K * (K + 1), n_params)
        B, with ``vec(A) = B @ theta``: row ``c*K*(K+1) + k*(K+1) + q`` is entry (k, q) of the
        affine map A_c of cell c (see :mod:`cutopo.cpab.basis`).
    dof_index : ndarray of int64, shape (n_vertices, K)
        The position in theta of each vertex velocity component, -1 where it is fixed at 0.
    vertex_grid, grid_denominator : ndarray of int64 (n_vertices, K), int
        Exact vertex positions: ``vertices == vertex_grid / (grid_denominator * shape)``
        (``grid_denominator`` is 2 in 2D, where the centres are at half cells, else 1).
    cell_box, cell_type : ndarray of int64, shapes (n_cells, K) and (n_cells,)
        The box of each cell and its simplex type: cell c is ``reference_vertices[cell_type[c]]``
        moved to box ``cell_box[c]`` (types 5-9 are the tetrahedra of odd boxes in 3D).

    Convention
    ----------
    Domain [0, 1]^K; coordinate k of a point is array axis k (of an image sampled on the box).
    Cells are numbered ``c = S * (i_0 + n_0 * (i_1 + n_1 * i_2)) + s`` for box (i_0, i_1, i_2)
    and simplex s of S per box (axis 0 fastest, as in libcpab). ``theta`` is vertex-major,
    component-minor: the free components of each vertex in increasing axis order, the vertices
    in FG-CPAB's order (first seen over the cells, each cell's vertices in libcpab's order).
    Under no-slip this is FG-CPAB's parameter order; FG-CPAB's basis columns are normalised,
    so its theta equals ours times the column norms of :attr:`basis`.

    Examples
    --------
    >>> from cutopo.cpab import Tessellation
    >>> tess = Tessellation((4, 3))
    >>> tess.n_cells, tess.n_params, tess.basis.shape
    (48, 36, (288, 36))
    >>> Tessellation((4, 3), zero_boundary="slip").n_params      # + 2 (4-1) + 2 (3-1) tangential
    46
    >>> Tessellation((3, 3, 3)).n_params
    24
    >>> int(tess.cell_index([0.6, 0.1]))                          # box (2, 0), triangle 0
    8

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Highly-expressive spaces
       of well-behaved transformations: keeping it simple", ICCV 2015.
    .. [2] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    .. [3] N. S. Detlefsen, libcpab, https://github.com/SkafteNicki/libcpab, 2018 (the cell layouts).
    .. [4] A. Aflalo, E. Treister, C. Baskin, O. Freifeld, FG-CPAB, https://github.com/BGU-CS-VIL/FG-CPAB
       (the nodal basis B = N Z and its vertex order).
    """

    def __init__(self, shape, zero_boundary="noslip"):
        shape = check_shape(shape)
        if isinstance(zero_boundary, (bool, np.bool_)) or zero_boundary not in ZERO_BOUNDARY:
            # True is refused: libcpab's True means "slip", FG-CPAB's means "noslip".
            raise ValueError(f"zero_boundary must be 'noslip', 'slip' or None, got {zero_boundary!r}")
        _check_fits(shape)
        self.shape = shape
        self.ndim = len(shape)
        self.zero_boundary = zero_boundary
        self._build_cells()
        self._build_dofs()
        self.basis = nodal_basis(self)
        self._device_bases = {}

    # -- construction -------------------------------------------------------------------------

    def _build_cells(self):
        K, shape = self.ndim, np.array(self.shape, dtype=np.int64)
        layout, den = _LAYOUTS[K]
        S = SIMPLICES_PER_BOX[K]
        boxes = _box_indices(self.shape)                                  # (Q, K)
        parity = boxes.sum(axis=1) % 2 if K == 3 else np.zeros(len(boxes), np.int64)
        types = parity[:, None] * S + np.arange(S)                        # (Q, S)
        # grid position of every cell vertex: (Q, S, K+1, K)
        grid = den * boxes[:, None, None, :] + layout[types]
        grid = grid.reshape(-1, K + 1, K)
        extent = den * shape + 1
        raw = np.ravel_multi_index(tuple(np.moveaxis(grid, -1, 0)), tuple(extent))
        # FG-CPAB numbers vertices in the order they are first met when walking the cells.
        uniq, first, inverse = np.unique(raw.ravel(), return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        new_id = np.empty(len(uniq), dtype=np.int64)
        new_id[order] = np.arange(len(uniq))
        self.cells = new_id[inverse.reshape(raw.shape)]
        position = np.unravel_index(uniq[order], tuple(extent))
        self.vertex_grid = np.stack(position, axis=1).astype(np.int64)
        self.grid_denominator = den
        self.reference_vertices = layout / den          # (types, K+1, K), box units
        self.vertices = self.vertex_grid / (den * shape)
        self.cell_type = types.reshape(-1)
        self.cell_box = np.repeat(boxes, S, axis=0)
        self.n_cells = len(self.cells)
        self.n_vertices = len(uniq)
        for a in (self.cells, self.vertex_grid, self.vertices, self.cell_type, self.cell_box,
                  self.reference_vertices):
            a.setflags(write=False)

    def _build_dofs(self):
        top = self.grid_denominator * np.array(self.shape)
        on_face = (self.vertex_grid == 0) | (self.vertex_grid == top)    # (V, K): on x_k = 0 or 1
        if self.zero_boundary == "noslip":
            free = np.broadcast_to(~on_face.any(axis=1, keepdims=True), on_face.shape)
        elif self.zero_boundary == "slip":
            free = ~on_face      # component k is tangent to every face except x_k = const
        else:
            free = np.ones_like(on_face)
        self.free_components = np.array(free)
        dof_vertex, dof_axis = np.nonzero(free)                           # vertex-major order
        self.dof_vertex, self.dof_axis = dof_vertex.astype(np.int64), dof_axis.astype(np.int64)
        self.dof_index = np.full(on_face.shape, -1, dtype=np.int64)
        self.dof_index[dof_vertex, dof_axis] = np.arange(len(dof_vertex))
        self.n_params = len(dof_vertex)
        for a in (self.free_components, self.dof_vertex, self.dof_axis, self.dof_index):
            a.setflags(write=False)

    # -- use ----------------------------------------------------------------------------------

    def __repr__(self):
        return (f"Tessellation(shape={self.shape}, zero_boundary={self.zero_boundary!r}): "
                f"{self.n_cells} cells, {self.n_vertices} vertices, {self.n_params} parameters")

    def cell_index(self, points):
        """The cell holding each point; see :func:`cell_index`."""
        return cell_index(points, self.shape)

    def basis_for(self, xp=np):
        """:attr:`basis` as a ``scipy.sparse`` (``xp=numpy``) or ``cupyx.scipy.sparse`` CSR matrix."""
        if xp is np:
            return self.basis
        if getattr(xp, "__name__", None) != "cupy":
            raise ValueError(f"xp must be numpy or cupy, got {xp!r}")
        if "cupy" not in self._device_bases:
            import cupyx.scipy.sparse

            self._device_bases["cupy"] = cupyx.scipy.sparse.csr_matrix(self.basis)
        return self._device_bases["cupy"]

    def affine_maps(self, theta):
        """Per-cell affine maps A_c = B theta, shape (*batch, n_cells, K, K+1), float64."""
        return affine_maps(self, theta)

    def vertex_velocities(self, theta):
        """The velocity at every vertex: theta scattered to shape (*batch, n_vertices, K), zeros
        at the fixed components."""
        theta = np.asarray(theta)
        if theta.shape[-1:] != (self.n_params,):
            raise ValueError(f"theta must have n_params={self.n_params} entries on its last axis, "
                             f"got shape {theta.shape}")
        out = np.zeros(theta.shape[:-1] + (self.n_vertices, self.ndim),
                       dtype=np.result_type(theta, np.float32))
        out[..., self.dof_vertex, self.dof_axis] = theta
        return out

    def sample(self, n, *, length_scale=0.1, scale=0.1, rng=None, xp=np):
        """Draw theta from a smooth Gaussian-process prior on the vertex velocities.

        Every velocity component is an independent zero-mean Gaussian process on [0, 1]^K with
        covariance ``scale**2 * exp(-|x - y|**2 / (2 * length_scale**2))`` (the kernel of
        libcpab's ``sample_transformation_with_prior``, put on the vertex velocities rather than
        on the affine maps); theta holds its values at the free components. The fixed
        components are dropped, not conditioned on (the prior is the marginal at the free
        ones). Drawn matrix-free: the kernel is separable, so the process on the regular vertex
        grid is white noise times one small square root per axis; no covariance of the vertices
        is formed.

        Parameters
        ----------
        n : int
            Number of draws.
        length_scale : float, optional
            Correlation length, in domain units (the domain has side 1).
        scale : float, optional
            Standard deviation of each velocity component (domain lengths per unit time).
        rng : None, int or numpy.random.Generator, optional
            Source of randomness (``numpy.random.default_rng(rng)``); the same rng state gives
            the same draws.
        xp : module, optional
            ``numpy`` (default) or ``cupy``: the array type of the result (drawn on the host).

        Returns
        -------
        theta : ndarray of float64, shape (n, n_params)

        Examples
        --------
        >>> from cutopo.cpab import Tessellation
        >>> tess = Tessellation((8, 8))
        >>> theta = tess.sample(4, length_scale=0.2, rng=0)
        >>> theta.shape
        (4, 226)
        >>> bool((theta == tess.sample(4, length_scale=0.2, rng=0)).all())
        True
        """
        theta = sample_vertex_prior(self, n, length_scale=length_scale, scale=scale, rng=rng)
        if xp is np:
            return theta
        if getattr(xp, "__name__", None) != "cupy":
            raise ValueError(f"xp must be numpy or cupy, got {xp!r}")
        return xp.asarray(theta)


# -- point location ---------------------------------------------------------------------------

def _two_sum(a, b):
    """s + e == a + b exactly, with s = fl(a + b) (Knuth)."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


def _sign_of_sum(terms):
    """The exact sign of a sum of floating-point arrays (-1, 0 or 1), by Shewchuk's
    grow-expansion: the sum becomes non-overlapping components in increasing magnitude, and the
    largest non-zero one has the sign of the sum."""
    expansion = [terms[0]]
    for t in terms[1:]:
        q, grown = t, []
        for e in expansion:
            q, h = _two_sum(q, e)
            grown.append(h)
        expansion = grown + [q]
    sign = np.zeros(np.shape(expansion[0]), dtype=np.int8)
    for e in reversed(expansion):
        sign = np.where(sign == 0, np.sign(e).astype(np.int8), sign)
    return sign


# 3D corner-tetrahedron tests, each "a X + b Y + c Z + const >= 0" in the box's local coordinates
# (X, Y, Z) in [0, 1]^3, tetrahedra 1..4 in the order tried. Even boxes use FG-CPAB's tests;
# odd boxes the same after its substitution (X, Y) <- (Y, 1 - X), written out so that no
# rounded 1 - X is formed.
_TET_TESTS = np.array([
    [[-1, -1, 1, 0], [1, 1, 1, -2], [-1, 1, -1, 0], [1, -1, -1, 0]],     # even box
    [[1, -1, 1, -1], [-1, 1, 1, -1], [-1, -1, -1, 1], [1, 1, -1, -1]],   # odd box
])


def _simplex_in_box(local, parity):
    """Which simplex of its box holds each point, from local coordinates in [0, 1]^K."""
    K = local.shape[-1]
    if K == 1:
        return np.zeros(local.shape[:-1], dtype=np.int64)
    one = np.ones((), dtype=local.dtype)
    if K == 2:
        x, y = local[..., 0], local[..., 1]
        below_diagonal = x < y                                          # FG-CPAB's bit1
        above_anti = _sign_of_sum([x, y, -one]) > 0                     # bit0: 1 - x < y
        tri = np.where(below_diagonal, np.where(above_anti, 2, 3), np.where(above_anti, 1, 0))
        return tri.astype(np.int64)
    coef = _TET_TESTS[parity].astype(local.dtype)                       # (..., 4, 4)
    tet = np.zeros(local.shape[:-1], dtype=np.int64)
    for t in range(3, -1, -1):                                          # the first test that holds wins
        a = coef[..., t, :]
        holds = _sign_of_sum([a[..., 0] * local[..., 0], a[..., 1] * local[..., 1],
                              a[..., 2] * local[..., 2], a[..., 3] * one]) >= 0
        tet = np.where(holds, t + 1, tet)
    return tet


def cell_index(points, shape):
    """The cell of the tessellation ``shape`` that holds each point (vectorised, exact).

    Parameters
    ----------
    points : array_like of float, shape (..., K)
        NumPy array (or array-like) of finite coordinates; float32 stays float32. A CuPy
        array runs the CUDA kernel (same cells; float16 is refused there).
    shape : sequence of int
        Cells per axis, as for :class:`Tessellation`.

    Returns
    -------
    cells : ndarray of int64, shape (...)
        Cell numbers as in :class:`Tessellation` (``S * box + simplex``).

    Notes
    -----
    Points outside [0, 1]^K are clamped to the box (each coordinate to [0, 1]): they get the
    cell of their nearest point of the domain.

    The rule is evaluated on the scaled coordinates ``u_k = x_k * n_k`` rounded in the points'
    dtype, and exactly from there on (error-free sums), so every point, including one lying on
    a face, gets one documented cell:

    - box: ``i_k = min(floor(u_k), n_k - 1)``; a point on the face between boxes m-1 and m
      (``u_k == m``) goes to box m, the larger index; ``u_k == n_k`` to the last box;
    - 2D, with local ``(x, y) = u - i`` (FG-CPAB's ``cuda_findcellidx_2D_fast``): triangle 0
      if x >= y and x + y <= 1, 1 if x >= y and x + y > 1, 2 if x < y and x + y > 1, else 3.
      So the diagonal x == y goes to triangles 0/1, the anti-diagonal to 0/3, the centre to 0;
    - 3D: the first corner tetrahedron whose test holds with ">=" (FG-CPAB's
      ``cuda_findcellidx_3D_fast``, tests in the order 1, 2, 3, 4), else the central one 0.
      A point on a face between a corner and the central tetrahedron goes to the corner one.

    Examples
    --------
    >>> from cutopo.cpab.tessellation import cell_index
    >>> cell_index([[0.5], [1.0], [-3.0]], (4,))            # the face x = 0.5 goes up, outside clamps
    array([2, 3, 0])
    >>> cell_index([[0.5, 0.5], [0.25, 0.25]], (1, 1))      # centre -> 0; diagonal -> 0
    array([0, 0])
    """
    shape = check_shape(shape)
    K = len(shape)
    on_device = is_cupy_array(points)
    xp = array_module(points)
    points = xp.asarray(points)
    if points.dtype.kind not in "fiu" or points.dtype.kind == "b":
        raise TypeError(f"points must be real numbers, got dtype {points.dtype}")
    if on_device and points.dtype == np.float16:
        raise TypeError("points: float16 is not supported on the GPU (use float32 or float64)")
    if points.dtype.kind != "f":
        points = points.astype(np.float64)
    if points.ndim == 0 or points.shape[-1] != K:
        raise ValueError(f"points must have shape (..., {K}) for a {K}-D tessellation, "
                         f"got {points.shape}")
    if not bool(xp.isfinite(points).all()):
        raise ValueError("points must be finite")
    if on_device:          # the kernel evaluates the rule below with the same roundings
        from . import _integrate_cupy

        return _integrate_cupy.cell_index(points, shape)
    n = np.array(shape, dtype=points.dtype)
    u = np.clip(points * n, 0, n)                                       # clamp to the domain
    box = np.minimum(np.floor(u), n - 1)
    local = u - box                                                     # exact: box <= u < box + 1
    box = box.astype(np.int64)
    parity = box.sum(axis=-1) % 2
    box_number = box[..., -1]
    for k in range(K - 2, -1, -1):                                      # axis 0 fastest
        box_number = box_number * shape[k] + box[..., k]
    return SIMPLICES_PER_BOX[K] * box_number + _simplex_in_box(local, parity)
