"""What splitting dropout into a random mask and a deterministic ``x * mask * scale`` (issue 12 item 3) does to
the plans: the same models, precisions, budgets and strategies planned by two source trees, side by side.

    python bench/dropout_effect.py --before /tmp/before_dropout              # gpt2, bert; fp32, bf16-mixed; H100
    python bench/dropout_effect.py --before /tmp/before_dropout --models gpt2 --budgets 0.5 --time-limit 10
    python bench/dropout_effect.py --before /tmp/before_dropout --models gpt2 --dropout 0.1  # attention dropout on

``--before`` is a source tree from before the split (e.g. a ``git worktree`` of the commit before it, with a
``karma_fx/passes`` link to its ``passes`` folder if it has no such package of its own); ``--after`` defaults
to the tree this file is in. Each tree runs in its own subprocess, importing ``karma_fx`` from that tree, and
prints its results as JSON, so the two versions never share a process. The models are real size, built on the
meta device. Per row: the unplanned peak, the floor (``Prepared.min_peak_bytes()``, the lowest peak any plan
reaches), the budget in bytes (a fraction of that tree's unplanned peak), each strategy's slowdown or
"infeasible", and, after the split, how many dropout outputs the plan rebuilds (recompute decisions over
``masked_scale`` tensors) out of those the backward reads.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def measure(models: list[str], precisions: list[str], budgets: list[str], strategies: list[str], *, device: str,
            time_limit_s: float | None, dropout: float | None = None) -> list[dict[str, Any]]:
    """Plan every combination with the ``karma_fx`` on the import path; one dict per model × precision × budget."""
    from karma_fx.api import prepare
    from karma_fx.budget import parse_budget
    from karma_fx.zoo import build

    rows: list[dict[str, Any]] = []
    for name in models:
        for precision in precisions:
            overrides = {} if dropout is None else {"dropout": dropout}
            model, args, kwargs = build(name, "real", device="meta", precision=precision, **overrides)
            prepared = prepare(model, args, kwargs, device=device, name=name)
            problem = prepared.problem
            saved_dropout = [s.name for s in problem.storages if s.name.startswith("masked_scale")
                             and any(u >= problem.num_fwd_ops for u in s.users)]
            for budget in budgets:
                row: dict[str, Any] = {"model": name, "precision": precision, "budget": budget,
                                       "budget_bytes": parse_budget(budget, prepared.unplanned_peak_bytes),
                                       "unplanned_peak_bytes": prepared.unplanned_peak_bytes,
                                       "min_peak_bytes": prepared.min_peak_bytes(), "ops": len(problem.ops),
                                       "saved_dropout_outputs": len(saved_dropout), "plans": {}}
                for strategy in strategies:
                    t0 = time.perf_counter()
                    plan = prepared.plan(budget, strategy, raise_if_infeasible=False, time_limit_s=time_limit_s).plan
                    rebuilt = {t for r in plan.recomputes for t in r.tensors if t.startswith("masked_scale")}
                    row["plans"][strategy] = {"fits": plan.fits, "slowdown": plan.slowdown, "peak_bytes": plan.peak_bytes,
                                              "rebuilt_dropout": len(rebuilt), "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(f"{name} {precision} {budget} done", file=sys.stderr, flush=True)
    return rows


def run_tree(tree: Path, argv: list[str]) -> list[dict[str, Any]]:
    """This script's ``--worker`` mode in a subprocess importing ``karma_fx`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--worker", *argv], env=env, cwd=tree, check=True,
                         stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)


def table(before: list[dict[str, Any]], after: list[dict[str, Any]], strategies: list[str]) -> str:
    from tabulate import tabulate

    def slow(row: dict[str, Any], s: str) -> str:
        p = row["plans"].get(s)
        if p is None:
            return "—"
        return f"{p['slowdown']:.3f}x" if p["fits"] else "infeasible"

    keyed = {(r["model"], r["precision"], r["budget"]): r for r in after}
    rows = []
    for b in before:
        a = keyed.get((b["model"], b["precision"], b["budget"]))
        if a is None:
            continue
        rows.append([b["model"], b["precision"], b["budget"],
                     f"{b['unplanned_peak_bytes'] / GIB:.2f} → {a['unplanned_peak_bytes'] / GIB:.2f}",
                     f"{b['min_peak_bytes'] / GIB:.2f} → {a['min_peak_bytes'] / GIB:.2f}",
                     f"{b['budget_bytes'] / GIB:.2f} → {a['budget_bytes'] / GIB:.2f}",
                     *(f"{slow(b, s)} → {slow(a, s)}" for s in strategies),
                     " / ".join(f"{a['plans'][s]['rebuilt_dropout']}" for s in strategies if s in a["plans"])
                     + f" of {a['saved_dropout_outputs']}"])
    headers = ["model", "precision", "budget", "unplanned peak GiB", "floor GiB", "budget GiB",
               *strategies, "dropout outputs rebuilt (" + " / ".join(strategies) + ")"]
    return tabulate(rows, headers=headers, tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="source tree from before the dropout split")
    p.add_argument("--after", default=str(HERE), help="source tree after it (default: this one)")
    p.add_argument("--models", default="gpt2,bert")
    p.add_argument("--precisions", default="fp32,bf16-mixed")
    p.add_argument("--budgets", default="0.7,0.5,0.35")
    p.add_argument("--strategies", default="greedy,cpsat")
    p.add_argument("--device", default="h100")
    p.add_argument("--dropout", type=float, default=None,
                   help="the zoo's dropout override (all dropouts, attention's too, which forces the math path); "
                        "default: the zoo's real-size setting (0.1 residual/hidden, attention 0, fused SDPA)")
    p.add_argument("--time-limit", type=float, default=None, help="wall-clock seconds per plan (cpsat, greedy)")
    p.add_argument("--json", default=None, help="also write both trees' raw results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    strategies = a.strategies.split(",")
    if a.worker:
        import karma_fx

        print(f"karma_fx from {Path(karma_fx.__file__).parent}", file=sys.stderr, flush=True)
        warnings.filterwarnings("ignore")
        rows = measure(a.models.split(","), a.precisions.split(","), a.budgets.split(","), strategies,
                       device=a.device, time_limit_s=a.time_limit, dropout=a.dropout)
        json.dump(rows, sys.stdout)
        return 0
    if not a.before:
        p.error("--before is required (a source tree from before the dropout split)")
    passed = ["--models", a.models, "--precisions", a.precisions, "--budgets", a.budgets, "--strategies",
              a.strategies, "--device", a.device, *(["--time-limit", str(a.time_limit)] if a.time_limit else []),
              *(["--dropout", str(a.dropout)] if a.dropout is not None else [])]
    before = run_tree(Path(a.before).resolve(), passed)
    after = run_tree(Path(a.after).resolve(), passed)
    print(f"before = {a.before}, after = {a.after}; {a.device} preset; dropout "
          f"{'as the zoo sets it' if a.dropout is None else a.dropout}; cells read before → after")
    print(table(before, after, strategies))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"before": before, "after": after}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
