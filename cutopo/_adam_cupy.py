"""CuPy path of :class:`cutopo._adam.Adam`: the whole update in one launch of
``cuda_src/optim.cu``'s ``adam_step`` (the array expression costs a dozen launches, which
dominate a registration step's host time at small parameter counts)."""
from __future__ import annotations

import functools

from ._cuda.compile import register_instances
from ._cuda.launch import PreparedLaunch, Signature

FAMILY = "optim"
THREADS = 256  # optim::THREADS
_CTYPE = {"float32": "float", "float64": "double"}


def _sig(t):
    return Signature(FAMILY, f"cutopo::optim::adam_step<{_CTYPE[t]}>",
                     (f"ptr:{t}",) * 4 + ("int64",) + (t,) * 7)


register_instances(FAMILY, lambda: (_sig(t).name for t in _CTYPE))


@functools.lru_cache(maxsize=64)
def _plan(device_id, t, n):
    return PreparedLaunch(_sig(t), -(-n // THREADS), THREADS, (None,) * 4 + (n,) + (None,) * 7)


def fits(params, m, v, grad):
    """True when the fused kernel computes what the array expression computes: one float32 or
    float64 dtype for all four arrays (mixed dtypes promote differently), C-contiguous."""
    t = params.dtype
    return (t.name in _CTYPE and grad.dtype == t and grad.shape == params.shape
            and all(a.flags.c_contiguous for a in (params, m, v, grad)))


def adam_step(params, m, v, grad, b1, b2, step, inv, eps):
    """params, m, v updated in place (see optim.cu); the scalars are Python floats, rounded to
    the arrays' dtype as NumPy rounds them."""
    plan = _plan(params.device.id, params.dtype.name, params.size)
    plan(params, m, v, grad, b1, 1 - b1, b2, 1 - b2, step, inv, eps)
