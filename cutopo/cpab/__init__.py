"""CPAB: diffeomorphisms from continuous piecewise-affine velocity fields on [0, 1]^K.

So far: the tessellations and their sparse nodal basis (:class:`Tessellation`), the velocity
field (:func:`velocity`), and the transformation (:func:`integrate`, differentiable through
:func:`cutopo.vjp`) with its log-Jacobian (:func:`log_jacobian`), and its action on pixel grids
(:func:`transform_grid`) and images (:func:`transform_image`, a backward warp through
:func:`cutopo.grid_sample`); cascades of transformations (:func:`compose`, :func:`compose_grid`,
:func:`compose_image`), the exact coarse-to-fine prolongation of theta (:func:`prolong`), and
pairwise image registration (:func:`register`).
"""
from .compose import compose, compose_grid, compose_image
from .integrate import integrate, log_jacobian
from .prolong import prolong
from .register import RegistrationResult, register
from .tessellation import Tessellation
from .transform import transform_grid, transform_image
from .velocity import velocity

__all__ = ["Tessellation", "velocity", "integrate", "log_jacobian", "transform_grid",
           "transform_image", "compose", "compose_grid", "compose_image", "prolong", "register",
           "RegistrationResult"]
