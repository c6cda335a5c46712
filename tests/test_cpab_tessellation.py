"""CPU tests of cutopo.cpab: Tessellation (layouts, parameters, sparse basis, point location,
prior) and velocity.

Expected values come from closed forms, from libcpab's measured dimensions (research notes
cpab.md 4.2), from slow loop re-implementations of the libcpab/FG-CPAB layouts written below
(exact rational coordinates, per-cell dense inverses), or from barycentric interpolation,
never from cutopo.cpab itself.
"""
from __future__ import annotations

import doctest
import importlib
import itertools
import math
import time
from fractions import Fraction

import numpy as np
import pytest

from cutopo.cpab import Tessellation, velocity
from cutopo.cpab.tessellation import cell_index

ZERO_BOUNDARIES = ["noslip", "slip", None]
SMALL_SHAPES = [(1,), (2,), (5,), (1, 1), (2, 3), (4, 4), (1, 1, 1), (2, 2, 2), (3, 2, 4)]


# ---------------------------------------------------------------------------------------------
# Oracles: the layouts written out with loops, as described in cpab.md 3 and 4.4


def oracle_cells(shape):
    """Per-cell vertex coordinates (tuples of Fractions), in libcpab's cell and vertex order."""
    K = len(shape)
    V = [[Fraction(i, n) for i in range(n + 1)] for n in shape]
    cells = []
    if K == 1:
        for i in range(shape[0]):
            cells.append(((V[0][i],), (V[0][i + 1],)))
    elif K == 2:
        nx, ny = shape
        for i in range(ny):
            for j in range(nx):
                ul, ur = (V[0][j], V[1][i]), (V[0][j + 1], V[1][i])
                ll, lr = (V[0][j], V[1][i + 1]), (V[0][j + 1], V[1][i + 1])
                centre = ((V[0][j] + V[0][j + 1]) / 2, (V[1][i] + V[1][i + 1]) / 2)
                cells += [(centre, ul, ur), (centre, ur, lr), (centre, lr, ll), (centre, ll, ul)]
    else:
        nx, ny, nz = shape
        for i in range(nz):
            for j in range(ny):
                for k in range(nx):
                    x0, x1, y0, y1 = V[0][k], V[0][k + 1], V[1][j], V[1][j + 1]
                    z0, z1 = V[2][i], V[2][i + 1]
                    ul0, ur0, ll0, lr0 = (x0, y0, z0), (x1, y0, z0), (x0, y1, z0), (x1, y1, z0)
                    ul1, ur1, ll1, lr1 = (x0, y0, z1), (x1, y0, z1), (x0, y1, z1), (x1, y1, z1)
                    if (i + j + k) % 2 == 1:
                        ul0, ur0, lr0, ll0 = ur0, lr0, ll0, ul0
                        ul1, ur1, lr1, ll1 = ur1, lr1, ll1, ul1
                    cells += [(ll1, ur1, ul0, lr0), (ul1, ur1, ll1, ul0), (lr1, ur1, ll1, lr0),
                              (ll0, ul0, lr0, ll1), (ur0, ul0, lr0, ur1)]
    return cells


def oracle_dofs(shape, zero_boundary):
    """[(vertex coordinates, axis)] in theta order: vertices first seen over the cells."""
    seen = []
    for cell in oracle_cells(shape):
        for v in cell:
            if v not in seen:
                seen.append(v)
    dofs = []
    for v in seen:
        on_face = [x in (0, 1) for x in v]
        for k in range(len(shape)):
            if zero_boundary == "noslip" and any(on_face):
                continue
            if zero_boundary == "slip" and on_face[k]:
                continue
            dofs.append((v, k))
    return dofs


def oracle_basis(shape, zero_boundary):
    """Dense N: row (c, k, q), column of (vertex, k) holds inv(V_c^T)[l, q] (FG-CPAB's prolongation)."""
    K = len(shape)
    dofs = oracle_dofs(shape, zero_boundary)
    column = {dof: j for j, dof in enumerate(dofs)}
    cells = oracle_cells(shape)
    N = np.zeros((len(cells) * K * (K + 1), len(dofs)))
    for c, cell in enumerate(cells):
        verts = np.array([[float(x) for x in v] + [1.0] for v in cell])   # rows: homogeneous vertices
        inv = np.linalg.inv(verts.T)
        for l, v in enumerate(cell):
            for k in range(K):
                j = column.get((v, k))
                if j is not None:
                    N[c * K * (K + 1) + k * (K + 1): c * K * (K + 1) + (k + 1) * (K + 1), j] = inv[l]
    return N


def n_params_closed_form(shape, zero_boundary):
    K = len(shape)
    m = [n - 1 for n in shape]                       # interior grid lines per axis
    if K == 1:
        return {"noslip": m[0], "slip": m[0], None: shape[0] + 1}[zero_boundary]
    if K == 2:
        nx, ny = shape
        noslip = 2 * (m[0] * m[1] + nx * ny)
        return {"noslip": noslip, "slip": noslip + 2 * m[0] + 2 * m[1],
                None: 2 * ((nx + 1) * (ny + 1) + nx * ny)}[zero_boundary]
    noslip = 3 * m[0] * m[1] * m[2]
    faces = 2 * (m[0] * m[1] + m[0] * m[2] + m[1] * m[2])             # face-interior vertices
    edges = 4 * (m[0] + m[1] + m[2])                                  # edge-interior vertices
    return {"noslip": noslip, "slip": noslip + 2 * faces + edges,
            None: 3 * (shape[0] + 1) * (shape[1] + 1) * (shape[2] + 1)}[zero_boundary]


def barycentric(tess, cells, x):
    """Barycentric coordinates of points x (N, K) in the given cells (N,)."""
    X = tess.vertices[tess.cells[cells]]                               # (N, K+1, K)
    M = np.concatenate([np.swapaxes(X, 1, 2), np.ones((len(x), 1, tess.ndim + 1))], axis=1)
    rhs = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    return np.linalg.solve(M, rhs[..., None])[..., 0]


def shared_facets(tess):
    """(cell_a, cell_b, facet vertex ids) for every facet shared by two cells."""
    K = tess.ndim
    facets = {}
    for c, cell in enumerate(tess.cells):
        for drop in range(K + 1):
            key = tuple(sorted(np.delete(cell, drop)))
            facets.setdefault(key, []).append(c)
    assert all(len(cells) <= 2 for cells in facets.values())        # conforming mesh
    return [(cells[0], cells[1], np.array(key)) for key, cells in facets.items() if len(cells) == 2]


def random_points(rng, n, K, dtype=np.float64):
    return rng.random((n, K)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Layout, parameter count, basis


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", SMALL_SHAPES + [(7,), (5, 2), (2, 6), (4, 4, 4), (1, 3, 2)])
def test_counts(shape, zero_boundary):
    tess = Tessellation(shape, zero_boundary)
    K = len(shape)
    assert tess.ndim == K and tess.shape == shape and tess.zero_boundary == zero_boundary
    assert tess.n_cells == {1: 1, 2: 4, 3: 5}[K] * int(np.prod(shape))
    corners = int(np.prod([n + 1 for n in shape]))
    assert tess.n_vertices == corners + (int(np.prod(shape)) if K == 2 else 0)
    assert tess.n_params == n_params_closed_form(shape, zero_boundary)
    assert tess.basis.shape == (tess.n_cells * K * (K + 1), tess.n_params)
    assert tess.vertices.shape == (tess.n_vertices, K)
    assert tess.cells.shape == (tess.n_cells, K + 1)


@pytest.mark.parametrize("dim, sizes, expected", [
    (1, [2, 3, 4, 5], [1, 2, 3, 4]),
    (2, [1, 2, 3, 4, 5, 6, 8], [2, 14, 34, 62, 98, 142, 254]),
    (3, [1, 2, 3], [0, 27, 96]),
])
def test_slip_matches_libcpab_dimension(dim, sizes, expected):
    """libcpab's zero_boundary=True (measured in cpab.md 4.2) is our "slip"."""
    assert [Tessellation((n,) * dim, "slip").n_params for n in sizes] == expected


def test_fgcpab_quoted_dimensions():
    assert Tessellation((24, 24)).n_params == 2210                  # FG-CPAB project page
    assert Tessellation((20, 20, 20)).n_params == 20577


@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_layout_matches_libcpab_loops(shape):
    tess = Tessellation(shape)
    expected = np.array([[[float(x) for x in v] for v in cell] for cell in oracle_cells(shape)])
    np.testing.assert_array_equal(tess.vertices[tess.cells], expected)


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_theta_order_is_first_seen_vertex_major(shape, zero_boundary):
    tess = Tessellation(shape, zero_boundary)
    dofs = oracle_dofs(shape, zero_boundary)
    expected_xyz = np.array([[float(x) for x in v] for v, _ in dofs]).reshape(-1, len(shape))
    np.testing.assert_array_equal(tess.vertices[tess.dof_vertex], expected_xyz)
    np.testing.assert_array_equal(tess.dof_axis, [k for _, k in dofs])


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_basis_matches_dense_prolongation(shape, zero_boundary):
    tess = Tessellation(shape, zero_boundary)
    assert tess.basis.format == "csr" and tess.basis.dtype == np.float64
    np.testing.assert_allclose(tess.basis.toarray(), oracle_basis(shape, zero_boundary),
                               rtol=0, atol=1e-12 * max(shape))


@pytest.mark.parametrize("shape", [(3,), (3, 2), (2, 3, 2)])
def test_mesh_is_conforming_and_fills_the_box(shape):
    tess = Tessellation(shape, None)
    K = tess.ndim
    X = tess.vertices[tess.cells]
    edges = X[:, 1:] - X[:, :1]
    volumes = np.linalg.det(edges) / {1: 1, 2: 2, 3: 6}[K]
    assert (np.abs(volumes) > 0).all()
    np.testing.assert_allclose(np.abs(volumes).sum(), 1.0, rtol=1e-12)
    box = 1 / np.prod(shape)
    if K == 3:
        np.testing.assert_allclose(np.sort(np.abs(volumes).reshape(-1, 5), axis=1),
                                   np.tile([box / 6] * 4 + [box / 3], (tess.n_cells // 5, 1)))
    # every facet is shared by at most two cells, and interior facets by exactly two
    pairs = shared_facets(tess)
    n_facets = tess.n_cells * (K + 1)
    boundary = n_facets - 2 * len(pairs)
    if K == 1:
        expected_boundary = 2                                          # the two end points
    elif K == 2:
        expected_boundary = 2 * (shape[0] + shape[1])                  # box edges
    else:                                                              # 2 triangles per box face
        expected_boundary = 4 * (shape[0] * shape[1] + shape[0] * shape[2] + shape[1] * shape[2])
    assert boundary == expected_boundary


def test_nnz_per_column_matches_incidence():
    """Each free (vertex, k) column has (K+1) entries per incident cell, less exact zeros."""
    tess = Tessellation((3, 3, 3))
    counts = np.diff(tess.basis.tocsc().indptr)
    assert counts.max() <= 32 * 4 and counts.min() >= 8 * 3
    tess2 = Tessellation((3, 3))
    counts2 = np.diff(tess2.basis.tocsc().indptr)
    assert counts2.max() <= 8 * 3


def test_large_3d_builds_in_seconds():
    start = time.perf_counter()
    tess = Tessellation((30, 30, 30))
    elapsed = time.perf_counter() - start
    assert tess.n_params == 3 * 29 ** 3
    assert tess.basis.nnz < 32 * 4 * tess.n_params
    assert elapsed < 5.0, f"30^3 tessellation took {elapsed:.2f} s"


def test_anisotropic_3d_basis_is_exact():
    """Integer box offsets and half-integer reference inverses: A_c reproduces vertex values
    to the last bit for a non-cubic grid too."""
    tess = Tessellation((5, 3, 7), None)
    theta = np.ones(tess.n_params)
    A = tess.affine_maps(theta)
    # a constant field: linear part 0, offset 1, exactly
    np.testing.assert_array_equal(A[..., :-1], 0)
    np.testing.assert_array_equal(A[..., -1], 1)


# ---------------------------------------------------------------------------------------------
# The velocity field


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", [(4,), (3, 2), (2, 2, 3)])
def test_zero_theta_gives_zero_velocity(shape, zero_boundary, rng):
    tess = Tessellation(shape, zero_boundary)
    points = random_points(rng, 50, tess.ndim)
    v = velocity(points, np.zeros((3, tess.n_params)), tess)
    assert v.shape == (3, 50, tess.ndim)
    assert (v == 0).all()


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (4, 4), (2, 3, 3), (3, 3, 3)])
def test_velocity_continuous_across_every_shared_face(shape, zero_boundary, rng):
    tess = Tessellation(shape, zero_boundary)
    K = tess.ndim
    theta = rng.standard_normal(tess.n_params)
    A = tess.affine_maps(theta)
    pairs = shared_facets(tess)
    assert len(pairs) > 0
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    facet = np.stack([p[2] for p in pairs])                           # (P, K)
    w = 0.5 * rng.dirichlet(np.ones(K), size=len(pairs)) + 0.5 / K    # away from the facet's rim
    x = np.einsum("pl,plk->pk", w, tess.vertices[facet])
    xt = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    va = np.einsum("pkq,pq->pk", A[a], xt)
    vb = np.einsum("pkq,pq->pk", A[b], xt)
    scale = np.abs(A).max() + 1
    np.testing.assert_allclose(va, vb, rtol=0, atol=1e-12 * scale)

    # step into each cell towards its opposite vertex: located there, and v is the same up to O(eps)
    eps = 1e-6
    def opposite(cells):
        verts = tess.cells[cells]
        not_on_facet = (verts[:, :, None] != facet[:, None, :]).all(-1)   # one True per row
        return tess.vertices[verts[not_on_facet]]
    xa = x + eps * (opposite(a) - x)
    xb = x + eps * (opposite(b) - x)
    np.testing.assert_array_equal(tess.cell_index(xa), a)
    np.testing.assert_array_equal(tess.cell_index(xb), b)
    v_a, v_b = velocity(xa, theta, tess), velocity(xb, theta, tess)
    assert np.abs(v_a - v_b).max() <= 4 * eps * scale


@pytest.mark.parametrize("shape", [(6,), (3, 4), (3, 2, 3)])
def test_noslip_zero_on_boundary(shape, rng):
    tess = Tessellation(shape, "noslip")
    K = tess.ndim
    theta = rng.standard_normal((2, tess.n_params))
    x = random_points(rng, 400, K)
    axis = rng.integers(0, K, size=len(x))
    x[np.arange(len(x)), axis] = rng.integers(0, 2, size=len(x))      # onto a boundary face
    x[:2**K] = list(itertools.product([0.0, 1.0], repeat=K))          # and the box corners
    v = velocity(x, theta, tess)
    np.testing.assert_allclose(v, 0, atol=1e-12 * max(shape) * np.abs(theta).max())
    # and the interior is not zero
    assert np.abs(velocity(random_points(rng, 50, K) * 0.5 + 0.25, theta, tess)).max() > 1e-3


@pytest.mark.parametrize("shape", [(3, 4), (4, 4), (3, 2, 3), (3, 3, 3)])
def test_slip_normal_component_zero_on_boundary(shape, rng):
    tess = Tessellation(shape, "slip")
    K = tess.ndim
    theta = rng.standard_normal(tess.n_params)
    x = random_points(rng, 600, K)
    axis = rng.integers(0, K, size=len(x))
    x[np.arange(len(x)), axis] = rng.integers(0, 2, size=len(x))
    # edges and corners: more than one coordinate on the boundary
    x[:100, (axis[:100] + 1) % K] = rng.integers(0, 2, size=100)
    v = velocity(x, theta, tess)
    on_face = (x == 0) | (x == 1)
    tol = 1e-12 * max(shape) * np.abs(theta).max()
    np.testing.assert_allclose(v[on_face], 0, atol=tol)
    # the tangential components are free (not no-slip in disguise)
    tangential = ~on_face[100:]
    assert np.abs(v[100:][tangential]).max() > 1e-3


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", [(5,), (3, 2), (2, 3, 2), (3, 3, 3)])
def test_affine_maps_reproduce_vertex_velocities(shape, zero_boundary, rng):
    tess = Tessellation(shape, zero_boundary)
    theta = rng.standard_normal((3, tess.n_params))
    u = tess.vertex_velocities(theta)                                 # (3, V, K)
    # theta's own entries are the velocities at their vertices
    np.testing.assert_array_equal(u[:, tess.dof_vertex, tess.dof_axis], theta)
    A = tess.affine_maps(theta)                                       # (3, C, K, K+1)
    X = tess.vertices[tess.cells]                                     # (C, K+1, K)
    Xt = np.concatenate([X, np.ones(X.shape[:2] + (1,))], axis=-1)
    at_vertices = np.einsum("bckq,clq->bclk", A, Xt)
    np.testing.assert_allclose(at_vertices, u[:, tess.cells], rtol=0, atol=1e-12 * max(shape))
    # and velocity() at the vertices themselves
    np.testing.assert_allclose(velocity(tess.vertices, theta, tess), u, rtol=0,
                               atol=1e-12 * max(shape))


@pytest.mark.parametrize("zero_boundary", ZERO_BOUNDARIES)
@pytest.mark.parametrize("shape", [(7,), (4, 3), (3, 2, 4)])
def test_velocity_is_barycentric_interpolation(shape, zero_boundary, rng):
    tess = Tessellation(shape, zero_boundary)
    theta = rng.standard_normal((2, tess.n_params))
    x = random_points(rng, 300, tess.ndim)
    cells = cell_index(x, shape)
    lam = barycentric(tess, cells, x)
    u = tess.vertex_velocities(theta)[:, tess.cells[cells]]           # (2, N, K+1, K)
    expected = np.einsum("nl,bnlk->bnk", lam, u)
    np.testing.assert_allclose(velocity(x, theta, tess), expected, rtol=0, atol=1e-12 * max(shape))


def test_velocity_batch_shapes_and_dtypes(rng):
    tess = Tessellation((3, 2))
    d, K = tess.n_params, 2
    theta = rng.standard_normal((4, d))
    x = random_points(rng, 10, K)
    full = velocity(x, theta, tess)
    assert full.shape == (4, 10, K) and full.dtype == np.float64
    assert velocity(x, theta[1], tess).shape == (10, K)
    np.testing.assert_array_equal(velocity(x, theta[1], tess), full[1])
    per_item = velocity(np.broadcast_to(x, (4, 10, K)), theta, tess)
    np.testing.assert_array_equal(per_item, full)
    np.testing.assert_array_equal(velocity(x[None], theta, tess), full)          # points batch 1
    np.testing.assert_array_equal(velocity(np.stack([x, x]), theta[1], tess),
                                  np.stack([full[1], full[1]]))
    v32 = velocity(x.astype(np.float32), theta.astype(np.float32), tess)
    assert v32.dtype == np.float32
    np.testing.assert_allclose(v32, full, rtol=0, atol=1e-5 * np.abs(full).max())
    assert velocity(x.astype(np.float32), theta, tess).dtype == np.float64
    assert velocity(np.zeros((0, K)), theta, tess).shape == (4, 0, K)
    assert velocity(x.tolist(), theta.tolist(), tess).shape == (4, 10, K)


def test_points_outside_take_the_nearest_domain_point(rng):
    tess = Tessellation((3, 3), "slip")
    theta = rng.standard_normal(tess.n_params)
    x = rng.uniform(-1, 2, size=(200, 2))
    np.testing.assert_array_equal(velocity(x, theta, tess), velocity(np.clip(x, 0, 1), theta, tess))
    assert (velocity(x, rng.standard_normal(Tessellation((3, 3)).n_params), Tessellation((3, 3)))
            [(x < 0).any(axis=1) | (x > 1).any(axis=1)] == 0).all()


# ---------------------------------------------------------------------------------------------
# Point location


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (5,), (1, 1), (3, 5), (1, 1, 1), (2, 2, 2), (3, 4, 5)])
def test_cell_index_finds_a_holding_cell(shape, dtype, rng):
    tess = Tessellation(shape, None)
    K = len(shape)
    x = random_points(rng, 2000, K, dtype)
    # and points on faces: on box faces, diagonals, the 3D tetrahedron faces and vertices
    grid = np.array(shape) * 4
    x[:500] = (rng.integers(0, grid + 1, size=(500, K)) / grid).astype(dtype)
    x[500:600] = tess.vertices[rng.integers(0, tess.n_vertices, size=100)].astype(dtype)
    cells = tess.cell_index(x)
    assert cells.dtype == np.int64 and cells.shape == (len(x),)
    assert ((cells >= 0) & (cells < tess.n_cells)).all()
    lam = barycentric(tess, cells, x.astype(np.float64))
    assert lam.min() >= -1e-5 if dtype == np.float32 else lam.min() >= -1e-12


def test_cell_index_tie_rules():
    # 1D: a vertex goes to the cell on its right; 1 to the last cell
    np.testing.assert_array_equal(cell_index([[0.0], [0.25], [0.5], [1.0]], (4,)), [0, 1, 2, 3])
    # 2D, one box: centre and diagonal -> 0; anti-diagonal -> 0 / 3; the "x >= y" diagonal half -> 1
    pts = [[0.5, 0.5], [0.25, 0.25], [0.75, 0.75], [0.25, 0.75], [0.75, 0.25], [0.0, 0.0],
           [1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.5, 0.0], [1.0, 0.5], [0.5, 1.0], [0.0, 0.5]]
    np.testing.assert_array_equal(cell_index(pts, (1, 1)), [0, 0, 1, 3, 0, 0, 0, 1, 3, 0, 1, 2, 3])
    # 2D: a point on a box face goes to the box with the larger index
    np.testing.assert_array_equal(cell_index([[0.5, 0.25], [0.25, 0.5]], (2, 2)), [4 * 1 + 3, 4 * 2])
    # 3D even box: corner tetrahedra win their faces with the central one, in the order 1, 2, 3, 4
    pts3 = [[0.25, 0.25, 0.5],    # z = x + y: face of tetrahedron 1 -> 1
            [0.75, 0.75, 0.5],    # x + y + z = 2 -> 2
            [0.25, 0.5, 0.25],    # y = x + z -> 3
            [0.5, 0.25, 0.25],    # x = y + z -> 4
            [0.5, 0.5, 0.5],      # centre of the box: central
            [0.5, 0.5, 1.0]]      # z = x + y and x + y + z = 2 (their shared edge) -> 1
    np.testing.assert_array_equal(cell_index(pts3, (1, 1, 1)), [1, 2, 3, 4, 0, 1])
    # 3D odd box (box (1, 0, 0) of a 2x1x1 grid): the same points shifted, after (x, y) <- (y, 1-x)
    shifted = np.array(pts3) * [0.5, 1, 1] + [0.5, 0, 0]
    cells = cell_index(shifted, (2, 1, 1))
    tess = Tessellation((2, 1, 1), None)
    lam = barycentric(tess, cells, shifted)
    assert (cells // 5 == 1).all() and lam.min() >= -1e-15


def oracle_cell_index(point, shape, dtype):
    """The documented rule in exact rational arithmetic, FG-CPAB's tests transcribed from cpab.md 3."""
    K = len(shape)
    u = [min(max(Fraction(float(dtype(x) * dtype(n))), Fraction(0)), Fraction(n))
         for x, n in zip(point, shape)]
    box = [min(int(math.floor(uk)), n - 1) for uk, n in zip(u, shape)]
    local = [uk - i for uk, i in zip(u, box)]
    number = 0
    for k in reversed(range(K)):
        number = number * shape[k] + box[k]
    if K == 1:
        return number
    if K == 2:
        x, y = local
        tri = (int(x < y) << 1) | int((1 - x) < y)
        tri ^= (tri >> 1) & 1
        return 4 * number + tri
    x, y, z = local
    if (box[0] ^ box[1] ^ box[2]) & 1:
        x, y = y, 1 - x
    for tet, test in enumerate([-x - y + z, x + y + z - 2, -x + y - z, x - y - z], start=1):
        if test >= 0:
            return 5 * number + tet
    return 5 * number


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3,), (3, 2), (1, 1), (2, 3, 2), (1, 1, 1)])
def test_cell_index_is_exact_on_and_near_faces(shape, dtype, rng):
    """Points on a fine rational lattice (many exactly on faces, edges and vertices) and the
    same points moved by a few ulps: the located cell equals the rule evaluated exactly."""
    K = len(shape)
    denominators = 8 * np.array(shape)
    lattice = rng.integers(-1, denominators + 2, size=(600, K)) / denominators
    x = lattice.astype(dtype)
    steps = rng.integers(-3, 4, size=x.shape)
    nudged = x.copy()
    for _ in range(3):
        move = steps != 0
        nudged[move] = np.nextafter(nudged[move], np.where(steps[move] > 0, 2, -2).astype(dtype))
        steps = steps - np.sign(steps)
    points = np.concatenate([x, nudged])
    got = cell_index(points, shape)
    expected = [oracle_cell_index(p, shape, dtype) for p in points]
    np.testing.assert_array_equal(got, expected)


def test_exact_predicate_differs_from_naive_rounding():
    """x + y = 1 + 2^-54 > 1: the exact rule sends the point across the anti-diagonal, a
    rounded fl(x + y) == 1 would not."""
    y = 0.75
    x = np.nextafter(1 - y, 1.0)
    assert x + y == 1.0
    assert cell_index([[x, y]], (1, 1))[0] == 2      # x < y and x + y > 1
    assert cell_index([[1 - y, y]], (1, 1))[0] == 3  # on the anti-diagonal


def test_cell_index_clamps_outside():
    np.testing.assert_array_equal(cell_index([[-5.0, 0.5], [2.0, 0.5], [0.5, -1e-300]], (2, 2)),
                                  cell_index([[0.0, 0.5], [1.0, 0.5], [0.5, 0.0]], (2, 2)))


# ---------------------------------------------------------------------------------------------
# Prior


def test_sample_shape_determinism(rng):
    tess = Tessellation((4, 4, 4))
    seed = int(rng.integers(2**32))
    a = tess.sample(3, rng=seed)
    assert a.shape == (3, tess.n_params) and a.dtype == np.float64
    for draws in (a, Tessellation((16, 16)).sample(32, rng=seed)):        # no copy in the ops
        assert draws.flags.c_contiguous
    np.testing.assert_array_equal(a, tess.sample(3, rng=np.random.default_rng(seed)))
    assert not np.array_equal(a, tess.sample(3, rng=seed + 1))
    assert tess.sample(0, rng=seed).shape == (0, tess.n_params)
    np.testing.assert_array_equal(tess.sample(2, scale=0, rng=seed), 0)
    assert np.isfinite(Tessellation((3,), None).sample(2, length_scale=100.0, rng=seed)).all()


@pytest.mark.parametrize("shape, zero_boundary", [((3, 3), None), ((3, 2), "slip"), ((12,), None)])
def test_sample_covariance_is_the_squared_exponential(shape, zero_boundary, rng):
    tess = Tessellation(shape, zero_boundary)
    ell, scale, n = 0.3, 0.5, 8000
    theta = tess.sample(n, length_scale=ell, scale=scale, rng=rng)
    empirical = theta.T @ theta / n
    x = tess.vertices[tess.dof_vertex]
    same_axis = tess.dof_axis[:, None] == tess.dof_axis[None, :]
    dist2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    expected = scale**2 * np.exp(-dist2 / (2 * ell**2)) * same_axis
    np.testing.assert_allclose(empirical, expected, rtol=0, atol=0.1 * scale**2)


def test_sample_is_smooth(rng):
    """Neighbouring vertex velocities are strongly correlated, distant ones hardly."""
    tess = Tessellation((20,), None)
    ell = 0.1
    theta = tess.sample(3000, length_scale=ell, rng=rng)
    order = np.argsort(tess.vertices[:, 0])
    t = theta[:, order]
    corr = np.corrcoef(t.T)
    near = np.mean([corr[i, i + 1] for i in range(20)])
    far = np.mean([abs(corr[i, i + 8]) for i in range(13)])
    assert abs(near - np.exp(-(1 / 20) ** 2 / (2 * ell**2))) < 0.03
    assert near > 0.85 and far < 0.1


def test_sample_bad_input():
    tess = Tessellation((3, 3))
    with pytest.raises(ValueError, match="length_scale"):
        tess.sample(1, length_scale=0)
    with pytest.raises(ValueError, match="scale"):
        tess.sample(1, scale=-1)
    with pytest.raises(ValueError, match="n must"):
        tess.sample(-1)
    with pytest.raises(TypeError, match="n must"):
        tess.sample(1.5)
    with pytest.raises(ValueError, match="xp"):
        tess.sample(1, xp=object())
    with pytest.raises(ValueError, match="sample"):
        Tessellation((5000,)).sample(1)
    with pytest.raises(ValueError, match="n=1000000000000 draws need .* smaller batches"):
        tess.sample(10 ** 12)                                       # not a MemoryError
    with pytest.raises(TypeError, match="rng must be"):  # NumPy's own message named no argument
        tess.sample(1, rng="x")
    with pytest.raises(ValueError, match="rng must be"):
        tess.sample(1, rng=-1)


# ---------------------------------------------------------------------------------------------
# Bad input and the GPU stubs


def test_bad_tessellations():
    for shape in [(0,), (3, -1), (2, 0, 2)]:
        with pytest.raises(ValueError, match="shape"):
            Tessellation(shape)
    with pytest.raises(ValueError, match="shape"):
        Tessellation((1, 2, 3, 4))
    with pytest.raises(ValueError, match="shape"):
        Tessellation(())
    with pytest.raises(TypeError, match="shape"):
        Tessellation((2.5, 2))
    with pytest.raises(TypeError, match="shape"):
        Tessellation((True, 2))
    with pytest.raises(ValueError, match="shape"):          # the basis would not fit in memory
        Tessellation((4000, 4000, 4000))
    with pytest.raises(ValueError, match="shape"):
        Tessellation((10**12,))
    with pytest.raises(ValueError, match="2\\^31"):       # before any memory estimate
        Tessellation((2**31,))
    # fewer than 2^31 cells, but their affine table (12 entries per 3-D cell, 2 per 1-D cell)
    # would pass the kernels' 32-bit offsets
    with pytest.raises(ValueError, match="2\\^31"):
        Tessellation((330, 330, 330))
    with pytest.raises(ValueError, match="2\\^31"):
        Tessellation((2**30,))
    for zb in [True, False, "zero", 0]:
        with pytest.raises(ValueError, match="zero_boundary"):
            Tessellation((2, 2), zb)
    assert Tessellation(3).shape == (3,)


def test_bad_velocity_input(rng):
    tess = Tessellation((3, 3))
    d = tess.n_params
    x = random_points(rng, 5, 2)
    with pytest.raises(ValueError, match="theta"):
        velocity(x, np.zeros(d + 1), tess)
    with pytest.raises(ValueError, match="theta"):
        velocity(x, np.zeros((2, 2, d)), tess)
    with pytest.raises(ValueError, match="points"):
        velocity(random_points(rng, 5, 3), np.zeros(d), tess)
    with pytest.raises(ValueError, match="points"):
        velocity(np.zeros(2), np.zeros(d), tess)
    with pytest.raises(ValueError, match="points"):
        velocity(np.array([[np.nan, 0.5]]), np.zeros(d), tess)
    with pytest.raises(ValueError, match="batch"):
        velocity(np.zeros((3, 5, 2)), np.zeros((2, d)), tess)
    with pytest.raises(TypeError, match="tess"):
        velocity(x, np.zeros(d), (3, 3))
    with pytest.raises(TypeError, match="points"):
        velocity(x.astype(complex), np.zeros(d), tess)
    with pytest.raises(ValueError, match="theta"):
        tess.affine_maps(np.zeros(d - 1))
    with pytest.raises(ValueError, match="points"):
        tess.cell_index(np.zeros((4, 3)))


def test_basis_for():
    tess = Tessellation((2, 2))
    assert tess.basis_for(np) is tess.basis
    with pytest.raises(ValueError, match="xp"):
        tess.basis_for(object())


@pytest.mark.gpu
def test_device_basis_and_prior():
    import cupy as cp

    tess = Tessellation((2, 2))
    B = tess.basis_for(cp)
    np.testing.assert_array_equal(B.toarray().get(), tess.basis.toarray())
    assert isinstance(tess.sample(2, rng=0, xp=cp), cp.ndarray)


def test_exports():
    import cutopo.cpab as cpab

    assert set(cpab.__all__) == {"Tessellation", "velocity", "integrate", "log_jacobian",
                                 "transform_grid", "transform_image", "compose", "compose_grid",
                                 "compose_image", "prolong", "register", "RegistrationResult"}


@pytest.mark.parametrize("module", ["cutopo.cpab.tessellation", "cutopo.cpab.velocity"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), verbose=False, report=True)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1)])
def test_tessellations_without_parameters(shape, rng):
    """No-slip on a single interval or cube leaves nothing free: d = 0, v = 0."""
    tess = Tessellation(shape)
    assert tess.n_params == 0 and tess.basis.shape == (tess.n_cells * tess.ndim * (tess.ndim + 1), 0)
    theta = tess.sample(2, rng=rng)
    assert theta.shape == (2, 0)
    v = velocity(random_points(rng, 4, len(shape)), theta, tess)
    assert v.shape == (2, 4, len(shape)) and (v == 0).all()
    assert velocity(random_points(rng, 4, len(shape)), np.zeros((0, 0)), tess).shape == (0, 4, len(shape))
