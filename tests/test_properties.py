"""Property tests on random layered training steps: every strategy's plan is valid and honestly judged."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from karma_fx.plan import Recompute
from karma_fx.simulate import simulate
from karma_fx.strategies import CpSat, SolverOptions, make_strategy
from karma_fx.strategies.base import offload_for, saved_gaps
from karma_fx.strategies.cpsat.bound import lower_bound_us

from helpers import random_costs, random_problem

HEURISTICS = ("checkpoint", "offload", "karma", "greedy")


@st.composite
def steps(draw):
    n = draw(st.integers(3, 8))
    sizes = draw(st.lists(st.integers(100, 5000), min_size=n, max_size=n))
    skips = draw(st.lists(st.integers(-1, n), min_size=n, max_size=n))
    times = draw(st.lists(st.floats(1.0, 50.0), min_size=3, max_size=6))
    bw = draw(st.floats(20.0, 2000.0))
    problem = random_problem(n, sizes, skips, times)
    return problem, random_costs(problem, times, bw), draw(st.floats(0.0, 1.0))


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def budget_between(problem, costs, fraction):
    keep = simulate(problem, (), costs).peak_bytes
    lowest = simulate(problem, [offload_for(problem, g, release=True) for g in saved_gaps(problem)], costs).peak_bytes
    return lowest + int(fraction * (keep - lowest)), keep, lowest


@SETTINGS
@given(steps())
def test_every_plan_is_valid_and_never_beats_the_unlimited_step(step):
    problem, costs, fraction = step
    budget, keep, lowest = budget_between(problem, costs, fraction)
    assert lowest <= keep
    unlimited = sum(costs.op_time_us)
    for name in HEURISTICS:
        plan = make_strategy(name)(problem, costs, budget)
        tl = simulate(problem, plan, costs)  # raises InvalidPlanError on any inconsistency
        assert tl.makespan_us >= unlimited - 1e-6
        for d in plan.decisions:
            if isinstance(d, Recompute):
                assert all(problem.ops[problem.op_index(o)].recomputable for o in d.ops)


@SETTINGS
@given(steps())
def test_unlimited_budget_moves_nothing(step):
    problem, costs, _ = step
    keep = simulate(problem, (), costs).peak_bytes
    for strategy in (make_strategy("karma"), CpSat(options=SolverOptions(time_limit_s=2, memory_unit_bytes=1))):
        assert strategy(problem, costs, keep).decisions == ()


@SETTINGS
@given(steps())
def test_cpsat_fits_and_is_never_worse_than_a_heuristic(step):
    problem, costs, fraction = step
    budget, _, _ = budget_between(problem, costs, fraction)
    heuristics = [make_strategy(h) for h in HEURISTICS]
    plan = CpSat(heuristics, SolverOptions(time_limit_s=2, memory_unit_bytes=1))(problem, costs, budget)
    tl = simulate(problem, plan, costs)
    assert tl.peak_bytes <= budget, plan.notes
    if plan.predicted_step_time_us is not None:  # the solver's own plan: its time model is the simulator's
        assert plan.predicted_step_time_us == pytest.approx(tl.makespan_us, rel=0.01)
    for h in heuristics:
        other = simulate(problem, h(problem, costs, budget), costs)
        if other.peak_bytes <= budget:
            assert tl.makespan_us <= other.makespan_us + 1e-6


@SETTINGS
@given(steps())
def test_lp_bound_holds_for_every_plan_that_fits(step):
    """The LP relaxes every executable plan: no strategy's simulated step beats it, and it never calls a
    budget infeasible that a plan fits."""
    problem, costs, fraction = step
    budget, _, _ = budget_between(problem, costs, fraction)
    base = [b for _, b in simulate(problem, (), costs).memory]
    bound = lower_bound_us(problem, costs, budget, base)
    assert bound is not None
    assert bound >= sum(costs.op_time_us) * (1 - 1e-9)
    lean = [offload_for(problem, g, release=True) for g in saved_gaps(problem)]
    plans = [make_strategy(h)(problem, costs, budget).decisions for h in HEURISTICS] + [lean]
    for decisions in plans:
        tl = simulate(problem, decisions, costs)
        if tl.peak_bytes <= budget:
            assert tl.makespan_us >= bound * (1 - 1e-9)


@SETTINGS
@given(steps())
def test_cpsat_step_time_never_falls_as_the_budget_shrinks(step):
    """A tighter budget never yields a faster simulated step, beyond the 1% cpsat may leave on the table:
    it stops searching once a plan is within ``good_enough_gap`` of the LP bound, and a plan it then finds
    at a tighter budget (seen once in a throwaway sweep of 320 budget pairs: 482.0 against 483.9 µs) also
    fits the looser one. Not true by construction beyond that (each model and heuristic is a search of its
    own), so it is checked."""
    problem, costs, _ = step
    options = SolverOptions(time_limit_s=2, memory_unit_bytes=1)
    planner = CpSat([make_strategy(h) for h in HEURISTICS], options)
    times = []
    for fraction in (0.9, 0.6, 0.3, 0.0):
        budget, _, _ = budget_between(problem, costs, fraction)
        times.append(simulate(problem, planner(problem, costs, budget), costs).makespan_us)
    slack = 1 + options.good_enough_gap
    assert all(later * slack >= earlier - 1e-6 for earlier, later in zip(times, times[1:])), times
