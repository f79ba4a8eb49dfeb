"""Honest floors: "the smallest budget known to work" is a budget the default strategy fits, on anyone's graphs
(recompute only, where rebuilding every saved activation used to be quoted though it lowers nothing on a
chain) and on captured models (with and without a host link)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import karma_fx
from karma_fx.measure_run import AllocatorPeak
from karma_fx.plan import Offload

from karma_fx.api import Prepared
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.external import prepare_graph, random_layered_graph, random_wide_graph
from karma_fx.strategies.base import figures_of
from karma_fx.strategies.leanest import backward_swaps, leanest_recomputes, leanest_swaps

from conftest import prepared


def chain_graph(sizes_mib: list[int]) -> dict:
    """A VGG-like training chain: forward node ``k`` reads node ``k - 1``; its backward node reads the forward
    node, the forward node's input and the backward node after it, as a convolution's gradient does."""
    n = len(sizes_mib)
    nodes = [{"id": k, "name": f"f{k}", "cost_cpu": 10 + k, "cost_ram": s << 20, "backward": False}
             for k, s in enumerate(sizes_mib)]
    nodes += [{"id": 2 * n - 1 - k, "name": f"b{k}", "cost_cpu": 20 + k, "cost_ram": s << 20, "backward": True}
              for k, s in reversed(list(enumerate(sizes_mib)))]
    links = [(k, k + 1) for k in range(n - 1)] + [(n - 1, n)]
    for k in range(n):
        b = 2 * n - 1 - k
        links += [(k, b)] + ([(k - 1, b)] if k else []) + ([(b - 1, b)] if k < n - 1 else [])
    links = sorted(set(links))
    return {"graph": {"name": f"chain-{n}"}, "nodes": sorted(nodes, key=lambda d: d["id"]),
            "links": [{"source": s, "target": t} for s, t in links]}


def assert_floor_is_reached(prep: Prepared) -> int:
    """The quoted floor is at most the unplanned peak, the default strategy fits it, and a byte less is either
    planned too (the solver may find leaner plans than the floor's) or refused naming that same floor."""
    floor = prep.min_peak_bytes()
    assert floor <= prep.unplanned_peak_bytes
    plan = prep.plan(floor).plan
    assert plan.fits and plan.peak_bytes <= floor and plan.status != "INFEASIBLE", plan.status
    try:
        below = prep.plan(floor - 1).plan
    except InfeasibleBudgetError as exc:
        assert exc.min_budget_bytes == floor and str(floor) in str(exc)
    else:
        assert below.peak_bytes <= floor - 1
    return floor


GRAPHS = {"chain": lambda: chain_graph([3136, 3136, 784, 1568, 1568, 392, 784, 784, 784, 196, 392, 392, 98, 4]),
          **{f"layered-{n}": (lambda n=n: random_layered_graph(n, n)) for n in (40, 100)},
          "wide-250": lambda: random_wide_graph(250, 250)}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_recompute_only_floors_of_external_graphs_are_reached(name):
    prep = prepare_graph(GRAPHS[name]())
    floor = assert_floor_is_reached(prep)
    rebuild_all = figures_of(prep.problem, prep.costs, leanest_recomputes(prep.problem)).peak_bytes
    # rebuilding every saved activation lowers nothing on these graphs; the floor quoted is far lower
    assert rebuild_all == prep.unplanned_peak_bytes
    assert floor < 0.9 * prep.unplanned_peak_bytes


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "recompute-only"])
@pytest.mark.parametrize("name", ["cnn", "gpt2", "resnet50", "vgg16", "llama"])
def test_zoo_floors_are_reached(name, offload):
    prep = prepared(name)
    if not offload:
        prep = Prepared(problem=prep.problem, costs=replace(prep.costs, allow_offload=False), keep=prep.keep)
    assert_floor_is_reached(prep)


def test_the_floor_is_reached_under_a_time_limit_too():
    """The leanest plan is computed whatever deadline the caller set: inside a cpsat with a 0.05 s limit greedy's
    plan for nothing stopped early, and the plan cpsat fell back to peaked at 2.1x the floor it quotes."""
    for seed in (0, 1):
        prep = prepare_graph(random_layered_graph(100, seed))
        floor = prep.min_peak_bytes()
        plan = prep.plan(floor, time_limit_s=0.05).plan
        assert plan.fits and plan.peak_bytes <= floor, (seed, plan.status, plan.peak_bytes / floor)


class TwoBranches(nn.Module):
    """A light branch computed after a heavy one off a shared input: the backward makes the light branch's
    input gradient first and holds it, unread, through the heavy branch's backward until the two are added."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.fc0(inp)
        heavy = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return (heavy + x * self.w).pow(2).mean()


def test_a_floor_swapping_gradients_the_backward_holds_unread_runs_as_eager_at_its_peak():
    """The leanest plan also swaps out what the backward makes and leaves unread for a while (on real GPT-2 in
    bf16-mixed, the chunked head's weight gradient, held until the tied embedding's is added). Compiled at that
    floor, the step trains as eager, and the allocator's peak is the plan's."""
    torch.manual_seed(0)
    inp = torch.randn(512, 64)
    prep = karma_fx.prepare(TwoBranches(), (inp,), compiler="eager", costs="roofline")
    swaps = leanest_swaps(prep.problem)
    assert figures_of(prep.problem, prep.costs, swaps + backward_swaps(prep.problem)).peak_bytes < \
        figures_of(prep.problem, prep.costs, swaps).peak_bytes
    model = TwoBranches()
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, compiler="eager")
    step(inp).backward()
    floor = step.min_budget_bytes
    model.zero_grad(set_to_none=True)
    budget = int(1.01 * floor)  # below the floor without those swaps, 6% above this one
    assert budget < figures_of(prep.problem, prep.costs, swaps).peak_bytes
    step = karma_fx.compile(model, budget=budget, compiler="eager")
    for i in range(3):
        x = torch.randn(512, 64, generator=torch.Generator().manual_seed(i))
        got = step(x)
        got.backward()  # before the reference runs: code between the step's forward and backward is the step's
        want = reference(x)
        want.backward()
        assert torch.allclose(got, want, rtol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    made_in_backward = {s.name for s in step.regions[0].prepared.problem.storages
                        if s.producer is not None and s.producer >= step.regions[0].prepared.problem.num_fwd_ops}
    assert any(isinstance(d, Offload) and d.tensor in made_in_backward for d in step.plan.decisions)
    with AllocatorPeak(model.parameters(), x) as meter:
        step(x).backward()
    assert meter.peak_bytes <= budget, (meter.peak_bytes, budget)
    assert meter.peak_bytes >= step.predicted_peak_bytes - 1024, (meter.peak_bytes, step.predicted_peak_bytes)


def test_below_every_plan_of_saved_activations_cpsat_falls_back_to_the_leanest_plan_claiming_no_bound():
    """Between the leanest plan's floor and the lowest peak of plans that move saved activations, the LP bound
    proves that none of those fits; cpsat then returns the leanest plan, which also swaps out what the backward
    holds unread, and claims no bound (the LP does not cover it). It used to return INFEASIBLE there, below
    the floor it quoted."""
    torch.manual_seed(0)
    prep = karma_fx.prepare(TwoBranches(), (torch.randn(512, 64),), compiler="eager", costs="roofline")
    saved_only = figures_of(prep.problem, prep.costs, leanest_swaps(prep.problem)).peak_bytes
    floor = prep.min_peak_bytes()
    assert floor < saved_only
    plan = prep.plan((floor + saved_only) // 2, "cpsat").plan
    assert plan.status == "FALLBACK:leanest" and plan.fits and plan.lower_bound_us is None
    assert any(isinstance(d, Offload) and prep.problem.is_backward(prep.problem.storage(d.tensor).producer)
               for d in plan.decisions)


def test_where_the_step_as_written_peaks_below_every_plan_it_is_the_floor():
    """Under Inductor the step as written is min-cut's partition, which may hold less than every plan of the
    partition planned (it recomputes what the default partition saves). Then it is the smallest budget known to
    work: planned there it runs as written, and a byte less is refused naming it and saying what it is."""
    from karma_fx.inductor import KeepExcess

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    prep = karma_fx.prepare(model, (torch.randn(32, 64),), compiler="inductor")
    leanest = prep.min_peak_bytes()
    # an excess large enough to put the step as written under the leanest plan, in both phases
    prep.keep_all_excess = KeepExcess(forward=-prep.keep.peak_bytes, backward=leanest - prep.keep.peak_bytes - 1,
                                      saved=0)
    floor = prep.min_peak_bytes()
    assert floor == prep.unplanned_peak_bytes == leanest - 1 and prep.floor_as_written()
    planned = prep.plan(floor).plan
    assert planned.status == "KEEP" and not planned.decisions and planned.peak_bytes == floor
    with pytest.raises(InfeasibleBudgetError) as exc:
        prep.plan(floor - 1)
    assert exc.value.min_budget_bytes == floor and "the step as written" in str(exc.value)
    # a strategy named plans the partition planned, never the step as written: its floor is the leanest plan's
    with pytest.raises(InfeasibleBudgetError) as exc:
        prep.plan(floor - 1, "greedy")
    assert exc.value.min_budget_bytes == leanest and "the step as written" not in str(exc.value)
