"""The planning-speed mechanisms of issue 14 change how often and how much is simulated, never the verdicts:
figures-only replays equal full ones, the figures cache answers only for the same problem and costs, and the
block pass's capped copying stays within its trial budget and never returns a slower or overfull plan."""
from __future__ import annotations

import pytest

from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Offload
from karma_fx.simulate import peak_and_makespan, simulate
from karma_fx.strategies import make_strategy

from conftest import prepared


@pytest.mark.parametrize("name", ["gpt2", "resnet1001"])
def test_figures_only_replays_equal_full_replays(name):
    """Every strategy's plan at two budgets: ``peak_and_makespan`` is exactly the full timeline's figures."""
    from karma_fx.strategies.leanest import leanest_decisions

    prep = prepared(name)
    problem, costs = prep.problem, prep.costs
    plans = [(), leanest_decisions(problem, costs)]
    for fraction in (0.7, 0.4):
        budget = int(prep.unplanned_peak_bytes * fraction)
        plans += [make_strategy(s)(problem, costs, budget).decisions for s in ("greedy", "karma", "checkpoint")]
    for decisions in plans:
        tl = simulate(problem, decisions, costs)
        assert peak_and_makespan(problem, decisions, costs) == (tl.peak_bytes, tl.makespan_us)


def test_figures_only_replays_reject_what_full_replays_reject():
    from helpers import chain_problem, flat_costs

    p = chain_problem()
    bad = [Offload("A", "f0", "f0", "gw", "gw")]
    with pytest.raises(InvalidPlanError, match="not on the device"):
        peak_and_makespan(p, bad, flat_costs(p))


def test_the_figures_cache_answers_only_for_the_same_problem_and_costs():
    import dataclasses

    from karma_fx.strategies.base import figures_of
    from helpers import chain_problem, flat_costs

    p = chain_problem()
    costs = flat_costs(p)
    plan = (Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1"),)
    first = figures_of(p, costs, plan)
    assert figures_of(p, costs, list(plan)) == first == (simulate(p, plan, costs).peak_bytes,
                                                         simulate(p, plan, costs).makespan_us)
    slow = dataclasses.replace(costs, d2h_bytes_per_us=costs.d2h_bytes_per_us / 100)
    assert figures_of(p, slow, plan) == (simulate(p, plan, slow).peak_bytes, simulate(p, plan, slow).makespan_us)
    assert figures_of(p, slow, plan) != first


def _gpt(layers: int):
    import karma_fx
    from karma_fx.zoo import build

    model, args, kwargs = build("megatron_gpt", "tiny", layers=layers, vocab=32, hidden=64)
    return karma_fx.prepare(model, args, kwargs, device="h100", name=f"gpt{layers}")


def test_capped_copies_try_the_representative_first_and_stay_within_the_cap(monkeypatch):
    """With the cap below the full recursion, the block pass copies level by level: the representative alone
    first (one trial when that is no faster), at most ``MAX_COPY_TRIALS`` trials, every accepted copy fits
    and is faster than what it replaced."""
    from karma_fx.strategies.cpsat import repeat
    from karma_fx.strategies.cpsat.blocks import find_groups, touches
    from karma_fx.strategies.leanest import leanest_swaps

    prep = _gpt(4)
    problem, costs = prep.problem, prep.costs
    group = find_groups(problem)[0]
    rep = repeat.representative(group)
    trials = []
    real = repeat.figures_of
    monkeypatch.setattr(repeat, "figures_of", lambda *a: trials.append(1) or real(*a))
    monkeypatch.setattr(repeat, "MAX_COPY_TRIALS", 4)  # 4 blocks: the full recursion would take up to 7
    assert 2 * len(group.blocks) - 1 > repeat.MAX_COPY_TRIALS

    swapped = leanest_swaps(problem)
    start = simulate(problem, swapped, costs)
    # Copying the representative's own decisions changes nothing, so it is not faster: one trial, no copy.
    out = repeat.BlockResult(swapped, start.makespan_us)
    same = tuple(d for d in swapped if touches(problem, d, rep))
    assert repeat._copy_into(problem, costs, start.peak_bytes, group, same, out, list(group.blocks)) == 0
    assert len(trials) == 1 and out.decisions == swapped

    # Keeping the representative's tensors is faster; with a budget that fits one such block, not all.
    trials.clear()
    kept_rep = tuple(d for d in swapped if not touches(problem, d, rep))
    budget = simulate(problem, kept_rep, costs).peak_bytes
    out = repeat.BlockResult(swapped, start.makespan_us)
    copied = repeat._copy_into(problem, costs, budget, group, (), out, list(group.blocks))
    assert 1 <= copied < len(group.blocks) and len(trials) <= repeat.MAX_COPY_TRIALS
    tl = simulate(problem, out.decisions, costs)
    assert tl.peak_bytes <= budget and tl.makespan_us == out.step_us < start.makespan_us
