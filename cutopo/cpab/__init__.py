"""CPAB: diffeomorphisms from continuous piecewise-affine velocity fields on [0, 1]^K.

So far: the tessellations and their sparse nodal basis (:class:`Tessellation`) and the
velocity field (:func:`velocity`), NumPy only.
"""
from .tessellation import Tessellation
from .velocity import velocity

__all__ = ["Tessellation", "velocity"]
