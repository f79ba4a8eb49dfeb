"""backend="karma" on a model whose repeated blocks each hold a graph break: Dynamo compiles one region and runs
it once per block, and every run is accounted for. Memory is measured with the allocator's own events
(torch.profiler), which see the compiled step as it runs; a dispatch-mode meter would make Dynamo run eagerly."""
from __future__ import annotations

import copy

import pytest
import torch

from karma_fx.backend import regions
from karma_fx.errors import InfeasibleBudgetError


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "graph_breaks.py"
    spec = importlib.util.spec_from_file_location("graph_breaks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


graph_breaks = _bench()
Stack, weights, measured_step = graph_breaks.Stack, graph_breaks.weights_bytes, graph_breaks.measured_step


def setup():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(128, 64)
    return model, x, graph_breaks.eager_peak(model, x)


def train(step, model, reference, x, steps=3):
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    for i in range(steps):
        step(x).backward()
        reference(x).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
            p.grad = q.grad = None


def test_repeated_regions_share_the_budget_run_by_run():
    model, x, eager = setup()
    budget = weights(model) + (eager - weights(model)) // 2
    options = {"budget": budget, "strategy": "cpsat"}
    step = torch.compile(model, backend="karma", options=options, dynamic=False)
    train(step, model, copy.deepcopy(model), x)
    peak = measured_step(model, step, x)
    print(f"eager {eager} B, budget {budget} B, measured {peak} B")
    assert peak <= budget, (peak, budget, eager)
    planned = [r for r in regions(options) if r.last is not None]
    assert any(len(r.variants) > 1 or r.last.plan.decisions for r in planned), "the runs had to plan"


def test_a_budget_too_small_names_a_total_that_works():
    model, x, eager = setup()
    options = {"budget": weights(model) + 4096, "strategy": "cpsat"}
    step = torch.compile(model, backend="karma", options=options, dynamic=False)
    with pytest.raises(InfeasibleBudgetError) as info:
        for _ in range(3):
            measured_step(model, step, x)
    total = info.value.min_budget_bytes
    assert options["budget"] < total < eager
    torch._dynamo.reset()
    options = {"budget": total, "strategy": "cpsat"}
    step = torch.compile(model, backend="karma", options=options, dynamic=False)
    train(step, model, copy.deepcopy(model), x)
    peak = measured_step(model, step, x)
    print(f"named total {total} B, measured {peak} B")
    assert peak <= total
