"""Strategy x budget comparison on the zoo at real size: simulated step-time ratio and peak, and planning time.

    python bench/compare.py                                   # the 9 models, 5 strategies, 4 budgets (minutes)
    python bench/compare.py --models gpt2,resnet50 --budgets 0.5,0.35 --strategies karma,checkpoint
    python bench/compare.py --size tiny                       # seconds; what CI runs as a smoke test

Every cell is judged by the same simulator: "1.083x / 11.2 GiB" is the predicted step time over the
unlimited-memory step time and the simulated peak; "infeasible" means the strategy's best plan still peaks
above the budget. Timings are wall-clock seconds on this machine.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from typing import Any

from karma_fx.api import prepare
from karma_fx.strategies.cpsat.bound import lower_bound_us
from karma_fx.budget import format_bytes, parse_budget
from karma_fx.errors import KarmaError
from karma_fx.report import compare_table
from karma_fx.strategies import STRATEGY_NAMES
from karma_fx.zoo import build
from tabulate import tabulate

KARMA_MODELS = ("resnet50", "vgg16", "resnet200", "wrn28_10", "resnet1001", "megatron_gpt")
LLM_MODELS = ("gpt2", "bert", "llama")
BASELINES = ("checkpoint", "offload", "torch-budget", "karma")  # the anchors' strategies, not ours


def run(models: list[str], strategies: list[str], budgets: list[str], *, size: str, device: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for name in models:
        t0 = time.perf_counter()
        model, args, kwargs = build(name, size, device="meta" if size == "real" else "cpu")
        prepared = prepare(model, args, kwargs, device=device, name=name)
        prep_s = time.perf_counter() - t0
        head = {"model": name, "ops": len(prepared.problem.ops), "unplanned_peak_bytes": prepared.unplanned_peak_bytes,
                "min_peak_bytes": prepared.min_peak_bytes(), "unlimited_ms": prepared.keep.makespan_us / 1e3,
                "prepare_s": prep_s, "cells": [], "strategy_s": {}, "bound": {}}
        base = [b for _, b in prepared.keep.memory]
        for budget in budgets:  # the proven lower bound on any plan's step time (None: no plan can fit)
            bound = lower_bound_us(prepared.problem, prepared.costs,
                                   parse_budget(budget, prepared.unplanned_peak_bytes), base)
            head["bound"][budget] = bound and bound / prepared.keep.makespan_us
        for strategy in strategies:
            t1 = time.perf_counter()
            for budget in budgets:
                cell: dict[str, Any] = {"strategy": strategy, "budget": budget,
                                        "budget_bytes": parse_budget(budget, prepared.unplanned_peak_bytes)}
                try:
                    plan = prepared.plan(budget, strategy, raise_if_infeasible=False).plan
                    cell.update(fits=plan.fits, slowdown=plan.slowdown, peak_bytes=plan.peak_bytes)
                except KarmaError as exc:
                    cell.update(fits=False, slowdown=None, peak_bytes=None, error=str(exc))
                head["cells"].append(cell)
            head["strategy_s"][strategy] = time.perf_counter() - t1
        results.append(head)
        print_model(head, device)
        sys.stdout.flush()
    return results


def print_model(head: dict[str, Any], device: str) -> None:
    print(f"\n## {head['model']} — {head['ops']} ops on {device}; unplanned peak "
          f"{format_bytes(head['unplanned_peak_bytes'])}, lowest reachable peak {format_bytes(head['min_peak_bytes'])}, "
          f"unlimited-memory step {head['unlimited_ms']:.1f} ms")
    print(compare_table(head["cells"], tablefmt="github"))
    print("lower bound (LP relaxation of every plan): " + ", ".join(
        f"{b}: {'no plan fits' if v is None else f'{v:.3f}x'}" for b, v in head["bound"].items()))
    print("planning: capture+liveness+costs {:.1f} s; ".format(head["prepare_s"])
          + ", ".join(f"{s} {t:.1f} s" for s, t in head["strategy_s"].items())
          + f" (for {len({c['budget'] for c in head['cells']})} budgets)")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(results: list[dict[str, Any]], ours: str = "cpsat") -> str:
    """The issue's targets per budget: speedup of ``ours`` over offload and torch-budget (geometric mean over
    the models where both fit), its average gap to the proven bound, the cells it fits where no baseline
    does, and every cell where another strategy beats it."""
    budgets = list(dict.fromkeys(c["budget"] for r in results for c in r["cells"]))
    rows, losses = [], []
    for b in budgets:
        speed: dict[str, list[float]] = {"offload": [], "torch-budget": [], "karma": []}
        gaps, only = [], 0
        for r in results:
            cells = {c["strategy"]: c for c in r["cells"] if c["budget"] == b}
            mine = cells.get(ours)
            if not mine or not mine.get("fits"):
                continue
            for other in speed:
                if cells.get(other, {}).get("fits"):
                    speed[other].append(cells[other]["slowdown"] / mine["slowdown"])
            if r["bound"].get(b):
                gaps.append(mine["slowdown"] / r["bound"][b] - 1)
            if not any(c.get("fits") for s, c in cells.items() if s in BASELINES):
                only += 1
            losses += [f"{r['model']} at {b}: {s} {c['slowdown']:.3f}x < {mine['slowdown']:.3f}x"
                       for s, c in cells.items() if s != ours and c.get("fits") and c["slowdown"] < mine["slowdown"] - 1e-9]
        rows.append([b, *(f"{geomean(v):.2f}x ({len(v)})" if v else "—" for v in speed.values()),
                     f"{sum(gaps) / len(gaps):.1%} ({len(gaps)})" if gaps else "—", only])
    table = tabulate(rows, headers=["budget", f"{ours} vs offload", f"{ours} vs torch-budget", f"{ours} vs karma",
                                    "mean gap to bound", "fits where no baseline does"], tablefmt="github")
    return table + "\n" + ("\n".join(["cells another strategy wins:"] + losses) if losses else f"{ours} is never beaten")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(KARMA_MODELS + LLM_MODELS))
    p.add_argument("--strategies", default=",".join(STRATEGY_NAMES))
    p.add_argument("--budgets", default="0.7,0.5,0.35,0.25")
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--device", default="h100")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--summary-of", default=None, help="only print the targets of earlier --json files (comma-separated)")
    a = p.parse_args(argv)
    if a.summary_of:
        results = [r for path in a.summary_of.split(",") for r in json.load(open(path))]
        print(summary(results))
        return 0
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = run(a.models.split(","), a.strategies.split(","), a.budgets.split(","), size=a.size, device=a.device)
    if "cpsat" in a.strategies.split(","):
        print("\n## Targets (geometric mean over the models where both fit; in brackets how many)")
        print(summary(results))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
