"""Every strategy on real (tiny) captured models: valid plans, honest verdicts, clear errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import karma_fx
from karma_fx.errors import BudgetError, InfeasibleBudgetError, UnsupportedModelError
from karma_fx.plan import Offload, Recompute
from karma_fx.simulate import simulate
from karma_fx.strategies import STRATEGY_NAMES

from conftest import prepared

MODELS = ("mlp", "cnn", "gpt2", "resnet50", "megatron_gpt", "bert")


def midway(prep) -> int:
    """A budget between the lowest reachable peak and the unplanned one."""
    return (prep.min_peak_bytes() + prep.unplanned_peak_bytes) // 2


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_plans_are_valid_and_judged_by_the_simulator(name, strategy):
    prep = prepared(name)
    budget = midway(prep)
    planned = prep.plan(budget, strategy, raise_if_infeasible=False)
    plan = planned.plan
    # The verdict attached to the plan is the simulator's, recomputed here from scratch.
    again = simulate(prep.problem, plan, prep.costs)
    assert plan.peak_bytes == again.peak_bytes and plan.step_time_us == pytest.approx(again.makespan_us, abs=1e-3)
    assert plan.unlimited_step_time_us == pytest.approx(sum(prep.costs.op_time_us), abs=1e-3)
    assert plan.step_time_us >= plan.unlimited_step_time_us - 1e-6
    assert plan.fits == (plan.peak_bytes <= budget)
    saved = {s.name for s in prep.problem.saved_activations()}
    movable = {s.name for s in prep.problem.storages if s.producer is not None and not s.lives_to_end}
    for d in plan.decisions:
        tensors = d.tensors if isinstance(d, Recompute) else (d.tensor,)
        # general rematerialization moves any tensor the step makes and frees; the others saved activations only
        assert set(tensors) <= (movable if strategy == "remat" else saved)
        if isinstance(d, Recompute):
            assert all(prep.problem.ops[prep.problem.op_index(o)].recomputable for o in d.ops)
    if strategy == "keep":
        assert plan.decisions == () and plan.peak_bytes == prep.unplanned_peak_bytes
    if strategy == "offload":
        assert {d.tensor for d in plan.decisions} == saved and all(isinstance(d, Offload) for d in plan.decisions)
    if strategy == "checkpoint":
        assert all(isinstance(d, Recompute) for d in plan.decisions)


@pytest.mark.parametrize("name", MODELS)
def test_karma_fits_a_midway_budget_and_moves_nothing_when_everything_fits(name):
    prep = prepared(name)
    for strategy in ("karma", "checkpoint", "torch-budget", "cpsat"):  # an unlimited budget moves nothing
        unlimited = prep.plan(1.0, strategy).plan
        assert unlimited.decisions == (), strategy
        assert unlimited.step_time_us == pytest.approx(unlimited.unlimited_step_time_us, abs=1e-3)
    if prep.min_peak_bytes() < prep.unplanned_peak_bytes:
        try:
            plan = prep.plan(midway(prep), "karma").plan
        except InfeasibleBudgetError as exc:
            assert exc.min_budget_bytes == prep.min_peak_bytes()
        else:
            assert plan.peak_bytes <= plan.budget_bytes and plan.decisions


def test_lowest_reachable_peak_is_a_real_plan():
    prep = prepared("gpt2")
    assert prep.min_peak_bytes() < prep.unplanned_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        prep.plan(prep.min_peak_bytes() - 1, "karma")
    assert info.value.min_budget_bytes == prep.min_peak_bytes()
    assert str(prep.min_peak_bytes()) in str(info.value)


def test_plan_entry_point_and_bad_input():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    plan = karma_fx.plan(model, (x,), budget=1.0, strategy="keep")
    assert plan.strategy == "keep" and plan.status == "KEEP" and plan.peak_bytes > 0
    assert "keep" in plan.table()
    with pytest.raises(BudgetError):
        karma_fx.plan(model, (x,), budget="-3")
    with pytest.raises(UnsupportedModelError):
        karma_fx.plan(lambda t: t, (x,), budget=0.5)

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, t):
            return self.lin(t[t > 0].reshape(-1, 16)) if t.sum().item() > 0 else self.lin(t)

    with pytest.raises(UnsupportedModelError, match="capture"):
        karma_fx.plan(DataDependent(), (x,), budget=0.5)
    with pytest.raises(karma_fx.KarmaError, match="unknown strategy"):
        karma_fx.plan(model, (x,), budget=0.5, strategy="magic")


def test_meta_models_plan_without_memory():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192))
    x = torch.empty(4096, 8192, device="meta")
    plan = karma_fx.plan(model, (x,), budget=1.0, strategy="keep")
    assert plan.peak_bytes > 2 * 8192 * 8192 * 4  # weights and gradients of a 1 GiB-per-layer model, traced for free


def test_greedy_recomputes_when_copies_are_slow_and_drops_waits_the_budget_does_not_need():
    from karma_fx.strategies.greedy import Greedy, loosen_releases

    from helpers import chain_problem, flat_costs

    p = chain_problem()
    slow = flat_costs(p, bytes_per_us=10.0)  # 100 µs per copy of A, 10 µs to recompute it
    plan = Greedy()(p, slow, 3114)
    assert [type(d).__name__ for d in plan.decisions] == ["Recompute"]
    assert simulate(p, plan, slow).makespan_us == pytest.approx(70.0)  # the optimum (tests/test_cpsat.py)

    waiting = (Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1",
                       release_before="loss"),)
    loosened, dropped = loosen_releases(p, slow, 10_000, waiting)
    assert dropped == 1 and loosened[0].release_before is None
    assert simulate(p, loosened, slow).makespan_us < simulate(p, waiting, slow).makespan_us
    assert loosen_releases(p, slow, 3114, waiting) == (waiting, 0)  # there the wait is what makes it fit


def test_bounded_orders_let_each_chain_rebuild_at_most_a_neighbour_or_two():
    from karma_fx.strategies.base import RecomputeBuilder, saved_gaps
    from karma_fx.strategies.greedy import bounded_drops, rebuild_chain

    from helpers import random_costs, random_problem

    p = random_problem(6, [600, 500, 400, 300, 200, 100], [-1] * 6, [10.0])  # a plain chain a0 -> ... -> a5
    costs = random_costs(p, [10.0], 100.0)
    builder = RecomputeBuilder(p)
    gaps = saved_gaps(p)
    chains = {g.storage.name: rebuild_chain(p, costs, g, builder) for g in gaps}
    assert all(chains[g.storage.name][0] == 10.0 for g in gaps)  # each rebuilt alone by one 10 µs op
    cheap_first = sorted(gaps, key=lambda g: -g.storage.size_bytes)  # a0 first

    def taken(growth: float, away: set[str] = set()) -> list[str]:
        return [g.storage.name for g in bounded_drops(p, costs, builder, cheap_first, chains, away, growth)]

    # 1.5x: no chain may rebuild a dropped neighbour, so every other tensor goes.
    assert taken(1.5) == ["a0", "a2", "a4"]
    # 2.5x: a chain may rebuild one dropped neighbour (a1 from x via a0), not two.
    assert taken(2.5) == ["a0", "a1", "a3", "a4"]
    assert taken(100.0) == [f"a{i}" for i in range(6)]  # unbounded: the cheap-first order
    assert "a1" not in taken(2.5, away={"a1"})  # swapped tensors are not recomputed


def test_checkpointed_resnet_blocks_rebuild_from_their_own_input():
    """A ResNet block's residual add is read in the backward only through the next block's relu; keeping that
    relu's output keeps every recompute chain inside the block whose tensors it rebuilds."""
    from karma_fx.strategies.base import RecomputeBuilder, blocks_from_cuts
    from karma_fx.strategies.checkpoint import checkpoint_decisions

    prep = prepared("resnet50")
    problem = prep.problem
    blocks = blocks_from_cuts(problem, len(problem.cut_points))
    block_of = {i: b for b, (first, last) in enumerate(blocks) for i in range(first, last + 1)}
    decisions = checkpoint_decisions(problem, blocks, RecomputeBuilder(problem))
    assert decisions
    for d in decisions:
        home = {block_of[problem.storage(t).producer] for t in d.tensors}
        assert len(home) == 1
        assert {block_of[problem.op_index(o)] for o in d.ops} == home, d


def test_greedy_fetches_on_demand_where_the_copy_backlog_would_refill_the_device():
    """Near the floor the FIFO placement starts the prefetch backlog at the start of the backward, so every
    swapped tensor is back at once and nothing fits; fetched on demand (the step stalls for each copy) it fits."""
    from karma_fx.strategies.greedy import Greedy
    from karma_fx.strategies.leanest import leanest_peak

    prep = prepared("resnet50")
    floor = leanest_peak(prep.problem, prep.costs)
    budget = floor + (prep.unplanned_peak_bytes - floor) // 20
    plan = Greedy()(prep.problem, prep.costs, budget)
    again = simulate(prep.problem, plan, prep.costs)
    assert again.peak_bytes <= budget and "fetched on demand" in plan.notes[0]
    offloads = [d for d in plan.decisions if isinstance(d, Offload)]
    assert offloads and all(d.prefetch_at == d.reload_before for d in offloads)


@pytest.mark.parametrize("name, strategy", [("gpt2", "offload"), ("resnet50", "offload"), ("gpt2", "karma")])
def test_every_swap_out_is_waited_for_where_it_lands_at_no_cost(name, strategy):
    """A plan's offloads carry a ``release_before`` at the first op the replay starts after their copy landed
    (none only where it lands after the prefetch), added after the strategy without changing its replay."""
    from karma_fx.simulate import wait_where_copies_land

    prep = prepared(name)
    budget = midway(prep)
    raw = prep.strategy(strategy)(prep.problem, prep.costs, budget)
    plan = prep.plan(budget, strategy, raise_if_infeasible=False).plan
    assert plan.decisions == wait_where_copies_land(prep.problem, raw, prep.costs)
    before, after = simulate(prep.problem, raw, prep.costs), simulate(prep.problem, plan, prep.costs)
    assert (after.peak_bytes, after.makespan_us, after.memory, after.rows) == \
        (before.peak_bytes, before.makespan_us, before.memory, before.rows)
    starts = {i.label: i.start_us for i in after.compute if i.kind == "op"}
    landed = {i.label: i.end_us for i in after.d2h}
    names = [op.name for op in prep.problem.ops]
    offloads = [d for d in plan.decisions if isinstance(d, Offload)]
    assert offloads
    for d in offloads:
        if d.release_before is None:
            assert landed[d.tensor] > starts[d.prefetch_at]
        else:
            assert landed[d.tensor] <= starts[d.release_before] + 1e-6
            earlier = names[names.index(d.release_before) - 1]
            assert names.index(earlier) <= names.index(d.free_after) or landed[d.tensor] > starts[earlier]


def test_a_swap_that_a_recompute_chain_reads_is_fetched_for_that_chain_not_at_it():
    """Greedy places each prefetch to end before the tensor is read: where a recompute chain reads a swapped
    tensor before its own first backward read, before the chain. Placed for the later read, the copy was
    issued at the chain itself and the step waited for all of it (Llama, bf16, at 0.35: every layer)."""
    from helpers import random_costs, random_problem

    from karma_fx.plan import Recompute
    from karma_fx.simulate import simulate
    from karma_fx.strategies.base import read_by_chains, reconcile, saved_gaps
    from karma_fx.strategies.greedy import just_in_time

    problem = random_problem(6, [150] * 6, [-1] * 6, [10.0])
    costs = random_costs(problem, [10.0], bytes_per_us=10.0)  # a0's copy takes 16 µs: more than an op
    start = costs.op_starts_us()
    a0 = next(g for g in saved_gaps(problem) if g.storage.name == "a0")
    rebuild_a1 = Recompute(tensors=("a1",), ops=("f1",), reload_before="g2")  # reads a0 at g2, before g1
    due = read_by_chains(problem, [rebuild_a1])
    assert due["a0"] == problem.op_index("g2") < a0.first_bwd_use

    stalls = {}
    for label, placed in (("for its own read", just_in_time(problem, costs, [a0], start)),
                          ("for the chain", just_in_time(problem, costs, [a0], start, due=due))):
        decisions = reconcile(problem, placed + [rebuild_a1])
        swap = next(d for d in decisions if getattr(d, "tensor", None) == "a0")
        assert swap.reload_before == "g2"
        stalls[label] = simulate(problem, decisions, costs).stall_us
        if label == "for the chain":
            assert start[problem.op_index(swap.prefetch_at)] <= start[problem.op_index("g2")] - 16.0
    assert stalls["for its own read"] > 0 and stalls["for the chain"] == 0


def test_greedy_swaps_only_what_the_copy_streams_can_hide():
    """Seven equal tensors produced one per 10 µs, each copy 26 µs each way: the copy-out queue falls behind
    the forward, and the copies back of the first-read tensors come faster than the stream carries them. All
    seven swapped, the step stalls; ``lands_in_time`` keeps the three whose copies hide, which stall nothing
    and free the same bytes at the peak."""
    from helpers import random_costs, random_problem

    from karma_fx.strategies.base import reconcile, saved_gaps
    from karma_fx.strategies.greedy import just_in_time, lands_in_time

    problem = random_problem(8, [300] * 8, [-1] * 8, [10.0])
    costs = random_costs(problem, [10.0], bytes_per_us=12.0)
    start = costs.op_starts_us()
    gaps = [g for g in saved_gaps(problem) if g.last_fwd_use + 1 < g.first_bwd_use]
    kept = lands_in_time(costs, gaps, start, start[problem.num_fwd_ops])
    assert [g.storage.name for g in kept] == ["a0", "a1", "a2"]
    every = simulate(problem, reconcile(problem, just_in_time(problem, costs, gaps, start)), costs)
    hidden = simulate(problem, reconcile(problem, just_in_time(problem, costs, kept, start)), costs)
    assert every.stall_us > 100 and hidden.stall_us == 0
    assert hidden.peak_bytes == every.peak_bytes < simulate(problem, (), costs).peak_bytes


def test_greedy_on_big_graphs_tries_the_likeliest_order_first_and_stops_at_a_worse_quota(monkeypatch):
    """Past ``LARGE_OPS`` a time limit often lets greedy judge only a few orders, so the search goes largest
    quota first, the orders in ``ORDERS_LARGE``'s sequence (a later quota starting with the order that has won
    so far), and stops at the first quota whose best plan is slower than the best so far."""
    from helpers import random_costs, random_problem

    from karma_fx.strategies import greedy

    problem = random_problem(16, [300] * 16, [-1] * 16, [10.0])  # copies hide: swapping beats recomputing
    costs = random_costs(problem, [10.0], bytes_per_us=60.0)
    monkeypatch.setattr(greedy, "LARGE_OPS", 0)
    tried: list[tuple[float, str, bool, float]] = []
    fit = greedy.Greedy._fit

    def recording(*args, **kwargs):
        found = fit(*args, **kwargs)
        label = found[3]
        quota = float(label.split(":")[0].removeprefix("quota "))
        order = label.split(", ")[1].removesuffix(" order")
        tried.append((quota, order, found[0], found[1][1]))
        return found

    monkeypatch.setattr(greedy.Greedy, "_fit", staticmethod(recording))
    budget = int(0.7 * simulate(problem, (), costs).peak_bytes)
    plan = greedy.Greedy()(problem, costs, budget)
    assert simulate(problem, plan, costs).peak_bytes <= budget
    quotas = list(dict.fromkeys(q for q, *_ in tried))
    assert quotas == list(greedy.QUOTAS_LARGE[:len(quotas)])
    first = [order for q, order, *_ in tried if q == quotas[0]]
    assert first == list(greedy.ORDERS_LARGE)
    inf = float("inf")
    best = min((t if fits else inf) for q, _, fits, t in tried if q == quotas[0])
    for q in quotas[1:]:
        here = [(order, t if fits else inf) for qq, order, fits, t in tried if qq == q]
        earlier = [(t, k, order) for k, (qq, order, fits, t) in enumerate(tried)
                   if fits and qq in quotas[:quotas.index(q)]]
        winner = min(earlier)[2]  # the first order to reach the best time
        assert here[0][0] == winner
        if here[0][1] > best:  # its try of the winning order did worse: no other order, no other quota
            assert len(here) == 1 and q == quotas[-1]
        elif min(t for _, t in here) > best:
            assert q == quotas[-1]
        best = min(best, *(t for _, t in here))
    # here quotas 2 and 1 tie, and quota 0 (recompute only) is slower at its first order: the search ends there
    assert quotas == [2.0, 1.0, 0.0] and [order for q, order, *_ in tried if q == 0.0] == ["bounded 2.5x"]
