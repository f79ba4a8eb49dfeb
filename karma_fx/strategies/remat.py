"""``remat``: general rematerialization, recompute only. Any op's output may be dropped after one of its reads
and rebuilt just before a later one, on graphs with or without a backward (Checkmate's problem in full, where
the other strategies only drop a forward output between its last forward read and its first backward read).

Why a separate strategy: every other one, and the CP-SAT models of ``cpsat``, take their candidates from the
saved activations (``base.saved_gaps``), so a graph without a backward (Moccasin's random layered graphs)
offers them nothing to move, and a training graph's idle stretches inside the forward or the backward are
never used. The simulator already replays a ``Recompute`` before any op, a tensor dropped in several gaps,
and an input read by a rebuild kept alive until it: only the choice was missing.

A gap is a tensor and two ops between which nothing reads it (its producer or a read, then the next read).
Two passes, the faster plan that fits wins:

* greedy: while some op runs over the budget, the gaps open across such ops are ranked by bytes times the
  number of those ops per µs of rebuilding; the best few are replayed and the one that removes the most
  excess bytes (summed over the compute steps) per µs it adds is taken. Then every rebuild the plan can do
  without is dropped again, dearest first.
* exact: the CP-SAT model of ``cpsat.gaps`` over the same gaps, started from greedy's plan, its budget
  tightened by what the simulator finds over it (the model counts memory per op, not per rebuild step).

A rebuild re-runs the tensor's producer and reads its inputs before the op it serves; an input the plan has
dropped there is rebuilt too (``dependencies.recompute_ops``), any other is kept alive until then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import networkx as nx

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.dependencies import dependency_graph, recompute_ops
from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Decision, Plan, Recompute
from karma_fx.problem import Problem
from karma_fx.simulate import Timeline
from karma_fx.strategies.base import timeline_of

TRIED_PER_STEP = 8
"""Gaps replayed per greedy step, the best by their estimate: enough that the estimate's misses (a rebuild that
keeps its inputs alive, a peak that moves) are caught, few enough that 250-node graphs plan in a second."""
TIGHTENINGS = 4
"""Exact solves at most: the first at the budget, each next one at the budget less what the last plan's replay
found over it."""


@dataclass(frozen=True)
class IdleGap:
    """``tensor`` is not read between ``after`` (its producer or a read) and ``before`` (its next read)."""

    tensor: str
    size_bytes: int
    after: int
    before: int


def idle_gaps(problem: Problem) -> list[IdleGap]:
    """Every gap of at least one op between two touches of a tensor that can be dropped and rebuilt: made by a
    recomputable op, not an input or an output of the step."""
    gaps = []
    for s in problem.storages:
        if s.producer is None or s.lives_to_end or s.size_bytes <= 0 or not problem.ops[s.producer].recomputable:
            continue
        touches = [s.producer] + sorted(set(s.users))
        gaps += [IdleGap(s.name, s.size_bytes, a, b) for a, b in zip(touches, touches[1:]) if b - a > 1]
    return gaps


class _NotAway:
    """What a rebuild before an op may read: every tensor but those the plan has dropped across that op."""

    def __init__(self, away: set[str]) -> None:
        self.away = away

    def __contains__(self, name: object) -> bool:
        return name not in self.away


class Remat:
    name = "remat"
    recompute_only = True
    """``cpsat`` runs it as a fallback only without a host link: on a training graph with one, offloading and
    the saved-activation models do better, and remat's search over every gap costs seconds per thousand ops."""

    def __init__(self, *, exact: bool = True, max_steps: int = 400, time_limit_s: float | None = None) -> None:
        self.exact = exact
        self.max_steps = max_steps
        self.time_limit_s = time_limit_s

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        with progress.deadline(self.time_limit_s):
            return self._plan(problem, costs, budget_bytes)

    def _plan(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        keep = timeline_of(problem, costs, ())
        if keep.peak_bytes <= budget_bytes:
            return Plan(strategy=self.name, budget_bytes=budget_bytes, notes=("everything fits: nothing moves",))
        graph = dependency_graph(problem)
        gaps = idle_gaps(problem)
        taken, state, stopped = self._greedy(problem, costs, budget_bytes, keep, graph, gaps)
        best = (state, [d for _, d in taken], "greedy")
        notes: list[str] = [f"greedy: {len(taken)} gaps rebuilt, peak {state.peak_bytes} bytes"]
        if self.exact and not stopped and not progress.past_deadline():
            solved = self._exact(problem, costs, budget_bytes, keep, graph, gaps, [g for g, _ in taken], notes)
            if solved is not None and solved[0].peak_bytes <= budget_bytes and (
                    best[0].peak_bytes > budget_bytes or solved[0].makespan_us < best[0].makespan_us):
                best = (*solved, "exact")
        state, decisions, origin = best
        fits = state.peak_bytes <= budget_bytes
        if not fits and state.peak_bytes >= keep.peak_bytes:  # rebuilds that lower nothing are not a plan
            state, decisions = keep, []
        notes.append(f"{origin}'s plan: {len(decisions)} rebuilds"
                     + ("" if fits else ", the leanest found, above the budget"))
        if stopped:
            notes.append(progress.stopped_note())
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=tuple(decisions), notes=tuple(notes))

    # ---- greedy --------------------------------------------------------------------------------------------
    def _greedy(self, problem: Problem, costs: Costs, budget_bytes: int, keep: Timeline, graph: nx.DiGraph,
                gaps: list[IdleGap]) -> tuple[list[tuple[IdleGap, Recompute]], Timeline, bool]:
        taken: list[tuple[IdleGap, Recompute]] = []
        state, stopped = keep, False
        for _ in range(self.max_steps):
            over = _ops_over(problem, state, budget_bytes)
            if not over:
                break
            if taken and progress.past_deadline():
                stopped = True
                break
            used = {(g.tensor, g.after) for g, _ in taken}
            ranked = []
            for g in gaps:
                spans = sum(1 for p in over if g.after < p < g.before)
                if not spans or (g.tensor, g.after) in used:
                    continue
                decision = rebuild(problem, graph, g, [t for t, _ in taken])
                if decision is None:
                    continue
                work = sum(costs.rebuild_us(problem, problem.op_index(o)) for o in decision.ops)
                ranked.append((-(g.size_bytes * spans) / (work + 1e-3), g.tensor, g.after, g, decision))
            ranked.sort(key=lambda r: r[:3])
            excess = _excess(state, budget_bytes)
            best = None
            for *_, g, decision in ranked[:TRIED_PER_STEP]:
                tl = _replay(problem, costs, [d for _, d in taken] + [decision])
                if tl is None:
                    continue
                gain = excess - _excess(tl, budget_bytes)
                rate = gain / (tl.makespan_us - state.makespan_us + 1e-3)
                if gain > 0 and (best is None or rate > best[0]):
                    best = (rate, g, decision, tl)
            if best is None:
                break
            taken.append((best[1], best[2]))
            state = best[3]
        if state.peak_bytes <= budget_bytes:  # drop the rebuilds the plan can do without, dearest first
            for pair in sorted(taken, key=lambda p: -sum(costs.rebuild_us(problem, problem.op_index(o))
                                                         for o in p[1].ops)):
                trial = [p for p in taken if p is not pair]
                tl = _replay(problem, costs, [d for _, d in trial])
                if tl is not None and tl.peak_bytes <= budget_bytes:
                    taken, state = trial, tl
        return taken, state, stopped

    # ---- exact ---------------------------------------------------------------------------------------------
    def _exact(self, problem: Problem, costs: Costs, budget_bytes: int, keep: Timeline, graph: nx.DiGraph,
               gaps: list[IdleGap], start: list[IdleGap], notes: list[str]
               ) -> tuple[Timeline, list[Decision]] | None:
        from karma_fx.strategies.cpsat.gaps import solve_gaps

        base = [b for _, b in keep.memory]
        index = {g: k for k, g in enumerate(gaps)}
        hint = [index[g] for g in start if g in index]
        target, best = budget_bytes, None
        for _ in range(TIGHTENINGS):
            left = progress.seconds_left()
            t0 = time.perf_counter()
            result = solve_gaps(problem, costs, target, base, gaps, hint=hint,
                                time_limit_s=min(10.0, left if left is not None else 10.0))
            if result is None:
                notes.append(f"exact: no plan found at {target} bytes in {time.perf_counter() - t0:.1f} s")
                break
            status, chosen = result
            picked = [gaps[k] for k in chosen]
            decisions = [d for d in (rebuild(problem, graph, g, picked) for g in picked) if d is not None]
            tl = _replay(problem, costs, decisions)
            if tl is None:
                notes.append("exact: its plan does not replay")
                break
            notes.append(f"exact: {status.lower()} at {target} bytes, replayed peak {tl.peak_bytes}, "
                         f"{time.perf_counter() - t0:.1f} s")
            if tl.peak_bytes <= budget_bytes:
                if best is None or tl.makespan_us < best[0].makespan_us:
                    best = (tl, decisions)
                break
            target -= tl.peak_bytes - budget_bytes
            hint = chosen
            if progress.past_deadline():
                break
        return best


def rebuild(problem: Problem, graph: nx.DiGraph, gap: IdleGap, plan: list[IdleGap]) -> Recompute | None:
    """The recompute that drops ``gap``'s tensor and rebuilds it before ``gap.before``, reading what ``plan``
    leaves there (its other gaps open across that op are rebuilt too), or None if it cannot be rebuilt.

    Every other input is kept alive until the rebuild. Rebuilding from what the unplanned step still holds
    there instead (and rebuilding the rest), offered beside it, changed nothing at 0.9 / 0.8 / 0.7 on
    Moccasin's 100-node graph or generated ones of 100 and 250 nodes, and lowered one floor by 2%."""
    away = {g.tensor for g in plan if g.after < gap.before <= g.before and g is not gap} | {gap.tensor}
    try:
        chain = recompute_ops(problem, [gap.tensor], _NotAway(away), graph)
    except ValueError:
        return None
    if not chain:
        return None
    ops = problem.ops
    return Recompute(tensors=(gap.tensor,), ops=tuple(ops[i].name for i in chain), reload_before=ops[gap.before].name)


def _replay(problem: Problem, costs: Costs, decisions: list[Decision]) -> Timeline | None:
    """The timeline of ``decisions``, or None where the simulator rejects them."""
    try:
        return timeline_of(problem, costs, decisions)
    except InvalidPlanError:
        return None


def _excess(timeline: Timeline, budget_bytes: int) -> int:
    """Bytes over the budget, summed over the compute steps: what a plan still has to remove."""
    return sum(max(0, b - budget_bytes) for _, b in timeline.memory)


def _ops_over(problem: Problem, timeline: Timeline, budget_bytes: int) -> list[int]:
    """The ops of the step during which (or during whose rebuilds) the device holds more than the budget."""
    items = [iv for iv in timeline.compute if iv.kind in ("op", "recompute")]
    over: set[int] = set()
    pending = False
    for iv, (_, b) in zip(items, timeline.memory):
        if iv.kind == "recompute":
            pending = pending or b > budget_bytes
            continue
        if b > budget_bytes or pending:
            over.add(problem.op_index(iv.label))
        pending = False
    return sorted(over)
