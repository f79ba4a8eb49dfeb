"""Predicted vs measured device peak of the compiled training step (tiny zoo models, CPU).

    python bench/measured_run.py [--models cnn,gpt2] [--strategies checkpoint,karma]

For each model the budget is halfway between the compiled step's lowest known-feasible peak and its
unplanned peak; the step is compiled, warmed up, then run once under ``LiveBytes`` (live device storages,
host copies excluded). A table row per model x strategy: budget, simulated peak, measured peak, their ratio.
"""
from __future__ import annotations

import argparse
import copy
import warnings

from tabulate import tabulate

import karma_fx
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.measure_run import measure_step_peak
from karma_fx.zoo import build, output_to_loss

MODELS = "mlp,cnn,resnet50,resnet200,resnet1001,wrn28_10,vgg16,megatron_gpt,gpt2,bert,llama"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=MODELS)
    p.add_argument("--strategies", default="checkpoint,offload,karma")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for name in a.models.split(","):
        model, args, kwargs = build(name, "tiny")
        probe = karma_fx.compile(copy.deepcopy(model), budget=1.0, strategy="keep")
        probe(*args, **kwargs)
        high, low = probe.plan.unplanned_peak_bytes, probe.min_budget_bytes
        budget = low + (high - low) // 2
        for strategy in a.strategies.split(","):
            model, args, kwargs = build(name, "tiny")
            compiled = karma_fx.compile(model, budget=budget, strategy=strategy)
            try:
                output_to_loss(compiled(*args, **kwargs)).backward()
            except InfeasibleBudgetError:
                rows.append([name, strategy, budget, "infeasible", "", ""])
                continue
            live = measure_step_peak(model, compiled, args, kwargs, output_to_loss)
            plan = compiled.plan
            rows.append([name, strategy, budget, plan.peak_bytes, live.peak_bytes,
                         f"{live.peak_bytes / plan.peak_bytes:.4f}"])
    print(tabulate(rows, headers=["model (tiny)", "strategy", "budget B", "simulated peak B", "measured peak B",
                                  "measured / simulated"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
