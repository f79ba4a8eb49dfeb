"""External graphs, recompute only: random layered graphs (``karma_fx.external.random_layered_graph``), training
graphs of 100 / 250 / 500 / 1000 nodes and, with ``--forward-only``, narrow graphs without a backward written in
Moccasin's format, or with ``--wide`` graphs shaped like Moccasin's random layered ones (``random_wide_graph``;
general rematerialization: only ``remat`` moves anything in graphs without a backward), fixed seeds, planned by the
default strategy with a 10 s time limit at 0.9 / 0.8 / 0.7 / 0.5 of each graph's unplanned peak, without a host
link (Checkmate's problem). ``--graph FILE`` plans node-link files instead (Checkmate's or Moccasin's, as
they ship them: this bench fetches nothing).

Printed per cell: the plan's status, the total-duration increase (simulated step time over the unlimited step
time), the gap to the proven lower bound (step time over the bound, "none fits, proven (saved activations)" when
the bound shows no plan of saved activations fits, "no bound" where general rematerialization won: the bound does not cover
its plans), the smallest budget known to work, and the planning time.

    python bench/external_graphs.py                    # the whole table
    python bench/external_graphs.py --nodes 100,250 --budgets 0.8
    python bench/external_graphs.py --forward-only --nodes 100,250
    python bench/external_graphs.py --wide --budgets 0.9,0.8,0.7   # Moccasin-like, generated
    python bench/external_graphs.py --graph "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json" --budgets 0.9,0.8
"""
from __future__ import annotations

import argparse
import time

from tabulate import tabulate

from karma_fx.external import prepare_graph, random_layered_graph, random_wide_graph

SEEDS = {100: 0, 250: 1, 500: 2, 1000: 3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,250,500,1000")
    parser.add_argument("--budgets", default="0.9,0.8,0.7,0.5")
    parser.add_argument("--time-limit", type=float, default=10.0)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--forward-only", action="store_true",
                       help="generate narrow layered graphs without a backward, in Moccasin's format")
    shape.add_argument("--wide", action="store_true",
                       help="generate wide graphs without a backward and with long skips, shaped like Moccasin's "
                            "random layered graphs (karma_fx.external.random_wide_graph)")
    parser.add_argument("--graph", action="append", default=[], help="a node-link JSON file to plan (repeatable)")
    args = parser.parse_args(argv)
    if args.graph:
        graphs = [(path, path) for path in args.graph]
    elif args.wide:
        graphs = [(f"wide {n} (seed {n})", random_wide_graph(n, n)) for n in (int(x) for x in args.nodes.split(","))]
    else:
        graphs = [(f"layered {'forward ' if args.forward_only else ''}{n} (seed {SEEDS.get(n, 0)})",
                   random_layered_graph(n, SEEDS.get(n, 0), backward=not args.forward_only))
                  for n in (int(x) for x in args.nodes.split(","))]
    rows = []
    for label, source in graphs:
        prepared = prepare_graph(source)
        t0 = time.perf_counter()
        floor = prepared.min_peak_bytes() / prepared.unplanned_peak_bytes
        floor_s = time.perf_counter() - t0
        for fraction in (float(x) for x in args.budgets.split(",")):
            t0 = time.perf_counter()
            plan = prepared.plan(fraction, raise_if_infeasible=False, time_limit_s=args.time_limit).plan
            seconds = time.perf_counter() - t0
            if plan.lower_bound_us is None and plan.status == "INFEASIBLE":
                proven = any("proves it" in n for n in plan.notes)
                gap = "none fits, proven (saved activations)" if proven else "-"
            elif plan.lower_bound_us:
                gap = f"{plan.step_time_us / plan.lower_bound_us - 1:.2%}" if plan.fits else "-"
            else:
                gap = "no bound"
            rows.append([label, f"{fraction:g}", plan.status, f"+{plan.slowdown - 1:.3%}" if plan.fits
                         else "does not fit", gap, f"{floor:.3f} ({floor_s:.1f} s)", f"{seconds:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(tabulate(rows, headers=["graph", "budget", "status", "duration increase", "gap to bound",
                                  "floor (of peak)", "plan s"], tablefmt="github"))


if __name__ == "__main__":
    main()
