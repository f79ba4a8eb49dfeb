"""Strategy x budget comparison on the zoo at real size: simulated step-time ratio and peak, and planning time.

    python bench/compare.py                                   # the 9 models, 5 strategies, 4 budgets (minutes)
    python bench/compare.py --models gpt2,resnet50 --budgets 0.5,0.35 --strategies karma,checkpoint
    python bench/compare.py --size tiny                       # seconds; what CI runs as a smoke test
    python bench/compare.py --precision bf16-mixed --time-limit 20 --json bf16.json   # the headline table
    python bench/compare.py --side-by-side bf16.json,fp32.json  # cpsat per cell, one precision beside another
    python bench/compare.py --loss-chunk 0                    # the loss head never chunked (cpsat may, by default)

Every cell is judged by the same simulator: "1.083x / 11.2 GiB" is the predicted step time over the
unlimited-memory step time and the simulated peak; "infeasible" means the strategy's best plan still peaks
above the budget. Timings are wall-clock seconds on this machine. ``--precision`` is the training regime the
models are built in (``karma_fx.zoo.build``): the headline table is bf16-mixed on the H100 preset, fp32 the
second. Budgets are fractions of each model's own unplanned peak in that regime, so the same fraction is a
different number of bytes per precision; the column headers give the bytes. ``--time-limit`` bounds each
cpsat and greedy call (the other strategies make one pass). The verdict table lists, per model and budget,
whether cpsat is at least as fast as every other strategy that fits, and by how much it is beaten where not.
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
from karma_fx.strategies import COMPARED
from karma_fx.zoo import build
from tabulate import tabulate

KARMA_MODELS = ("resnet50", "vgg16", "resnet200", "wrn28_10", "resnet1001", "megatron_gpt")
LLM_MODELS = ("gpt2", "bert", "llama")
BASELINES = ("checkpoint", "offload", "torch-budget", "karma")  # the anchors' strategies, not ours


def run(models: list[str], strategies: list[str], budgets: list[str], *, size: str, device: str,
        precision: str = "fp32", time_limit_s: float | None = None,
        loss_chunk: int | None = None) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for name in models:
        t0 = time.perf_counter()
        model, args, kwargs = build(name, size, device="meta" if size == "real" else "cpu", precision=precision)
        prepared = prepare(model, args, kwargs, device=device, name=name, loss_chunk=loss_chunk)
        prep_s = time.perf_counter() - t0
        twins = prepared.twins  # the step with its loss head chunked: cpsat (the default) may choose one
        twin = min(twins, key=lambda t: t.min_peak_bytes()) if twins else None
        head = {"model": name, "precision": precision, "device": device, "ops": len(prepared.problem.ops),
                "unplanned_peak_bytes": prepared.unplanned_peak_bytes,
                "min_peak_bytes": prepared.min_peak_bytes(), "unlimited_ms": prepared.keep.makespan_us / 1e3,
                "loss_chunk": twin.loss_chunk if twin is not None else prepared.loss_chunk,
                "min_peak_chunked_bytes": twin.min_peak_bytes() if twin is not None else None,
                "prepare_s": prep_s, "cells": [], "strategy_s": {}, "bound": {}}
        for budget in budgets:  # the proven lower bound on any plan's step time (None: no plan can fit)
            bounds = [lower_bound_us(p.problem, p.costs, parse_budget(budget, prepared.unplanned_peak_bytes),
                                     [b for _, b in p.keep.memory]) for p in [prepared, *twins]]
            bound = min((b for b in bounds if b is not None), default=None)
            head["bound"][budget] = bound and bound / prepared.keep.makespan_us
        for strategy in strategies:
            t1 = time.perf_counter()
            for budget in budgets:
                cell: dict[str, Any] = {"strategy": strategy, "budget": budget,
                                        "budget_bytes": parse_budget(budget, prepared.unplanned_peak_bytes)}
                try:
                    limit = time_limit_s if strategy in ("cpsat", "greedy") else None
                    plan = prepared.plan(budget, strategy, raise_if_infeasible=False, time_limit_s=limit).plan
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
    print(f"\n## {head['model']} ({head.get('precision', 'fp32')}) — {head['ops']} ops on {device}; unplanned peak "
          f"{format_bytes(head['unplanned_peak_bytes'])}, lowest reachable peak {format_bytes(head['min_peak_bytes'])} "
          f"({head['min_peak_bytes'] / head['unplanned_peak_bytes']:.2f} of it"
          + (f"; {format_bytes(head['min_peak_chunked_bytes'])}, "
             f"{head['min_peak_chunked_bytes'] / head['unplanned_peak_bytes']:.2f}, with the loss head chunked "
             f"{head['loss_chunk']} tokens at a time, which cpsat may choose"
             if head.get("min_peak_chunked_bytes") else "")
          + f"), unlimited-memory step {head['unlimited_ms']:.1f} ms")
    print(compare_table(head["cells"], tablefmt="github"))
    print("lower bound (LP relaxation of every plan that moves saved activations): " + ", ".join(
        f"{b}: {'none of them fits' if v is None else f'{v:.3f}x'}" for b, v in head["bound"].items()))
    print("planning: capture+liveness+costs {:.1f} s; ".format(head["prepare_s"])
          + ", ".join(f"{s} {t:.1f} s" for s, t in head["strategy_s"].items())
          + f" (for {len({c['budget'] for c in head['cells']})} budgets)")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(results: list[dict[str, Any]], ours: str = "cpsat") -> str:
    """The issue's targets per budget: speedup of ``ours`` over offload and torch-budget (geometric mean over
    the models where both fit), its slowdown against the unlimited step beside the proven bound's (geometric
    means over the models where it fits and the bound exists: no plan's geometric mean can be below the
    bound's), its average gap to the bound, the cells it fits where no baseline does, and every cell where
    another strategy beats it."""
    budgets = list(dict.fromkeys(c["budget"] for r in results for c in r["cells"]))
    rows, losses = [], []
    for b in budgets:
        speed: dict[str, list[float]] = {"offload": [], "torch-budget": [], "karma": []}
        gaps, only, mine_vs_bound = [], 0, []
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
                mine_vs_bound.append((mine["slowdown"], r["bound"][b]))
            if not any(c.get("fits") for s, c in cells.items() if s in BASELINES):
                only += 1
            losses += [f"{r['model']} at {b}: {s} {c['slowdown']:.3f}x < {mine['slowdown']:.3f}x"
                       for s, c in cells.items() if s != ours and c.get("fits") and c["slowdown"] < mine["slowdown"] - 1e-9]
        slowdowns = (f"{geomean([m for m, _ in mine_vs_bound]):.3f}x / {geomean([x for _, x in mine_vs_bound]):.3f}x "
                     f"({len(mine_vs_bound)})" if mine_vs_bound else "—")
        rows.append([b, *(f"{geomean(v):.2f}x ({len(v)})" if v else "—" for v in speed.values()), slowdowns,
                     f"{sum(gaps) / len(gaps):.1%} ({len(gaps)})" if gaps else "—", only])
    table = tabulate(rows, headers=["budget", f"{ours} vs offload", f"{ours} vs torch-budget", f"{ours} vs karma",
                                    f"slowdown: {ours} / bound", "mean gap to bound", "fits where no baseline does"],
                     tablefmt="github")
    return table + "\n" + ("\n".join(["cells another strategy wins:"] + losses) if losses else f"{ours} is never beaten")


def verdicts(results: list[dict[str, Any]], ours: str = "cpsat") -> tuple[str, list[str]]:
    """Per model and budget: ``ours``'s slowdown, the fastest other strategy that fits, and the verdict "ok"
    (``ours`` at least as fast as every other strategy that fits, or nothing fits) or "beaten by X%" (another
    fits faster, or fits where ``ours`` does not). Returns the table and the violating cells."""
    rows, bad = [], []
    for r in results:
        for b in dict.fromkeys(c["budget"] for c in r["cells"]):
            cells = {c["strategy"]: c for c in r["cells"] if c["budget"] == b}
            mine = cells.get(ours)
            if mine is None:
                continue
            others = sorted((c["slowdown"], s) for s, c in cells.items() if s != ours and c.get("fits"))
            best = others[0] if others else None
            if not mine.get("fits"):
                verdict = "ok (nothing fits)" if best is None else f"VIOLATION: {best[1]} fits, {ours} does not"
            elif best is None or mine["slowdown"] <= best[0] + 1e-9:
                verdict = "ok"
            else:
                verdict = f"VIOLATION: {best[1]} faster by {mine['slowdown'] / best[0] - 1:.2%}"
            if verdict.startswith("VIOLATION"):
                bad.append(f"{r['model']} at {b}: {verdict[len('VIOLATION: '):]}")
            budget_bytes = mine.get("budget_bytes")
            rows.append([r["model"], b, format_bytes(budget_bytes) if budget_bytes else "—",
                         f"{mine['slowdown']:.3f}x" if mine.get("fits") else "infeasible",
                         f"{best[1]} {best[0]:.3f}x" if best else "—", verdict])
    table = tabulate(rows, headers=["model", "budget", "bytes", ours, "fastest other that fits", "verdict"],
                     tablefmt="github")
    return table, bad


def side_by_side(first: list[dict[str, Any]], second: list[dict[str, Any]], ours: str = "cpsat") -> str:
    """``ours``'s cells of two runs (e.g. bf16-mixed and fp32) next to each other: per model and budget, each
    run's budget in bytes and ``ours``'s slowdown (or "infeasible", with the run's lowest reachable peak)."""
    def label(rs: list[dict[str, Any]]) -> str:
        return rs[0].get("precision", "fp32") if rs else "?"

    def cell(r: dict[str, Any] | None, b: str) -> list[str]:
        c = next((c for c in (r or {}).get("cells", []) if c["strategy"] == ours and c["budget"] == b), None)
        if c is None:
            return ["—", "—"]
        return [format_bytes(c["budget_bytes"]), f"{c['slowdown']:.3f}x" if c.get("fits") else
                f"infeasible (floor {format_bytes(r['min_peak_bytes'])})"]
    by_model = {r["model"]: r for r in second}
    rows = []
    for r in first:
        for b in dict.fromkeys(c["budget"] for c in r["cells"]):
            rows.append([r["model"], b, *cell(r, b), *cell(by_model.get(r["model"]), b)])
    a, z = label(first), label(second)
    return tabulate(rows, headers=["model", "budget", f"{a} bytes", f"{a} {ours}", f"{z} bytes", f"{z} {ours}"],
                    tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(KARMA_MODELS + LLM_MODELS))
    p.add_argument("--strategies", default=",".join(COMPARED))
    p.add_argument("--budgets", default="0.7,0.5,0.35,0.25")
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--device", default="h100")
    p.add_argument("--precision", choices=("fp32", "bf16-mixed", "bf16"), default="fp32",
                   help="training regime the models are built in (the headline table is bf16-mixed)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="wall-clock seconds per cpsat or greedy call (default: no limit)")
    p.add_argument("--side-by-side", default=None,
                   help="two earlier --json files A,B: print cpsat's cells of A next to B's and exit")
    p.add_argument("--loss-chunk", default="auto",
                   help="auto (default): cpsat may chunk the loss head, and the floor with it is printed beside the "
                        "floor without; 0: never chunked; n: always, n tokens at a time")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--summary-of", default=None, help="only print the targets of earlier --json files (comma-separated)")
    a = p.parse_args(argv)
    if a.side_by_side:
        first, second = (json.load(open(path)) for path in a.side_by_side.split(","))
        print(side_by_side(first, second))
        return 0
    if a.summary_of:
        results = [r for path in a.summary_of.split(",") for r in json.load(open(path))]
        print(summary(results))
        print(verdicts(results)[0])
        return 0
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = run(a.models.split(","), a.strategies.split(","), a.budgets.split(","), size=a.size, device=a.device,
                  precision=a.precision, time_limit_s=a.time_limit,
                  loss_chunk=None if a.loss_chunk == "auto" else int(a.loss_chunk))
    if "cpsat" in a.strategies.split(","):
        print("\n## Targets (geometric mean over the models where both fit; in brackets how many)")
        print(summary(results))
        table, bad = verdicts(results)
        print(f"\n## cpsat against every other strategy, per cell ({a.precision}, {a.device})")
        print(table)
        print("\n".join(["violating cells:"] + bad) if bad else "no violating cell")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
