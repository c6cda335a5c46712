"""Fifty-seventh session: why ab_ecc.py's 2048^2 float32 replay (25 us at 32-row tiles) is slower
than bench_ecc.py's (21 us). Prints every HistogramPlan made (instance, tile rows, geometry) for
cutopo.ecc(image, 256) as bench_ecc.py calls it and for ab_ecc.py's plan, then times both graph
replays alternately in one process, with HIST_TALL_MIN_TILES = argv[1]."""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ab_ecc  # noqa: E402
import bench_ecc  # noqa: E402

import cutopo  # noqa: E402
from cutopo import _ecc_cupy  # noqa: E402
from cutopo._checks import check_thresholds  # noqa: E402

_ecc_cupy.HIST_TALL_MIN_TILES = float(sys.argv[1])
made = _ecc_cupy.HistogramPlan.__init__


def traced(self, *args, **kw):
    made(self, *args, **kw)
    shown = {k: v for k, v in vars(self).items() if isinstance(v, (int, float, tuple, str)) and k != "sig"}
    print("plan", self.sig.name.split("ecc_histogram")[1], shown, flush=True)


_ecc_cupy.HistogramPlan.__init__ = traced
image = bench_ecc.make_image(cp, (2048, 2048), "float32", 5)
bench_fn = lambda: cutopo.ecc(image, 256)  # noqa: E731
t, _ = check_thresholds(np.linspace(0, 1, 256).astype(np.float32), np.empty(0, dtype=np.float32))
plan = ab_ecc.plan_for(("build", ((), {})), image, t, 2, False)
flat = image.reshape((1, 2048, 2048))
ab_fn = lambda: plan(flat)  # noqa: E731
graphs = {"bench": ab_ecc.capture(cp, bench_fn), "ab": ab_ecc.capture(cp, ab_fn)}
times = {k: [] for k in graphs}
for _ in range(5):
    for k, g in graphs.items():
        times[k].append(ab_ecc.replay_ms(cp, *g, 20) * 1e3)
print(f"min_tiles {sys.argv[1]}:", {k: round(float(np.median(v)), 1) for k, v in times.items()})
