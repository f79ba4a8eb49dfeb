"""How long the default strategy takes to plan each zoo model, and how close its plan is to the bound.

    python bench/plan_speed.py                                  # every tiny zoo model, 3 budgets in its range
    python bench/plan_speed.py --budgets 0.7,0.5,0.35           # fractions of the unplanned peak instead
    python bench/plan_speed.py --models resnet1001,wrn28_10 --positions 0.5
    python bench/plan_speed.py --size real --models resnet1001,megatron_gpt --time-limit 60 \\
        --precision bf16-mixed --strategies cpsat,greedy      # issue 14's real-size table (on meta, H100 preset)
    python bench/plan_speed.py --models resnet1001 --positions 0.25 --curve 1,2,4,8,16,none
                                                            # what more time buys: one row per time limit

With no ``--time-limit`` each plan gets cpsat's default limit, which grows with the graph
(``karma_fx.strategies.cpsat.planner.default_time_limit_s``); ``--curve`` plans each cell once per limit given
(``none``: no limit at all, ``default``: the default), so the default can be set against what it gives up.

Issue 14 asks for every tiny model in at most 5 s on two cores, and for GPT-2-48 (``megatron_gpt`` real: 1.56B,
48 layers) and ResNet-1001 at real size in at most 60 s with no fallback caused by their size. Each row is one
``prepare(...).plan(budget, strategy)`` call: planning seconds (the strategy only, the capture excluded; real
models are captured once per precision, on the meta device, in 10-40 s), the plan's status, its simulated step
time, the proven lower bound (cpsat only) and the gap between them. Timings are wall-clock seconds on this machine.

Budgets: by default at ``--positions`` 0.75 / 0.5 / 0.25 of the way from the leanest plan's peak (every saved
activation swapped out just in time: 0) to the unplanned peak (1), so that every row plans. Fractions of the
unplanned peak (``--budgets``) are what the compare tables use, but at tiny size the weights and inputs set
floors at 0.56-0.9 of the peak, so most such rows would time only the bound's proof that nothing fits
("infeasible" rows).
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

from tabulate import tabulate

from karma_fx.api import prepare
from karma_fx.zoo import build, names

POSITIONS = ("0.75", "0.5", "0.25")


def rows(models: list[str], budgets: list[str], strategies: list[str], *, size: str = "tiny",
         precision: str = "fp32", device: str | None = None, time_limit_s: float | None = None,
         positions: bool = False, overrides: dict | None = None) -> list[list]:
    """One row per (model, budget, strategy): model, ops, budget, strategy, seconds, status, step µs, bound µs,
    gap %. ``positions``: each budget is a position between the leanest plan's peak (0) and the unplanned peak
    (1), shown as ``t=… (fraction of the peak)``; otherwise a fraction of the unplanned peak."""
    out = []
    for name in models:
        model, args, kwargs = build(name, size, precision=precision, **({"device": "meta"} if size == "real" else {}),
                                    **(overrides or {}))
        prepared = _prepared(name, size, precision, device, tuple(sorted((overrides or {}).items())), model, args,
                             kwargs)
        for budget in budgets:
            value: float | int = float(budget)
            label = budget
            if positions:
                floor, peak = prepared.min_peak_bytes(), prepared.unplanned_peak_bytes
                value = int(floor + float(budget) * (peak - floor))
                label = f"t={budget} ({value / peak:.2f})"
            for strategy in strategies:
                t0 = time.perf_counter()
                plan = prepared.plan(value, strategy, raise_if_infeasible=False, time_limit_s=time_limit_s).plan
                seconds = time.perf_counter() - t0
                bound = plan.lower_bound_us
                gap = (plan.step_time_us / bound - 1) * 100 if bound and plan.fits else None
                out.append([name, len(prepared.problem.ops), label, strategy, round(seconds, 2),
                            plan.status if plan.fits else "infeasible", plan.step_time_us,
                            None if bound is None else round(bound, 3), None if gap is None else round(gap, 2)])
    return out


_CAPTURED: dict = {}


def _prepared(name: str, size: str, precision: str, device: str | None, overrides: tuple, model, args, kwargs):
    """One capture per model and settings, however many time limits a curve plans it with."""
    key = (name, size, precision, device, overrides)
    if key not in _CAPTURED:
        _CAPTURED[key] = prepare(model, args, kwargs, name=name, device=device)
    return _CAPTURED[key]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(names()), help="comma-separated zoo models")
    parser.add_argument("--positions", default=",".join(POSITIONS),
                        help="comma-separated positions between the leanest peak (0) and the unplanned one (1)")
    parser.add_argument("--budgets", default=None,
                        help="comma-separated fractions of the unplanned peak (instead of --positions)")
    parser.add_argument("--strategy", "--strategies", dest="strategies", default="cpsat",
                        help="comma-separated strategies")
    parser.add_argument("--size", default="tiny", choices=("tiny", "real"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed", "bf16"))
    parser.add_argument("--device", default=None, help="device preset (default: h100 for real sizes)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per plan (default: cpsat's default limit for the graph)")
    parser.add_argument("--curve", default=None,
                        help="comma-separated time limits (seconds, 'default' or 'none'): one row per limit")
    parser.add_argument("--layers", type=int, default=None, help="override the zoo model's layers")
    parser.add_argument("--hidden", type=int, default=None, help="override the zoo model's hidden size")
    parser.add_argument("--batch", type=int, default=None, help="override the zoo model's batch")
    parser.add_argument("--seq", type=int, default=None, help="override the zoo model's sequence length")
    a = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = a.device or ("h100" if a.size == "real" else None)
    budgets = (a.budgets or a.positions).split(",")
    overrides = {k: v for k, v in (("layers", a.layers), ("hidden", a.hidden), ("batch", a.batch),
                                   ("seq", a.seq)) if v is not None}
    headers = ["model", "ops", "budget", "strategy", "plan s", "status", "step µs", "bound µs", "gap %"]
    if a.curve is None:
        table = rows(a.models.split(","), budgets, a.strategies.split(","), size=a.size, precision=a.precision,
                     device=device, time_limit_s=a.time_limit, positions=a.budgets is None, overrides=overrides)
        print(tabulate(table, headers=headers, floatfmt=".3f"))
        return
    limits = a.curve.split(",")
    for limit in limits:  # every entry checked before anything is planned
        if limit not in ("none", "default") and not limit.replace(".", "", 1).isdigit():
            parser.error(f"--curve takes seconds, 'default' or 'none', got {limit!r}")
    if a.time_limit is not None:
        parser.error("--curve sets the time limits itself: drop --time-limit")
    table = []
    for limit in limits:
        saved = os.environ.pop("KARMA_TIME_LIMIT", None)
        if limit == "none":
            os.environ["KARMA_TIME_LIMIT"] = "none"
        try:
            table += [[limit] + r for r in rows(a.models.split(","), budgets, a.strategies.split(","), size=a.size,
                                                precision=a.precision, device=device, positions=a.budgets is None,
                                                time_limit_s=None if limit in ("none", "default") else float(limit),
                                                overrides=overrides)]
        finally:
            os.environ.pop("KARMA_TIME_LIMIT", None)
            if saved is not None:
                os.environ["KARMA_TIME_LIMIT"] = saved
    print(tabulate(table, headers=["limit s"] + headers, floatfmt=".3f"))


if __name__ == "__main__":
    main()
