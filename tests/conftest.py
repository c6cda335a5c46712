"""Shared test configuration: device/compiler markers, a freshly seeded ``rng`` and Hypothesis profiles.

* ``gpu``   tests run only when ``cutopo.gpu_available()``; otherwise they are skipped.
* ``nvrtc`` tests need CuPy's NVRTC binding and the NVRTC library (no GPU). They are skipped
  without them, unless ``CUTOPO_REQUIRE_NVRTC=1`` (CI), where a missing NVRTC is an error.
* ``rng``   is ``numpy.random.default_rng(seed)`` with a fresh 64-bit seed per test. The seed is
  shown in the report of a failing test; ``CUTOPO_TEST_SEED=<seed>`` replays it.
"""
from __future__ import annotations

import functools
import os
import secrets

import numpy as np
import pytest

# JAX must not take most of the GPU's memory: CuPy and PyTorch share the card in the adapter
# tests, and each pytest-xdist worker would otherwise preallocate 75 % of it (set before any
# test imports jax).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    from hypothesis import settings
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    settings = None
else:
    settings.register_profile("cutopo", deadline=None, max_examples=50)
    settings.register_profile("ci", deadline=None, max_examples=50, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cutopo"))


@functools.lru_cache(maxsize=None)
def _gpu_available() -> bool:
    import cutopo

    return cutopo.gpu_available()


@functools.lru_cache(maxsize=None)
def nvrtc_problem() -> str | None:
    """None when NVRTC works, else why not."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # ImportError, or a broken CuPy install
        return f"cannot import cupy_backends.cuda.libs.nvrtc: {exc!r}"
    try:
        version = nvrtc.getVersion()
    except Exception as exc:  # the binding is there but the library is not
        return f"nvrtc.getVersion() failed (is nvidia-cuda-nvrtc installed?): {exc!r}"
    if not version:
        return "nvrtc.getVersion() returned nothing"
    return None


def _require_nvrtc() -> bool:
    return os.environ.get("CUTOPO_REQUIRE_NVRTC") == "1"


def pytest_report_header(config):
    problem = nvrtc_problem()
    return [
        f"cutopo: gpu_available={_gpu_available()}, "
        f"nvrtc={'ok' if problem is None else 'missing'}, "
        f"CUTOPO_REQUIRE_NVRTC={os.environ.get('CUTOPO_REQUIRE_NVRTC', '')!r}"
    ]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None and not _gpu_available():
            item.add_marker(pytest.mark.skip(reason="gpu: CuPy sees no CUDA device"))


def pytest_runtest_setup(item):
    if item.get_closest_marker("nvrtc") is None:
        return
    problem = nvrtc_problem()
    if problem is None:
        return
    if _require_nvrtc():
        pytest.fail(f"CUTOPO_REQUIRE_NVRTC=1 but NVRTC is unusable: {problem}", pytrace=False)
    pytest.skip(f"nvrtc: {problem}")


SEED_ENV = "CUTOPO_TEST_SEED"


@pytest.fixture
def force_listed_forward(monkeypatch):
    """A function making every soft ECC 3D forward of this test the listed one (True: whatever
    its size and its kept slots) or the fused one (False); plans made before keep their own."""
    def force(listed):
        from cutopo import _soft_ecc_cupy

        monkeypatch.setattr(_soft_ecc_cupy, "LISTED_FORWARD_MIN_VOXELS", 0 if listed else None)
        monkeypatch.setattr(_soft_ecc_cupy, "LISTED_FORWARD_VOXELS_PER_SLOT", 1 << 62)

    return force


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded freshly for this test (reported on failure)."""
    env = os.environ.get(SEED_ENV)
    seed = int(env) if env else secrets.randbits(64)
    request.node.user_properties.append(("rng_seed", seed))
    request.node._cutopo_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_cutopo_seed", None)
    if seed is not None and report.failed:
        report.sections.append(
            ("rng seed", f"this test used rng seed {seed}; replay with {SEED_ENV}={seed}"))
