"""Adam on one NumPy or CuPy array: the optimiser of :func:`cutopo.cpab.register` and of its
benchmarks."""
from __future__ import annotations

import math

from ._array import array_module, is_cupy_array

__all__ = ["Adam"]


class Adam:
    """Adam (Kingma and Ba) updating one parameter array in place.

    Parameters
    ----------
    params : ndarray
        NumPy or CuPy floating array, updated in place by :meth:`step`; its moment estimates
        have its shape, dtype and array type.
    lr : float
        Step size (alpha).
    betas : (float, float), optional
        Decay rates of the first and second moment estimates (default (0.9, 0.999)).
    eps : float, optional
        Added to the square root of the second moment (default 1e-8).

    Notes
    -----
    The update is PyTorch's ``torch.optim.Adam`` without weight decay::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        params -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

    All on the parameters' device, no host synchronisation: for CuPy arrays of one float dtype
    one fused kernel (``cuda_src/optim.cu``, the same roundings in the same order), else these
    array operations.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo._adam import Adam
    >>> x = np.array([1.0, -2.0])
    >>> opt = Adam(x, lr=0.1)
    >>> for _ in range(200):
    ...     _ = opt.step(2 * x)                # the gradient of |x|^2
    >>> bool(np.abs(x).max() < 0.05)
    True

    References
    ----------
    .. [1] D. P. Kingma, J. Ba, "Adam: a method for stochastic optimization", ICLR 2015.
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {lr!r}")
        b1, b2 = betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        xp = array_module(params)
        self.params = params
        self.lr, self.betas, self.eps = float(lr), (float(b1), float(b2)), float(eps)
        self.m = xp.zeros_like(params)
        self.v = xp.zeros_like(params)
        self.t = 0

    def scalars(self, t, lr=None):
        """(step, root) of update number ``t`` (1-based) with step size ``lr`` (default
        :attr:`lr`): ``lr / (1 - b1^t)`` and ``1 / sqrt(1 - b2^t)``, Python floats."""
        b1, b2 = self.betas
        return (self.lr if lr is None else lr) / (1 - b1 ** t), 1.0 / math.sqrt(1 - b2 ** t)

    def step(self, grad):
        """One update of :attr:`params` (in place) from the gradient ``grad`` (its shape)."""
        b1, b2 = self.betas
        self.t += 1
        step, root = self.scalars(self.t)
        if is_cupy_array(self.params):
            from . import _adam_cupy

            if _adam_cupy.fits(self.params, self.m, self.v, grad):
                _adam_cupy.adam_step(self.params, self.m, self.v, grad, b1, b2, step, root, self.eps)
                return self.params
        self.m *= b1
        self.m += (1 - b1) * grad
        self.v *= b2
        self.v += (1 - b2) * (grad * grad)
        self.params -= step * self.m / (array_module(self.params).sqrt(self.v) * root + self.eps)
        return self.params
