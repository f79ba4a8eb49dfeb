"""Weights out of core: parameters live in host memory and stream through the device; gradients leave at once.

KARMA's answer to models whose weights alone do not fit: each parameter is copied to the device before its
first forward use and dropped after its last, copied again for its backward uses (including the recompute
chains that read it), and each gradient is copied to the host as soon as backward produces it. The copy for
a window is issued when the window before it in execution order starts (one layer ahead), so it hides behind
that layer's compute when the link allows.

``WeightsOutOfCore(inner)`` wraps any activation strategy: the inner strategy plans the activations as if
weights and gradients took no device memory, under the budget less a reserve for the weights in flight; the
streams are then laid around its plan, the whole is simulated, and the reserve grows by what the step still
exceeds until it fits (a few rounds). Activation decisions and weight streams are judged together by the one
simulator.
"""
from __future__ import annotations

from dataclasses import replace

from karma_fx.costs import Costs
from karma_fx.plan import Decision, GradToHost, Plan, Recompute, StreamWeight, Window
from karma_fx.problem import Problem
from karma_fx.simulate import simulate
from karma_fx.strategies.base import Strategy
from karma_fx.wire import host_casts, host_upcasts, hosted, hosted_problem

MAX_GAP_OPS = 16
"""Uses of a parameter further apart than this (in ops) get separate windows: a weight read at both ends of
the forward (a tied embedding) is not held in between."""


def weight_streams(problem: Problem, decisions: tuple[Decision, ...] = (), max_gap: int = MAX_GAP_OPS
                   ) -> tuple[Decision, ...]:
    """Stream every used parameter and send every parameter gradient to the host, around ``decisions``
    (recompute chains that read a parameter extend its backward window to where they run). A parameter the
    step reads only through a cast to bf16 (autocast's copy) streams as that cast, made on the host
    (``karma_fx.wire``; casts ``decisions`` already move are left as they are); a weight left with no reader
    on the device stays on the host (a stream with no window). A gradient the step widens from a narrower one
    is sent narrow and widened on the host."""
    named = {t for d in decisions for t in (d.tensors if isinstance(d, Recompute) else (d.tensor,))}
    original = problem
    problem = hosted_problem(problem, frozenset(c for c in host_casts(problem) if c not in named),
                             frozenset(g for g in host_upcasts(problem) if g not in named))
    op_index = problem.op_index
    uses: dict[str, set[int]] = {s.name: set(s.users) for s in problem.storages if s.kind == "param" and s.users}
    for d in decisions:
        if isinstance(d, Recompute):
            at = op_index(d.reload_before)
            for name in d.ops:
                for s in problem.ops[op_index(name)].inputs:
                    if s in uses:
                        uses[s].add(at)
    runs: list[tuple[int, int, str]] = []  # (first use, last use, parameter)
    for name, at in uses.items():
        ordered = sorted(at)
        start = prev = ordered[0]
        for u in ordered[1:]:
            crosses = (prev < problem.num_fwd_ops) != (u < problem.num_fwd_ops)
            if u - prev > max_gap or crosses:
                runs.append((start, prev, name))
                start = u
            prev = u
        runs.append((start, prev, name))
    runs.sort()
    windows: dict[str, list[Window]] = {}
    last_free: dict[str, int] = {}
    previous_first = current_first = 0
    for first, last, name in runs:
        if first != current_first:  # a new layer's weights: issue them when the previous layer starts
            previous_first, current_first = current_first, first
        issue = max(min(previous_first, first), last_free.get(name, -1) + 1)
        windows.setdefault(name, []).append(Window(problem.ops[issue].name, problem.ops[first].name,
                                                   problem.ops[last].name))
        last_free[name] = last
    streams: list[Decision] = [StreamWeight(name, tuple(ws)) for name, ws in windows.items()]
    streams += [StreamWeight(s.name, ()) for s, before in zip(problem.storages, original.storages)
                if s.kind == "param" and before.kind == "param" and not s.users and before.users]
    streams += [GradToHost(s.name) for s in problem.storages
                if s.kind == "gradient" and s.is_output and s.producer is not None]
    return tuple(streams)


def without_weights(problem: Problem) -> Problem:
    """The same step with parameters and their gradients weighing nothing: what the inner strategy plans."""
    storages = tuple(replace(s, size_bytes=0) if s.kind == "param" or (s.kind == "gradient" and s.is_output)
                     else s for s in problem.storages)
    return Problem(ops=problem.ops, storages=storages, num_fwd_ops=problem.num_fwd_ops,
                   cut_points=problem.cut_points, aliases=problem.aliases, name=problem.name)


class WeightsOutOfCore:
    """``inner``'s activation plan with every weight streamed from the host (see the module docstring)."""

    def __init__(self, inner: Strategy, rounds: int = 4) -> None:
        self.inner = inner
        self.rounds = rounds
        self.name = inner.name

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        # The inner strategy sees the step as it runs: bf16 casts of weights made on the host (karma_fx.wire).
        on_host, on_host_costs = hosted(problem, costs)
        light = without_weights(on_host)
        reserve = max(0, simulate(problem, weight_streams(problem), costs).peak_bytes
                      - simulate(light, (), on_host_costs).peak_bytes)
        best: tuple[tuple[int, float], Plan] | None = None
        for _ in range(self.rounds):
            inner = self.inner(light, on_host_costs, max(1, budget_bytes - reserve))
            decisions = tuple(inner.decisions) + weight_streams(problem, tuple(inner.decisions))
            timeline = simulate(problem, decisions, costs)
            fits = timeline.peak_bytes <= budget_bytes
            key = (0 if fits else 1, timeline.makespan_us if fits else float(timeline.peak_bytes))
            # The inner plan's lower bound covers activation plans of the lighter step only: not this one.
            plan = replace(inner, budget_bytes=budget_bytes, decisions=decisions, lower_bound_us=None,
                           notes=tuple(inner.notes) + ("weights streamed from the host, gradients sent to it",))
            if best is None or key < best[0]:
                best = (key, plan)
            if fits:
                break
            reserve += timeline.peak_bytes - budget_bytes
        assert best is not None
        plan = best[1]
        if best[0][0] == 0 and plan.status == "INFEASIBLE":
            # The inner strategy judged the lighter step at a reserve that proved pessimistic; the whole plan fits.
            plan = replace(plan, status="HEURISTIC", notes=tuple(n for n in plan.notes if "no plan fits" not in n))
        return plan


class BestOf:
    """The fastest plan that fits among several strategies (the lowest peak if none fits), each judged by the
    simulator; named after the first, with ``FALLBACK:<name>`` as status when another one wins."""

    def __init__(self, strategies: list[Strategy]) -> None:
        self.strategies = strategies
        self.name = strategies[0].name

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        best: tuple[tuple[int, float], Plan] | None = None
        for i, strategy in enumerate(self.strategies):
            plan = strategy(problem, costs, budget_bytes)
            timeline = simulate(problem, plan.decisions, costs)
            fits = timeline.peak_bytes <= budget_bytes
            key = (0 if fits else 1, timeline.makespan_us if fits else float(timeline.peak_bytes))
            if i:
                plan = replace(plan, strategy=self.name, status=f"FALLBACK:{strategy.name}")
            if best is None or key < best[0]:
                best = (key, plan)
        assert best is not None
        return best[1]

