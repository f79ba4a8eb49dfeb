"""How long the default strategy takes to plan each zoo model, and how close its plan is to the bound.

    python bench/plan_speed.py                                  # every tiny zoo model at 0.7, 0.5, 0.35
    python bench/plan_speed.py --models resnet1001,wrn28_10 --budgets 0.5
    python bench/plan_speed.py --size real --models resnet1001,megatron_gpt --time-limit 60 \\
        --precision bf16-mixed --strategies cpsat,greedy      # issue 14's real-size table (on meta, H100 preset)

Issue 14 asks for every tiny model in at most 5 s on two cores, and for GPT-2-48 (``megatron_gpt`` real: 1.56B,
48 layers) and ResNet-1001 at real size in at most 60 s with no fallback caused by their size. Each row is one
``prepare(...).plan(budget, strategy)`` call: planning seconds (the strategy only, the capture excluded; real
models are captured once per precision, on the meta device, in 10-40 s), the plan's status, its simulated step
time, the proven lower bound (cpsat only) and the gap between them. "infeasible" rows are budgets below the
leanest plan's peak (the bound proves that no plan fits). Timings are wall-clock seconds on this machine.
"""
from __future__ import annotations

import argparse
import time
import warnings

from tabulate import tabulate

from karma_fx.api import prepare
from karma_fx.zoo import build, names

BUDGETS = ("0.7", "0.5", "0.35")


def rows(models: list[str], budgets: list[str], strategies: list[str], *, size: str = "tiny",
         precision: str = "fp32", device: str | None = None, time_limit_s: float | None = None) -> list[list]:
    """One row per (model, budget, strategy): model, ops, budget, strategy, seconds, status, step µs, bound µs,
    gap %."""
    out = []
    for name in models:
        model, args, kwargs = build(name, size, precision=precision, **({"device": "meta"} if size == "real" else {}))
        prepared = prepare(model, args, kwargs, name=name, device=device)
        for budget in budgets:
            for strategy in strategies:
                t0 = time.perf_counter()
                plan = prepared.plan(float(budget), strategy, raise_if_infeasible=False,
                                     time_limit_s=time_limit_s).plan
                seconds = time.perf_counter() - t0
                bound = plan.lower_bound_us
                gap = (plan.step_time_us / bound - 1) * 100 if bound and plan.fits else None
                out.append([name, len(prepared.problem.ops), budget, strategy, round(seconds, 2),
                            plan.status if plan.fits else "infeasible", plan.step_time_us,
                            None if bound is None else round(bound, 3), None if gap is None else round(gap, 2)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(names()), help="comma-separated zoo models")
    parser.add_argument("--budgets", default=",".join(BUDGETS), help="comma-separated budget fractions")
    parser.add_argument("--strategy", "--strategies", dest="strategies", default="cpsat",
                        help="comma-separated strategies")
    parser.add_argument("--size", default="tiny", choices=("tiny", "real"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed", "bf16"))
    parser.add_argument("--device", default=None, help="device preset (default: h100 for real sizes)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per plan (default: none)")
    a = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = a.device or ("h100" if a.size == "real" else None)
    table = rows(a.models.split(","), a.budgets.split(","), a.strategies.split(","), size=a.size,
                 precision=a.precision, device=device, time_limit_s=a.time_limit)
    print(tabulate(table, headers=["model", "ops", "budget", "strategy", "plan s", "status", "step µs", "bound µs",
                                   "gap %"], floatfmt=".3f"))


if __name__ == "__main__":
    main()
