"""What the op benchmarks (bench_soft.py, bench_deformable.py) share: the command line, the
device header, the checks against a baseline, the targets' status, the Markdown tables and the
closing report. The timers and the copy bandwidth are bench_ecc.py's.
"""
from __future__ import annotations

import argparse
import json
import math


def make_parser(doc, *, quick, only, json_file, reps, baseline_reps, no_baseline):
    """The parser of a benchmark script: summary and epilog from its docstring (first line;
    from the fourth line on), and the flags every benchmark has, with the given help texts.
    ``--reps 0`` means the script's own default; ``--baseline-reps`` defaults to 3."""
    lines = doc.splitlines()
    p = argparse.ArgumentParser(description=lines[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(lines[3:]))
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--only", help=only)
    p.add_argument("--json", help=json_file)
    p.add_argument("--reps", type=int, default=0, help=reps)
    p.add_argument("--baseline-reps", type=int, default=3, help=baseline_reps)
    p.add_argument("--no-baseline", action="store_true", help=no_baseline)
    return p


def device_and_bandwidth(cp):
    """(name of device 0, its device-to-device copy bandwidth in GB/s, bench_ecc.copy_bandwidth);
    the copy's buffers are returned to the device."""
    from bench_ecc import copy_bandwidth

    dev = cp.cuda.runtime.getDeviceProperties(0)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    bw = copy_bandwidth(cp)
    cp.get_default_memory_pool().free_all_blocks()
    return name, bw


def fmt_ms(ms, digits=4):
    """A time for a table cell: "-" for None or NaN."""
    return "-" if ms is None or ms != ms else f"{ms:.{digits}f}"


def first_line(exc, width):
    """``TypeName: first line of the message`` (cut to ``width`` characters)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:width] if str(exc) else ''}"


# ---------------------------------------------------------------------------------------------
# Checks


def max_rel_error(xp, ours, base, bound=None):
    """max |ours - base| / max |bound| (``bound`` defaults to ``base``); inf for a missing array
    or a shape mismatch, NaN stays NaN."""
    if ours is None or base is None or tuple(ours.shape) != tuple(base.shape):
        return math.inf
    bound = base if bound is None else bound
    diff = float(xp.max(xp.abs(ours.astype("float64") - base.astype("float64"))))
    scale = float(xp.max(xp.abs(bound.astype("float64"))))
    return diff / scale if scale > 0 else diff


def worst(errors):
    """The (error, name) pair with the largest error, NaN counting as the largest."""
    return max(errors, key=lambda p: math.inf if p[0] != p[0] else p[0], default=(0.0, "-"))


def check_cell(what, errors, tol, failures):
    """The check column of a row: "ok 1.2e-07", or "MISMATCH 3.4e-02 (name)" (also added to
    ``failures``) when the worst of ``errors`` ((error, name) pairs) is above ``tol`` or NaN."""
    e, which = worst(errors)
    bad = not (e <= tol)
    if bad:
        failures.append(f"{what}: MISMATCH {e:.2e} in {which}")
    return f"{'MISMATCH' if bad else 'ok'} {e:.1e}" + (f" ({which})" if bad else "")


# ---------------------------------------------------------------------------------------------
# Timing


def time_call_and_graph(cp, fn, reps, notes, label):
    """(call ms, GPU ms or None, ms to compute GB/s from) of ``fn``: event timing of whole calls
    and CUDA-graph replay; when the call cannot be captured, a note says why and GB/s comes
    from the call time."""
    from bench_ecc import time_gpu, time_graph_or_none

    call_ms = time_gpu(cp, fn, reps)
    gpu_ms, why = time_graph_or_none(cp, fn, reps)
    if why:
        notes.append(f"{label}: no CUDA graph ({why}); GB/s from the call time")
    return call_ms, gpu_ms, (gpu_ms if gpu_ms is not None else call_ms)


# ---------------------------------------------------------------------------------------------
# Targets


def time_status(call, gpu, limit):
    """Status of a time target (ms): met per call, met on GPU (graph) time only, or missed by
    the factor of the best time there is."""
    if call <= limit:
        return "MET"
    if gpu is not None and gpu <= limit:
        return "MISSED per call (MET on GPU time)"
    return f"MISSED ({(gpu if gpu is not None else call) / limit:.1f}x)"


def target_dicts(targets):
    return [dict(zip(("target", "measured", "status"), t)) for t in targets]


# ---------------------------------------------------------------------------------------------
# Output


def print_row(cells, flush=True):
    print("| " + " | ".join(cells) + " |", flush=flush)


def print_header(header):
    print_row(header, flush=False)
    print("|" + "---|" * len(header))


def run_cases(cp, cases, header, only, run_case, failures):
    """``run_case(case)`` for every case that ``only(case.name)`` accepts; an exception becomes a
    failed row of the table (``header``'s width) and a failure, and the next case runs. The
    memory pool is emptied after each case."""
    for case in cases:
        if not only(case.name):
            continue
        try:
            run_case(case)
        except Exception as exc:  # a baseline or input failure: report it, go on with the next case
            msg = first_line(exc, 160)
            print(f"| {case.name} | - | failed: {msg} |" + " |" * (len(header) - 3), flush=True)
            failures.append(f"{case.name}: {msg}")
        cp.get_default_memory_pool().free_all_blocks()


def print_report(notes, targets, failures, title, no_targets):
    """The sections after the table: notes, the targets' table (``title``; ``no_targets`` when
    none ran) and the failures."""
    if notes:
        print("\n# Inputs, checks and timing notes")
        for n in notes:
            print(f"- {n}")
    print(f"\n# {title}")
    if targets:
        print("| target | measured | status |\n|---|---|---|")
        for t in targets:
            print_row(t, flush=False)
    else:
        print(no_targets)
    if failures:
        print("\n# Failures")
        for f in failures:
            print(f"- {f}")


def write_json(path, data):
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"\n# results written to {path}")
