"""``karma_fx.plan``: capture → liveness → cost model → strategy → simulate, top to bottom.

``plan_step`` returns every intermediate (the problem, costs, the timeline) for tools that draw or compare;
``plan`` returns just the ``Plan``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from karma_fx.budget import format_bytes, parse_budget
from karma_fx.costs import Costs, estimate_costs
from karma_fx.device import DeviceSpec, get_device
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.passes.capture import CapturedStep, capture
from karma_fx.passes.liveness import build_problem
from karma_fx.plan import Plan
from karma_fx.problem import Problem
from karma_fx.simulate import Timeline, simulate
from karma_fx.strategies import DEFAULT_STRATEGY, Strategy, make_strategy
from karma_fx.strategies.base import leanest_peak


@dataclass
class Planned:
    """A plan with everything it was made from."""

    plan: Plan
    problem: Problem
    costs: Costs
    timeline: Timeline
    step: CapturedStep | None = None
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Prepared:
    """A captured, analysed step, ready to be planned at any budget with any strategy."""

    problem: Problem
    costs: Costs
    keep: Timeline
    step: CapturedStep | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    _min_peak: int | None = None
    _torch_saved: dict[float, frozenset[str]] = field(default_factory=dict)

    @property
    def unplanned_peak_bytes(self) -> int:
        return self.keep.peak_bytes

    def min_peak_bytes(self) -> int:
        """The lowest peak any plan here reaches: every saved activation swapped out synchronously right after
        its last forward read and fetched back just in time."""
        if self._min_peak is None:
            self._min_peak = leanest_peak(self.problem, self.costs)
        return self._min_peak

    def strategy(self, strategy: str | Strategy | None, *, offload_weights: bool = False) -> Strategy:
        """The strategy to plan with: by name (``torch-budget`` gets PyTorch's saved-set oracle
        for the captured graph, cached per fraction) or as given; wrapped in ``WeightsOutOfCore`` when
        ``offload_weights``."""
        if offload_weights:
            from karma_fx.strategies.weights import WeightsOutOfCore

            return WeightsOutOfCore(self.strategy(strategy))
        if strategy is None:
            strategy = DEFAULT_STRATEGY
        if not isinstance(strategy, str):
            return strategy
        if strategy != "torch-budget" or self.step is None:
            return make_strategy(strategy)
        from karma_fx.passes.torch_partition import saved_storages

        step, problem, cache = self.step, self.problem, self._torch_saved

        def saved_set(fraction: float) -> frozenset[str]:
            if fraction not in cache:
                cache[fraction] = saved_storages(step, problem, fraction)
            return cache[fraction]
        return make_strategy(strategy, saved_set)

    def plan(self, budget: str | int | float, strategy: str | Strategy | None = None, *,
             raise_if_infeasible: bool = True, offload_weights: bool = False) -> Planned:
        """Plan at ``budget``; ``offload_weights`` streams the parameters from host memory and sends their
        gradients to it (``karma_fx.strategies.weights``), for steps whose weights do not fit."""
        budget_bytes = parse_budget(budget, self.unplanned_peak_bytes)
        chosen = self.strategy(strategy, offload_weights=offload_weights)
        t0 = time.perf_counter()
        raw = chosen(self.problem, self.costs, budget_bytes)
        solve_s = time.perf_counter() - t0
        timeline = simulate(self.problem, raw, self.costs)
        plan = finalize(raw, self.problem, self.costs, timeline, self.keep, device=self.costs.device)
        if raise_if_infeasible and not plan.fits:
            floor = (leanest_peak(self.problem, self.costs, stream_weights=True) if offload_weights
                     else self.min_peak_bytes())
            raise InfeasibleBudgetError(
                f"strategy {plan.strategy!r} cannot fit {self.problem.name} in {format_bytes(budget_bytes)}: its "
                f"best plan peaks at {format_bytes(plan.peak_bytes)}. The smallest budget known to work is "
                f"{format_bytes(floor)} ({floor} bytes: every saved activation swapped out and back just in time, "
                f"which strategy='cpsat' can reach); the unplanned peak is {format_bytes(self.unplanned_peak_bytes)}.",
                min_budget_bytes=floor, budget_bytes=budget_bytes)
        return Planned(plan=plan, problem=self.problem, costs=self.costs, timeline=timeline, step=self.step,
                       seconds={**self.seconds, "strategy": solve_s})


def finalize(plan: Plan, problem: Problem, costs: Costs, timeline: Timeline, keep: Timeline, *, device: str) -> Plan:
    """Attach the simulator's verdict to a strategy's plan."""
    return plan.replace(model=problem.name, device=device, peak_bytes=timeline.peak_bytes,
                        step_time_us=round(timeline.makespan_us, 3),
                        unlimited_step_time_us=round(keep.makespan_us, 3),
                        unplanned_peak_bytes=keep.peak_bytes, host_peak_bytes=timeline.host_peak_bytes,
                        schedule=timeline.rows)


def prepare(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None, *,
            device: str | DeviceSpec | None = None, name: str | None = None) -> Prepared:
    """Capture the training step and build everything a strategy needs."""
    spec = get_device(device)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    step = capture(model, args if isinstance(args, tuple) else (args,), kwargs)
    t1 = time.perf_counter()
    problem = build_problem(step, name=name or type(model).__name__)
    t2 = time.perf_counter()
    costs = estimate_costs(problem, spec)
    keep = simulate(problem, (), costs)
    t3 = time.perf_counter()
    seconds.update(capture=t1 - t0, liveness=t2 - t1, costs=t3 - t2)
    return Prepared(problem=problem, costs=costs, keep=keep, step=step, seconds=seconds)


def plan(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None, *, budget: str | int | float,
         device: str | DeviceSpec | None = None, strategy: str | Strategy | None = None,
         offload_weights: bool = False) -> Plan:
    """Plan one training step of ``model(*args, **kwargs)`` under ``budget`` (bytes or a fraction).

    The model may live on the ``meta`` device: it is traced on fake tensors and no weights are read.
    ``offload_weights`` streams the weights from host memory (see ``Prepared.plan``).
    Raises ``InfeasibleBudgetError`` (naming the smallest workable budget) when the strategy cannot fit.
    """
    parse_budget(budget, unplanned_peak_bytes=1 << 62)  # reject nonsense before the (slow) capture
    prepared = prepare(model, args, kwargs, device=device)
    return prepared.plan(budget, strategy, offload_weights=offload_weights).plan
