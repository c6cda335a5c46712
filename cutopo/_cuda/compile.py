"""Compile kernel instances: at run time through CuPy (memoized), offline through NVRTC.

A kernel instance is a (family, C++ name expression) pair, e.g.
``("ecc", "cutopo::ecc::ecc_histogram<float, float, unsigned short, 2, false>")``.
Each instance is compiled once per (device, family, options, name expression); CuPy's own disk
cache then makes later processes cheap. Families register the instances the offline check
must compile with :func:`register_instances`.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

from .source import family_source

# Options shared by the runtime and the offline compile. CuPy adds -ftz=true itself (float32
# denormals flush to zero in every RawKernel) and the architecture of the current device.
OPTIONS: tuple[str, ...] = ("--std=c++17", "-lineinfo")

# What CuPy passes besides OPTIONS (cupy/_core/core.pyx), mirrored by the offline compile so that
# it compiles what the runtime compiles.
_CUPY_IMPLIED = ("-ftz=true", "--device-as-default-execution-space")

_INSTANCES: dict[str, list[Callable[[], Iterable[str]]]] = {}


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message holds the instance and the compiler log."""


def register_instances(family: str, instances: Callable[[], Iterable[str]]) -> None:
    """Declare name expressions of ``family`` that the offline compile check covers.

    A family may register several generators (one per Python module that launches its kernels);
    registering the same generator twice (a module reload) counts once.
    """
    generators = _INSTANCES.setdefault(family, [])
    if instances not in generators:
        generators.append(instances)


def registered_instances() -> dict[str, list[str]]:
    """{family: name expressions}, each expression once, in registration order."""
    return {family: list(dict.fromkeys(name for fn in fns for name in fn()))
            for family, fns in _INSTANCES.items()}


@functools.lru_cache(maxsize=None)
def _module(device_id: int, family: str, options: tuple[str, ...], name_expression: str):
    import cupy

    try:
        module = cupy.RawModule(code=family_source(family), options=options,
                                name_expressions=(name_expression,))
        module.compile()
    except cupy.cuda.compiler.CompileException as exc:
        raise KernelCompileError(f"compiling {name_expression} ({family}.cu) failed:\n{exc}") from exc
    return module


def get_function(family: str, name_expression: str, options: tuple[str, ...] = ()):
    """The compiled ``cupy.RawKernel`` of one instance on the current device (memoized)."""
    import cupy

    device_id = cupy.cuda.Device().id
    module = _module(device_id, family, OPTIONS + tuple(options), name_expression)
    return module.get_function(name_expression)


def compile_offline(family: str, name_expressions: Iterable[str], arch: str,
                    options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile instances to a cubin for ``sm_<arch>`` with NVRTC, without a GPU.

    Returns (cubin, log). Raises :class:`KernelCompileError` with the log on failure.
    Needs CuPy's NVRTC binding and the NVRTC library (``pip install cutopo[nvrtc]``).
    """
    from cupy_backends.cuda.libs import nvrtc

    names = list(name_expressions)
    src = family_source(family)
    prog = nvrtc.createProgram(src, f"{family}.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        opts = OPTIONS + tuple(options) + _CUPY_IMPLIED + (f"--gpu-architecture=sm_{arch}",)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise KernelCompileError(
                f"compiling {family}.cu for sm_{arch} ({shown}) failed: {exc}\n{log}") from exc
        for name in names:
            nvrtc.getLoweredName(prog, name)  # raises if an instance was not generated
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
