"""Feature-map layouts shared by the deformable_aggregation tests (CPU and GPU)."""
from __future__ import annotations

import numpy as np


def map_layout(shapes, K, gap=0, other=1):
    """(map shapes (K, S, 2), first rows (K, S), rows in all) of K cameras whose S levels have
    the (H, W) ``shapes``, except camera ``other`` (when K > 1): one row more and one column
    less (at least 1), so that cameras differ in size. The maps are stacked camera-major in one
    flattened feature array, ``gap`` unused rows after each."""
    S = len(shapes)
    sh = np.array([[list(hw) for hw in shapes]] * K, dtype=np.int64)
    if K > 1:
        sh[other] = np.maximum(1, sh[other] + np.array([1, -1]))
    starts = np.zeros((K, S), dtype=np.int64)
    row = 0
    for k in range(K):
        for s in range(S):
            starts[k, s] = row
            row += int(sh[k, s, 0] * sh[k, s, 1]) + gap
    return sh, starts, row
