"""What measuring a step on the device it runs on adds to a compile: its share of the first call's wall time.

    python bench/measure_overhead.py                  # the medium CPU models of bench/measured_run.py
    python bench/measure_overhead.py --models gpt-4x512 --budget 0.7

``karma_fx.compile`` measures each region's step where it runs (``karma_fx.pricing``): one run recording the
allocator's events (each kernel's scratch) and one timed run, pooled over ops that do the same thing. The first
call of a compiled module captures, measures, plans, compiles the planned graphs and runs the step; the table
gives that call's wall time, the seconds spent measuring, and their share. The default time budget of the
planner is part of the call, so a region planned for longer dilutes the share: both are printed. Compute runs on
one thread (``--threads``), as in ``bench/measured_run.py``.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
from tabulate import tabulate


def main(argv: list[str] | None = None) -> int:
    import karma_fx
    from karma_fx.zoo import output_to_loss

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from measured_run import MEDIUM

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MEDIUM))
    p.add_argument("--budget", default="0.7")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(a.threads)
    rows = []
    for name in a.models.split(","):
        torch._dynamo.reset()
        model, args, kwargs = MEDIUM[name]()
        step = karma_fx.compile(model, budget=float(a.budget))
        started = time.perf_counter()
        output_to_loss(step(*args, **kwargs)).backward()
        first = time.perf_counter() - started
        for _ in range(2):  # the second step measures the code after the forward; the third is steady
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            output_to_loss(step(*args, **kwargs)).backward()
            second = time.perf_counter() - started
        region = step.regions[-1]
        measuring = region.prepared.seconds.get("costs", 0.0)
        rows.append([name, f"{first:.1f}", f"{second:.2f}", f"{measuring:.2f}", f"{measuring / first:.0%}",
                     step.plan.status, step.plan.device])
    print(tabulate(rows, headers=["model", "first call s", "steady step s", "measuring s", "share", "plan status",
                                  "priced"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
