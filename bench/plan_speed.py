"""How long the default strategy takes to plan each tiny zoo model, and how close its plan is to the bound.

    python bench/plan_speed.py                                  # every tiny zoo model at 0.7, 0.5, 0.35
    python bench/plan_speed.py --models resnet1001,wrn28_10 --budgets 0.5

Issue 14 asks for every tiny model in at most 5 s on two cores. Each row is one ``prepare(...).plan(budget,
"cpsat")`` call: planning seconds (the strategy only, the capture excluded), the plan's status, its simulated
step time, the proven lower bound and the gap between them. "infeasible" rows are budgets below the leanest
plan's peak (the bound proves that no plan fits). Timings are wall-clock seconds on this machine.
"""
from __future__ import annotations

import argparse
import time
import warnings

from tabulate import tabulate

from karma_fx.api import prepare
from karma_fx.zoo import build, names

BUDGETS = ("0.7", "0.5", "0.35")


def rows(models: list[str], budgets: list[str], strategy: str) -> list[list]:
    """One row per (model, budget): model, ops, budget, seconds, status, step µs, bound µs, gap %."""
    out = []
    for name in models:
        model, args, kwargs = build(name, "tiny")
        prepared = prepare(model, args, kwargs, name=name)
        for budget in budgets:
            t0 = time.perf_counter()
            plan = prepared.plan(float(budget), strategy, raise_if_infeasible=False).plan
            seconds = time.perf_counter() - t0
            bound = plan.lower_bound_us
            gap = (plan.step_time_us / bound - 1) * 100 if bound and plan.fits else None
            out.append([name, len(prepared.problem.ops), budget, round(seconds, 2),
                        plan.status if plan.fits else "infeasible", plan.step_time_us,
                        None if bound is None else round(bound, 3), None if gap is None else round(gap, 2)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(names()), help="comma-separated tiny zoo models")
    parser.add_argument("--budgets", default=",".join(BUDGETS), help="comma-separated budget fractions")
    parser.add_argument("--strategy", default="cpsat")
    a = parser.parse_args()
    warnings.filterwarnings("ignore")
    table = rows(a.models.split(","), a.budgets.split(","), a.strategy)
    print(tabulate(table, headers=["model", "ops", "budget", "plan s", "status", "step µs", "bound µs", "gap %"],
                   floatfmt=".3f"))


if __name__ == "__main__":
    main()
