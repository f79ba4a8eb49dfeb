"""Planning time vs graph size: capture, liveness and the cpsat solve, separately.

    python bench/solver_scaling.py                          # GPT-2 6/12/24/48 layers, ResNet-50/200/1001
    python bench/solver_scaling.py --models gpt2:6,resnet50 --budget 0.5
    python bench/solver_scaling.py --models gpt2:12,gpt2:48,resnet1001 --budget 0.7,0.5,0.35 --time-limit 60 --versus greedy

Sizes are the zoo's real ones (GPT-2 at batch 8, sequence 1024, with the layer count overridden); the budget
is a fraction of each model's unplanned peak. Wall-clock seconds on this machine (2 cores in CI).
"""
from __future__ import annotations

import argparse
import time
import warnings

from tabulate import tabulate

from karma_fx.api import prepare
from karma_fx.errors import KarmaError
from karma_fx.zoo import build

DEFAULT = "gpt2:6,gpt2:12,gpt2:24,gpt2:48,resnet50,resnet200,resnet1001"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT)
    p.add_argument("--budget", default="0.5")
    p.add_argument("--strategy", default="cpsat")
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per plan (cpsat's time_limit_s)")
    p.add_argument("--versus", default=None, help="also plan with this strategy and print its slowdown")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for spec in a.models.split(","):
        name, _, layers = spec.partition(":")
        overrides = {"layers": int(layers)} if layers else {}
        t0 = time.perf_counter()
        model, args, kwargs = build(name, a.size, device="meta" if a.size == "real" else "cpu", **overrides)
        prep = prepare(model, args, kwargs, name=spec)
        build_s = time.perf_counter() - t0 - sum(prep.seconds.values())
        for budget in a.budget.split(","):
            cells = []
            for strategy in [a.strategy] + ([a.versus] if a.versus else []):
                try:
                    planned = prep.plan(budget, strategy, raise_if_infeasible=False, time_limit_s=a.time_limit)
                    plan, solve_s = planned.plan, planned.seconds["strategy"]
                    outcome = f"{plan.slowdown:.3f}x {plan.status}" if plan.fits else f"infeasible ({plan.status})"
                except KarmaError as exc:
                    solve_s, outcome = float("nan"), f"error: {exc}"
                cells += [f"{solve_s:.1f}", outcome]
            rows.append([spec, budget, len(prep.step.joint.graph.nodes), len(prep.problem.ops), f"{build_s:.1f}",
                         f"{prep.seconds['capture']:.1f}", f"{prep.seconds['liveness']:.1f}", *cells])
            print(tabulate(rows[-1:], tablefmt="plain"), flush=True)
    print()
    versus = [f"{a.versus} s", a.versus] if a.versus else []
    print(tabulate(rows, headers=["model", "budget", "graph nodes", "ops", "build s", "capture s", "liveness s",
                                  f"{a.strategy} s", a.strategy, *versus], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
