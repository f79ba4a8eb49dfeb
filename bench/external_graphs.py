"""External graphs, recompute only: random layered training graphs (``karma_fx.external.random_layered_graph``)
of 100 / 250 / 500 / 1000 nodes, fixed seeds, planned by ``cpsat`` with a 10 s time limit at 0.9 / 0.8 / 0.7 /
0.5 of each graph's unplanned peak, without a host link (Checkmate's problem).

Printed per cell: the plan's status, the total-duration increase (simulated step time over the unlimited step
time), the gap to the proven lower bound (step time over the bound, or "infeasible, proven" when the bound
shows no recompute-only plan fits), and the planning time.

    python bench/external_graphs.py                    # the whole table
    python bench/external_graphs.py --nodes 100,250 --budgets 0.8
"""
from __future__ import annotations

import argparse
import time

from tabulate import tabulate

from karma_fx.external import prepare_graph, random_layered_graph

SEEDS = {100: 0, 250: 1, 500: 2, 1000: 3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,250,500,1000")
    parser.add_argument("--budgets", default="0.9,0.8,0.7,0.5")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        seed = SEEDS.get(n, 0)
        prepared = prepare_graph(random_layered_graph(n, seed))
        for fraction in (float(x) for x in args.budgets.split(",")):
            t0 = time.perf_counter()
            plan = prepared.plan(fraction, "cpsat", raise_if_infeasible=False, time_limit_s=args.time_limit).plan
            seconds = time.perf_counter() - t0
            if plan.lower_bound_us is None and plan.status == "INFEASIBLE":
                gap = "infeasible, proven"
            elif plan.lower_bound_us:
                gap = f"{plan.step_time_us / plan.lower_bound_us - 1:.2%}" if plan.fits else "-"
            else:
                gap = "no bound"
            rows.append([f"layered {n} (seed {seed})", f"{fraction:g}", plan.status,
                         f"+{plan.slowdown - 1:.2%}" if plan.fits else "does not fit", gap, f"{seconds:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(tabulate(rows, headers=["graph", "budget", "status", "duration increase", "gap to bound", "plan s"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
