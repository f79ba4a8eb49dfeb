"""Measured vs predicted device bytes of the unplanned step, for every zoo model at tiny size (CPU).

    python bench/measured_peak.py

Each model's joint graph is executed for real while the bytes of live storages are counted node by node;
the simulator's profile of the same step is compared op by op. This is the table behind the claim that the
memory model is exact (the test suite asserts the same, to the byte).
"""
from __future__ import annotations

import sys
import time
import warnings

from tabulate import tabulate

from karma_fx.api import prepare
from karma_fx.passes.measure import measure_step
from karma_fx.simulate import simulate
from karma_fx.zoo import build, names


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    models = (argv or sys.argv[1:]) or names()
    rows = []
    for name in models:
        model, args, kwargs = build(name, "tiny")
        prep = prepare(model, args, kwargs, name=name)
        t0 = time.perf_counter()
        measured = measure_step(prep.step, model, args, kwargs)
        run_s = time.perf_counter() - t0
        tl = simulate(prep.problem, (), prep.costs)
        per_op = [abs(b - measured.live_bytes[op.name]) for op, (_, b) in zip(prep.problem.ops, tl.memory)]
        rows.append([name, len(prep.problem.ops), measured.peak_bytes, tl.peak_bytes,
                     tl.peak_bytes - measured.peak_bytes, max(per_op), f"{run_s:.2f}"])
    print(tabulate(rows, headers=["model (tiny)", "ops", "measured peak B", "simulated peak B", "diff B",
                                  "max per-op diff B", "real run s"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
