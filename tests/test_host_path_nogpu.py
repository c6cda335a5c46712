"""benchmarks/host_path_nogpu.py runs on a machine without a GPU (its stand-ins follow the
soft ECC's host path as the code changes): a few calls of each case, in a subprocess (the
script replaces parts of CuPy for its process)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("cupy")  # imports without a GPU (CI installs it: the nvrtc extra)
SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "host_path_nogpu.py"


@pytest.mark.parametrize("case, launches", [("2d", 3), ("3d", 5)])
def test_host_path_script_runs_without_a_gpu(case, launches):
    run = subprocess.run([sys.executable, str(SCRIPT), case, "--calls", "20"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"soft_ecc {case}: first launch ([\d.]+) us, forward ([\d.]+), forward\+pullback "
                     rf"([\d.]+), pullback to its first launch ([\d.]+) \((\d+) launches a call\)", line)
    assert m, line
    first, forward, total, _ = map(float, m.groups()[:4])
    assert 0 < first < forward < total
    assert int(m.group(5)) == launches
