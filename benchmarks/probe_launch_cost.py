"""Host cost of one prepared kernel launch, kernel by kernel, against what the kernel declares.

    python benchmarks/probe_launch_cost.py [--reps N]

Runs the CPAB forward+VJP of bench_cpab.py's 2D and 3D cases and bench_soft's soft ECC a few
times (so that ``cutopo._cuda.launch`` keeps a PreparedLaunch of every kernel they launch), then
for each kept launch times ``PreparedLaunch._launch`` alone (the driver call on the packed
parameters) in a loop of N launches: with the launch's own grid, and with a grid of one block
(little GPU work queued). Beside each: the parameter count, registers, local and constant
bytes. Then the same driver call through ``cupy.cuda.driver.launchKernel`` with the stream read
once, and two kernels launched alternately. The forty-third session measured 14 us for
integrate_forward's call_prechecked against ~6 us for the soft ECC's list launch
(benchmarks/RESULTS.md); this says whether the driver's cost follows the kernel.
Without a GPU: nothing measured, exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def per_launch_us(cp, fn, reps):
    for _ in range(10):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    cp.cuda.Device().synchronize()
    return (t1 - t0) / reps * 1e6


def warm_calls(cp):
    import cutopo
    from bench_cpab import T_STEPS, cases
    from bench_soft import SoftEcc

    for case in cases(False)[:2]:
        tess, points, theta = case.inputs(cp, 0)
        for _ in range(4):
            out, pullback = cutopo.vjp(cutopo.cpab.integrate, points, theta, tess, wrt="theta",
                                       n_steps=T_STEPS)
            pullback(cp.ones_like(out))
    args, _ = SoftEcc("soft_ecc", (1024, 1024), 2, 256).inputs(cp, 2.0, 0)
    for _ in range(4):
        out, pullback = cutopo.vjp(cutopo.soft_ecc, *args, ndim=2)
        pullback(cp.ones_like(out))
    cp.cuda.Device().synchronize()


def path_costs(cp, reps):
    """Per kernel of the CPAB calls: host us of one launch through launch() (prepared after
    its second call), a KeptLaunches (its kept kind), launch's key alone and call_prechecked
    alone, each with a grid of one block and the arguments of the last warm call."""
    import cutopo
    from bench_cpab import T_STEPS, cases
    from cutopo._cuda import launch as L

    recorded = {}
    kept_call = L.KeptLaunches.__call__

    def recording(self, sig, grid, block, args):
        recorded[sig.name] = (sig, block, args)
        return kept_call(self, sig, grid, block, args)

    L.KeptLaunches.__call__ = recording
    try:
        tess, points, theta = cases(False)[0].inputs(cp, 0)
        for _ in range(3):
            out, pullback = cutopo.vjp(cutopo.cpab.integrate, points, theta, tess, wrt="theta",
                                       n_steps=T_STEPS)
            pullback(cp.ones_like(out))
    finally:
        L.KeptLaunches.__call__ = kept_call
    if not recorded:
        print("\n(no KeptLaunches in this tree)")
        return
    print("\n| kernel | launch() | KeptLaunches | launch key alone | call_prechecked alone |")
    print("|---|---|---|---|---|")
    kept = L.KeptLaunches()
    device = L._current_device()
    for name, (sig, block, args) in recorded.items():
        slots = L._slots(sig)
        generic = per_launch_us(cp, lambda: L.launch(sig, 1, block, args), reps)
        kept_us = per_launch_us(cp, lambda: kept(sig, 1, block, args), reps)
        key_us = per_launch_us(cp, lambda: L._prepared_key(sig, 1, block, 0, (), device, args, slots),
                               reps)
        prepared = next(iter(kept._table.values())) if len(kept._table) == 1 else None
        kept._table.clear()
        values = [args[i] for i in slots[0]]
        pre_us = (per_launch_us(cp, lambda: prepared.call_prechecked(*values), reps)
                  if prepared is not None else float("nan"))
        print(f"| {name.split('<')[0].rsplit('::', 1)[-1]} | {generic:.2f} | {kept_us:.2f} | "
              f"{key_us:.2f} | {pre_us:.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    import cutopo

    if not cutopo.gpu_available():
        print("probe_launch_cost: no CUDA device visible to CuPy")
        return 0
    import cupy as cp
    from cutopo._cuda import launch as L

    warm_calls(cp)
    kept = {}
    for prepared in list(L._PREPARED.values()):
        kept.setdefault(prepared.sig.name, prepared)
    print("| kernel | params | regs | local B | const B | grid | us/launch (own grid) | us/launch (1 block) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, prepared in sorted(kept.items()):
        if prepared.kernel is None:
            continue
        block = prepared._block()
        k = prepared.kernel
        own_reps = max(10, min(args.reps, 20000 // max(1, prepared.grid)))
        own = per_launch_us(cp, lambda: prepared._launch(block), own_reps)
        grid = prepared.grid
        prepared.grid = 1
        try:
            one = per_launch_us(cp, lambda: prepared._launch(block), args.reps)
        finally:
            prepared.grid = grid
        short = name.split("<")[0].rsplit("::", 1)[-1] + "<" + name.split("<", 1)[1][:40]
        print(f"| {short} | {len(prepared.sig.params)} | {k.num_regs} | {k.local_size_bytes} | "
              f"{k.const_size_bytes} | {grid} | {own:.2f} | {one:.2f} |")
        rows.append((name, prepared))
    # the driver call alone: stream read once, the same parameter block, one block
    driver = cp.cuda.driver.launchKernel
    stream = cp.cuda.get_current_stream().ptr
    print("\n| kernel | driver.launchKernel alone, 1 block, us |")
    print("|---|---|")
    for name, prepared in rows:
        block = prepared._block()
        f, threads, smem, address = prepared._function, prepared.block, prepared.shared_mem, block.address
        us = per_launch_us(cp, lambda: driver(f, 1, 1, 1, threads, 1, 1, smem, stream, address, 0),
                           args.reps)
        print(f"| {name.split('<')[0].rsplit('::', 1)[-1]} | {us:.2f} |")
    # get_current_stream alone
    us = per_launch_us(cp, lambda: cp.cuda.get_current_stream().ptr, args.reps)
    print(f"\ncupy.cuda.get_current_stream().ptr: {us:.2f} us")
    # two kernels alternately (as a call launches them), one block each
    if len(rows) >= 2:
        (na, pa), (nb, pb) = rows[0], rows[-1]
        ba, bb = pa._block(), pb._block()
        pa_grid, pb_grid = pa.grid, pb.grid
        pa.grid = pb.grid = 1
        try:
            us = per_launch_us(cp, lambda: (pa._launch(ba), pb._launch(bb)), args.reps) / 2
        finally:
            pa.grid, pb.grid = pa_grid, pb_grid
        print(f"alternating {na.split('<')[0]} and {nb.split('<')[0]}: {us:.2f} us per launch")
    # last: its one-block launches of prepare_cells leave that kernel's counters as they are
    path_costs(cp, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
