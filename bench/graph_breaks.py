"""Repeated graph-broken blocks under ``backend="karma"``: the allocator-measured peak of a steady-state step
against the budget (CPU).

    python bench/graph_breaks.py [--blocks 6] [--batch 128] [--fractions 0.75,0.5,0.35]

Each block holds a graph break (as HuggingFace decoders do per layer), so Dynamo compiles one region per half
block and runs it once per layer. The budget is the weights plus a fraction of the eager step's activations;
the step is compiled, run twice (the first step learns the sequence of runs), then measured with the
allocator's own events (``karma_fx.measure_run.AllocatorPeak``). A budget that cannot work is reported with
the total the error names, and that total is then run and measured too.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.nn as nn
from tabulate import tabulate


class Block(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        h = torch.tanh(torch.tanh(h * 1.5) * 0.5)  # tensors saved inside the region: the plan may move them
        torch._dynamo.graph_break()  # as HF decoders with a break per layer
        return x + self.down(torch.tanh(torch.tanh(h) * 0.5))


class Stack(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def weights_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measured_step(model: nn.Module, step, x: torch.Tensor) -> int:
    from karma_fx.measure_run import AllocatorPeak

    model.zero_grad(set_to_none=True)
    with AllocatorPeak(model.parameters(), x) as meter:
        step(x).backward()
    return meter.peak_bytes


def eager_peak(model: nn.Module, x: torch.Tensor) -> int:
    model(x).backward()  # warm up the allocator
    return measured_step(model, model, x)


def run(model: nn.Module, x: torch.Tensor, budget: int, strategy: str) -> tuple[int, str]:
    """(measured peak, what happened) of a steady-state step at ``budget``; raises InfeasibleBudgetError."""
    from karma_fx.backend import regions

    torch._dynamo.reset()
    options = {"budget": budget, "strategy": strategy}
    step = torch.compile(model, backend="karma", options=options, dynamic=False)
    for _ in range(2):
        measured_step(model, step, x)
    peak = measured_step(model, step, x)
    planned = [r for r in regions(options) if r.last is not None]
    variants = sum(len(r.variants) for r in planned)
    return peak, f"{len(planned)} regions, {variants} plans"


def main(argv: list[str] | None = None) -> int:
    from karma_fx.budget import format_bytes
    from karma_fx.errors import InfeasibleBudgetError

    warnings.filterwarnings("ignore", category=FutureWarning)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--fractions", default="0.75,0.5,0.35", help="of the eager step's activations")
    p.add_argument("--strategy", default="cpsat")
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    torch.manual_seed(0)
    model, x = Stack(a.blocks), torch.randn(a.batch, 64)
    weights, eager = weights_bytes(model), eager_peak(model, x)
    rows = [["eager", "-", format_bytes(eager), "-", "no plan"]]
    for fraction in (float(f) for f in a.fractions.split(",")):
        budget = weights + int(fraction * (eager - weights))
        try:
            peak, what = run(model, x, budget, a.strategy)
            rows.append([f"weights + {fraction:g} x activations", format_bytes(budget), format_bytes(peak),
                         "yes" if peak <= budget else "NO", what])
        except InfeasibleBudgetError as exc:
            total = exc.min_budget_bytes
            rows.append([f"weights + {fraction:g} x activations", format_bytes(budget), "-", "-",
                         f"InfeasibleBudgetError: names {format_bytes(total)}"])
            peak, what = run(model, x, total, a.strategy)
            rows.append(["  the total it names", format_bytes(total), format_bytes(peak),
                         "yes" if peak <= total else "NO", what])
    print(f"{a.blocks} blocks with a graph break each, batch {a.batch}; weights {format_bytes(weights)}; "
          f"strategy {a.strategy}")
    print(tabulate(rows, headers=["budget", "bytes", "measured peak", "under budget", "what"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
