"""Why ab_ecc.py's 2048^2 float32 replay (25 us at 32-row tiles, fifty-seventh session) is slower
than bench_ecc.py's (21 us). Builds bench_ecc.py's plan (histogram_plan with raw float32 host
thresholds, its image) and ab_ecc.py's (plan_for with check_thresholds' thresholds, its image and
launch.PREPARE_REPEATS = False), prints each plan's settings, then times every (plan, image)
pair, and bench_ecc.time_graph of bench's, alternately in one process.

    python3 benchmarks/wip/plan_diag.py MIN_TILES      (HIST_TALL_MIN_TILES: 2 or 1)
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ab_ecc  # noqa: E402
import bench_ecc  # noqa: E402

from cutopo import _ecc_cupy  # noqa: E402
from cutopo._checks import check_thresholds  # noqa: E402
from cutopo._cuda import launch  # noqa: E402

_ecc_cupy.HIST_TALL_MIN_TILES = float(sys.argv[1])
_ecc_cupy.clear_plans()


def shown(plan):
    return {k: v for k, v in vars(plan).items() if isinstance(v, (int, float, tuple, str, bool))}


n = 2048
images = {"bench image": bench_ecc.make_image(cp, (n, n), "float32", abs(hash("2d 2048^2 float32")) % 2**32),
          "ab image": bench_ecc.make_image(cp, (n, n), "float32", 12345)}
host_t = np.linspace(0, 1, 256, dtype=np.float32)
t, _ = check_thresholds(host_t, np.empty(0, dtype=np.float32))
print("thresholds equal:", np.array_equal(host_t, t), host_t.dtype, t.dtype)
plans = {"bench plan": _ecc_cupy.histogram_plan(images["bench image"], host_t, 2, False)}
saved = launch.PREPARE_REPEATS
launch.PREPARE_REPEATS = False
plans["ab plan"] = ab_ecc.plan_for(("build", ((), {})), images["ab image"], t, 2, False)
launch.PREPARE_REPEATS = saved
for name, plan in plans.items():
    print(name, shown(plan), flush=True)
    for attr in ("histogram", "launch", "kernel"):
        if hasattr(plan, attr):
            print("  ", attr, shown(getattr(plan, attr)) if hasattr(getattr(plan, attr), "__dict__") else getattr(plan, attr))
graphs = {}
for pn, plan in plans.items():
    for im, image in images.items():
        flat = image.reshape((1, n, n))
        graphs[f"{pn} x {im}"] = ab_ecc.capture(cp, lambda plan=plan, flat=flat: plan(flat))
times = {k: [] for k in graphs}
times["bench time_graph"] = []
flat = images["bench image"].reshape((1, n, n))
for _ in range(5):
    for k, g in graphs.items():
        times[k].append(ab_ecc.replay_ms(cp, *g, 20) * 1e3)
    times["bench time_graph"].append(bench_ecc.time_graph(cp, lambda: plans["bench plan"](flat), 50) * 1e3)
print(f"min_tiles {sys.argv[1]}:", {k: round(float(np.median(v)), 1) for k, v in times.items()}, flush=True)
