"""cutopo: fast, differentiable geometric and topological operators on GPU (CuPy) and CPU (NumPy).

Every op takes NumPy or CuPy arrays and returns the same array type: CuPy arrays run the CUDA
kernels of ``cuda_src/``, NumPy arrays run the vectorised NumPy path (the CPU fallback and the
test oracle).
"""
from ._array import gpu_available
from .deformable import deformable_aggregation
from .ecc import ecc, ect, euler_contributions, expected_euler, linear_thresholds, soft_ecc, soft_ect
from .sampling import grid_sample
from .vjp import vjp

__version__ = "0.1.0"

__all__ = ["ecc", "euler_contributions", "linear_thresholds", "soft_ecc", "expected_euler", "ect",
           "soft_ect", "deformable_aggregation", "grid_sample", "vjp", "gpu_available", "__version__"]


def __getattr__(name):
    # Families with heavier imports (scipy.sparse for CPAB) load on first use: cutopo.cpab.
    if name == "cpab":
        import importlib

        return importlib.import_module(".cpab", __name__)
    raise AttributeError(f"module 'cutopo' has no attribute {name!r}")
