"""Static SASS of one kernel instance, by source line, without a GPU.

    python benchmarks/sass_lines.py ecc \
        "cutopo::ecc::band::soft_ecc_fused_forward<float, unsigned int, float, 3, false, false>"
    python benchmarks/sass_lines.py ecc "..." --arch 80 --top 60 --listing sass.txt
    python benchmarks/sass_lines.py ecc "..." -D CUTOPO_ECC_NO_CUBE_PAIRS     (a compile variant)

Compiles the instance with the offline compile (NVRTC, the runtime's options plus ptxas -v:
registers and spills), disassembles it with ``nvdisasm`` (not in CUDA's pip compilers: ``pip
install nvidia-cuda-nvdisasm``, then put its ``bin`` on PATH or name it in $NVDISASM), and
prints the instructions per innermost source line of the self-contained source (the line
numbers of ``cutopo._cuda.source.family_source``), the instructions between successive block
barriers (a sweep's plane step lies between two), and the local-memory (spill) accesses.
Counts are static: an unrolled or inlined line counts every copy, a loop's body once. What
runs how often is Nsight Compute's (``--section SourceCounters``, per SASS address).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cutopo._cuda.compile import compile_offline  # noqa: E402
from cutopo._cuda.source import family_source  # noqa: E402

_MARK = re.compile(r'\s*//## File "[^"]+", line (\d+)')
_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def elf_bytes(cubin: bytes) -> bytes:
    """The cubin padded to the end of its last part (the section and program header tables,
    every section's data): CuPy's getCUBIN drops the image's last byte (a zero), which
    nvdisasm rejects as an invalid ELF."""
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for k in range(shnum):
        at = shoff + k * shentsize
        if at + 0x28 > len(cubin):
            break
        kind, = struct.unpack_from("<I", cubin, at + 0x4)
        offset, size = struct.unpack_from("<QQ", cubin, at + 0x18)
        if kind != 8:  # SHT_NOBITS holds no bytes in the file
            end = max(end, offset + size)
    return cubin + b"\0" * max(0, end - len(cubin))


def disassemble(cubin: bytes) -> list[str]:
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if tool is None:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, and put its bin on PATH "
                 "or set NVDISASM")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(elf_bytes(cubin))
        f.flush()
        return subprocess.run([tool, "-gi", "-c", f.name], check=True, capture_output=True,
                              text=True).stdout.splitlines()


def instructions(listing: list[str], mangled: str) -> list[tuple[int, str, int]]:
    """(address, instruction, innermost source line) of the kernel's section."""
    rows, inside, line, fresh = [], False, 0, False
    for text in listing:
        if text.startswith("//-----") and ".text." in text:
            inside = text.split(".text.", 1)[1].split()[0] == mangled
            continue
        if not inside:
            continue
        m = _MARK.match(text)
        if m:  # the first mark after an instruction is the innermost (inlined-at ones follow)
            if not fresh:
                line, fresh = int(m.group(1)), True
            continue
        m = _INSTR.match(text)
        if m:
            rows.append((int(m.group(1), 16), m.group(2), line))
            fresh = False
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("name", help="the instance's name expression")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--top", type=int, default=40, help="source lines to print")
    ap.add_argument("--listing", help="also write the disassembly with line marks here")
    ap.add_argument("-D", dest="defines", action="append", default=[],
                    help="a macro for the compile (a variant's -D flag, e.g. -D CUTOPO_ECC_NO_CUBE_PAIRS)")
    args = ap.parse_args()

    options = ("--ptxas-options=-v",) + tuple(f"-D{d}" for d in args.defines)
    cubin, log = compile_offline(args.family, [args.name], args.arch, options)
    # the instance's entry: its template's name, mangled (the family's plain kernels compile too)
    base = args.name.split("<", 1)[0].rsplit("::", 1)[-1]
    entries = [e for e in _ENTRY.findall(log) if f"{len(base)}{base}I" in e]
    if len(entries) != 1:
        sys.exit(f"expected one entry function of {base} in the ptxas log, found {entries}")
    props = log.split(f"Function properties for {entries[0]}", 1)[1].splitlines()[1:3]
    print("\n".join(text.strip() for text in props))
    listing = disassemble(cubin)
    if args.listing:
        Path(args.listing).write_text("\n".join(listing) + "\n")
    rows = instructions(listing, entries[0])
    source = family_source(args.family).splitlines()
    op = lambda ins: ins.split()[1] if ins.startswith("@") else ins.split()[0]  # noqa: E731
    local = sum(op(ins).startswith(("LDL", "STL")) for _, ins, _ in rows)
    print(f"{len(rows)} instructions, {local} local-memory accesses (spills)")

    bars = [a for a, ins, _ in rows if op(ins).startswith("BAR")]
    edges = [rows[0][0]] + bars + [rows[-1][0] + 16]
    print("instructions between barriers:",
          ", ".join(f"{sum(lo <= a < hi for a, _, _ in rows)} ({lo:#x}-{hi:#x})"
                    for lo, hi in zip(edges, edges[1:])))
    counts = collections.Counter(line for _, _, line in rows)
    for line, n in counts.most_common(args.top):
        text = source[line - 1].strip() if 0 < line <= len(source) else "?"
        print(f"{n:6d}  line {line:5d}  {text[:90]}")


if __name__ == "__main__":
    main()
