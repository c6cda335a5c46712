"""Locate ``cuda_src`` and build self-contained CUDA source strings.

CuPy's on-disk kernel cache hashes the source string it is given, not the files that
string ``#include``s, so project headers are inlined here: editing a header then changes
the hash, and the runtime compile and the offline (no-GPU) compile check see the same text.
This module is pure Python and never imports CuPy.
"""
from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def source_dir() -> Path:
    """Directory holding the ``.cu``/``.cuh`` files.

    Installed wheels carry it as ``cutopo/cuda_src``; a source checkout (including
    setuptools' lenient editable install) has it beside the package.
    """
    try:
        installed = Path(str(resources.files("cutopo") / "cuda_src"))
        if (installed / "ecc.cu").is_file():
            return installed
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - exotic loaders
        pass
    checkout = Path(__file__).resolve().parents[2] / "cuda_src"
    if (checkout / "ecc.cu").is_file():
        return checkout
    raise FileNotFoundError(
        "cutopo: cannot find the CUDA sources (cuda_src/*.cu) next to the package; "
        "reinstall cutopo")


def _inline(path: Path, seen: set[Path]) -> str:
    text = path.read_text()

    def replace(match: re.Match) -> str:
        target = (path.parent / match.group(1)).resolve()
        if target in seen:  # each header once, like #pragma once
            return f"// (already included: {match.group(1)})"
        seen.add(target)
        return f"// ---- begin {match.group(1)}\n{_inline(target, seen)}\n// ---- end {match.group(1)}"

    return _INCLUDE.sub(replace, text)


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> str:
    """The source of ``cuda_src/<family>.cu`` with every project header inlined."""
    path = source_dir() / f"{family}.cu"
    if not path.is_file():
        raise ValueError(f"unknown kernel family {family!r}: no {path.name} in {source_dir()}")
    return f"// cutopo family {family}\n" + _inline(path.resolve(), {path.resolve()})
