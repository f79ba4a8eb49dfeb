"""The capacity model: the exact planner's first phase, all linear so its LP bound is tight.

Same decisions and the same exact memory accounting as ``exact.Model``, but time is tracked only at a few
sync points, and each copy stream is a preemptive capacity: for every pair of sync points (a, q), the copies
that become ready at or after a and are due by q must fit in the time between them (compute, recomputes and
stalls). That is a necessary condition for any copy schedule and close to sufficient when the runtime issues
copies earliest-deadline-first (a probe of CP-SAT formulations found this all-linear shape the one whose
bound stays tight: 1.091 against a 1.093 plan). It picks the decisions; the exact
FIFO model and the simulator then time them.
"""
from __future__ import annotations

from typing import Sequence

from karma_fx.costs import Costs
from karma_fx.problem import Problem
from karma_fx.strategies.cpsat.choice import Choice
from karma_fx.strategies.cpsat.model import (Candidate, add_decisions_and_memory, chain_time,
                                             deterministic_solver, time_scale)
from karma_fx.strategies.cpsat.segments import segments_of


def spread_evenly(points: list[int], count: int) -> list[int]:
    """At most ``count`` of the sorted ``points``, evenly spaced, first and last included."""
    if len(points) <= count:
        return points
    step = (len(points) - 1) / (count - 1)
    return sorted({points[round(k * step)] for k in range(count)})


def solve_capacity(problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int],
                   cands: list[Candidate], *, time_limit_s: float, workers: int, seed: int,
                   sync_points: int = 24, unit: int = 1,
                   gap_us: float = 0.0) -> tuple[dict[str, Choice], float, str] | None:
    """Decisions minimising recompute time, copy-induced stalls and the copy ops' compute time
    (``Costs.copy_issue_us``) under the capacity model, the model's lower bound on the step time (µs), and the
    CP-SAT status; ``None`` if no solution was found.

    The search stops once its incumbent is within ``gap_us`` of the model's own bound: proving the last
    fraction of a percent took 7 of the 9 s resnet1001 tiny spent planning at 0.7 (the exact pass re-times the
    decisions anyway). The gap is measured against this model's bound, never the LP's: the model relaxes
    timing differently, and a floor from outside would make it indifferent among decisions it rates below
    the floor. The status is then FEASIBLE, not OPTIMAL (CP-SAT calls a closed gap limit optimal)."""
    from ortools.sat.python import cp_model

    n, nf = len(problem.ops), problem.num_fwd_ops
    m = cp_model.CpModel()
    scale = time_scale(problem, costs)
    t = lambda us: int(round(us * scale))  # noqa: E731
    dv = add_decisions_and_memory(m, problem, cands, base_bytes, budget_bytes, unit,
                                  allow_offload=costs.allow_offload)
    rec, rel, pre = dv.rec, dv.rel, dv.pre

    # Time at sync points: compute prefix + recomputes before it + cumulative stall.
    fwd_sync = spread_evenly(sorted({0, nf} | {c.producer + 1 for c in cands} | {r for c in cands for r in c.releases}),
                     sync_points)
    bwd_sync = spread_evenly(sorted({nf, n} | {p for c in cands for p in c.prefetches} | {c.first_bwd for c in cands}),
                     sync_points)
    sync = sorted(set(fwd_sync) | set(bwd_sync))
    prefix = [0]
    for x in costs.op_time_us:
        prefix.append(prefix[-1] + t(x))
    segs = [seg for seg in segments_of(cands) if seg.index in dv.seg]
    swap_issue = 2 * t(costs.copy_issue_us)  # a swap's two copy ops on the compute thread, as in ``exact``
    horizon = prefix[-1] + sum(t(costs.copy_time_us(c.size, "d2h")) + t(costs.copy_time_us(c.size, "h2d"))
                               + t(chain_time(problem, costs, c)) + swap_issue for c in cands) \
        + sum(t(chain_time(problem, costs, seg)) for seg in segs) + 1
    stall = {k: m.NewIntVar(0, horizon, "") for k in sync}
    for a, b in zip(sync, sync[1:]):
        m.Add(stall[a] <= stall[b])
    m.Add(stall[sync[0]] == 0)

    def time_at(k: int):
        recs = [t(chain_time(problem, costs, c)) * rec[c.name] for c in cands if c.name in rec and c.first_bwd < k]
        recs += [t(chain_time(problem, costs, seg)) * dv.seg[seg.index] for seg in segs if seg.anchor < k]
        if swap_issue:
            recs += [swap_issue * dv.off[c.name] for c in cands if c.producer < k]
        return prefix[k] + sum(recs) + stall[k]

    times = {k: time_at(k) for k in sync}
    d2h = {c.name: t(costs.copy_time_us(c.size, "d2h")) for c in cands}
    h2d = {c.name: t(costs.copy_time_us(c.size, "h2d")) for c in cands}
    for phase in (fwd_sync, bwd_sync):
        for ia, a in enumerate(phase):
            for q in phase[ia + 1:]:
                out_terms = [d2h[c.name] * v for c in cands if c.producer + 1 >= a
                             for r, v in rel[c.name].items() if r <= q]
                in_terms = [h2d[c.name] * v for c in cands if c.first_bwd <= q
                            for p, v in pre[c.name].items() if p >= a]
                if out_terms:
                    m.Add(sum(out_terms) <= times[q] - times[a])
                if in_terms:
                    m.Add(sum(in_terms) <= times[q] - times[a])
    total_rec = sum(t(chain_time(problem, costs, c)) * rec[c.name] for c in cands if c.name in rec) \
        + sum(t(chain_time(problem, costs, seg)) * dv.seg[seg.index] for seg in segs)
    issue = sum(swap_issue * dv.off[c.name] for c in cands) if swap_issue else 0
    m.Minimize(total_rec + issue + stall[sync[-1]])

    solver = deterministic_solver(time_limit_s, workers, seed)
    solver.parameters.absolute_gap_limit = max(0.0, gap_us * scale)
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choices = dv.read(cands, solver.Value)
    bound_us = (prefix[-1] + solver.BestObjectiveBound()) / scale
    closed = status == cp_model.OPTIMAL and solver.ObjectiveValue() <= solver.BestObjectiveBound() + 0.5
    return choices, bound_us, "OPTIMAL" if closed else "FEASIBLE"
