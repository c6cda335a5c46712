"""CPAB: diffeomorphisms from continuous piecewise-affine velocity fields on [0, 1]^K.

So far: the tessellations and their sparse nodal basis (:class:`Tessellation`), the velocity
field (:func:`velocity`), and the transformation (:func:`integrate`, differentiable through
:func:`cutopo.vjp`) with its log-Jacobian (:func:`log_jacobian`), and its action on pixel grids
(:func:`transform_grid`) and images (:func:`transform_image`, a backward warp through
:func:`cutopo.grid_sample`), NumPy only.
"""
from .integrate import integrate, log_jacobian
from .tessellation import Tessellation
from .transform import transform_grid, transform_image
from .velocity import velocity

__all__ = ["Tessellation", "velocity", "integrate", "log_jacobian", "transform_grid",
           "transform_image"]
