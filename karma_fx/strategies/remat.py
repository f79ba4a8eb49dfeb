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

* greedy: while some op runs over the budget, the gaps open across the op furthest over it are ranked by the
  excess bytes (summed over the step's ops) each is estimated to remove per µs of rebuilding, from the plan's
  memory per op: the tensor gone inside its gap, less the inputs its rebuild keeps alive longer
  (``_estimated_gain``). The best are replayed, best first, and the one that removes the most excess per µs
  it adds is taken. Then every rebuild the plan can do without is dropped again, dearest first.
* exact: the CP-SAT model of ``cpsat.gaps`` over the same gaps, started from greedy's plan, its budget
  tightened by what the simulator finds over it (the model counts memory per op, not per rebuild step).

A rebuild re-runs the tensor's producer and reads its inputs before the op it serves; an input the plan has
dropped there is rebuilt too (``dependencies.recompute_ops``), any other is kept alive until then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.dependencies import dependency_graph, recompute_ops
from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Decision, Plan, Recompute
from karma_fx.problem import Problem
from karma_fx.simulate import Timeline
from karma_fx.strategies.base import chain_reads, per_op_memory, timeline_of

TRIED_PER_STEP = 8
"""Gaps replayed per greedy step at most, the best by their estimate (``_estimated_gain``), until one replayed
does at least as well as the next is estimated to: enough that the estimate's misses (a rebuild's own peak, a
peak that moves) are caught, few enough that a 1000-node graph plans in seconds."""
DEEPEST = 32
"""Ops a rebuild from what the plan holds anyway (``rebuild``'s second form) may re-run at most: the walk back
through dropped tensors reaches the graph's source on Moccasin-shaped graphs, and such chains cost more than
they save while their search took most of greedy's time."""
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

    def __init__(self, *, exact: bool = True, max_steps: int = 400, time_limit_s: float | None = None,
                 anywhere: bool = True) -> None:
        """``anywhere``: where no gap across the op furthest over the budget helps, greedy tries the gaps across
        every op over it (4x the work of a step; the leanest plan's bisection, far below what fits, leaves it
        out)."""
        self.exact = exact
        self.max_steps = max_steps
        self.time_limit_s = time_limit_s
        self.anywhere = anywhere

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
        held_to = _held_to(problem)
        for _ in range(self.max_steps):
            held_at = _held_per_op(problem, state)
            excess_at = np.maximum(held_at - budget_bytes, 0)
            if not excess_at.any():
                break
            if taken and progress.past_deadline():
                stopped = True
                break
            worst = int(np.argmax(excess_at))
            held = (held_to, _read_by_rebuilds_until(problem, [d for _, d in taken]))
            # Gaps across the op furthest over the budget first (ranking every gap across any op over the budget
            # took 4x longer a step); where none of those helps (the excess there may be a rebuild's own), any.
            best = _best_move(problem, costs, budget_bytes, graph, gaps, taken, held_at, held,
                              lambda g: g.after < worst < g.before)
            if best is None and self.anywhere:
                best = _best_move(problem, costs, budget_bytes, graph, gaps, taken, held_at, held,
                                  lambda g: bool(excess_at[g.after + 1:g.before + 1].any()))
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


def _best_move(problem: Problem, costs: Costs, budget_bytes: int, graph: nx.DiGraph, gaps: list[IdleGap],
               taken: list[tuple[IdleGap, Recompute]], held_at: np.ndarray,
               held: tuple[dict[str, int], dict[str, int]], across: Any
               ) -> tuple[float, IdleGap, Recompute, Timeline] | None:
    """Greedy's next gap among those ``across`` accepts: ranked by estimated bytes over the budget (summed over the
    step) removed per µs of rebuilding, replayed best first until one replayed does at least as well as the next
    is estimated to. Returns (rate, gap, its rebuild, the timeline with it), or None where no gap replayed
    removes any. ``held``: ``_held_to`` and ``_read_by_rebuilds_until`` of the plan ``taken``."""
    used = {(g.tensor, g.after) for g, _ in taken}
    ranked = []
    plan = [t for t, _ in taken]
    for g in gaps:
        if (g.tensor, g.after) in used or not across(g):
            continue
        decision = rebuild(problem, graph, g, plan)
        if decision is None:
            continue
        deeper = rebuild(problem, graph, g, plan, held)
        for k, d in enumerate((decision,) if deeper is None or deeper.ops == decision.ops else (decision, deeper)):
            work = sum(costs.rebuild_us(problem, problem.op_index(o)) for o in d.ops)
            gain = _estimated_gain(problem, g, d, held_at, budget_bytes, held[1])
            ranked.append((-gain / (work + 1e-3), g.tensor, g.after, k, work, g, d))
    ranked.sort(key=lambda r: r[:4])
    excess = int(np.maximum(held_at - budget_bytes, 0).sum())
    best = None
    tried = ranked[:TRIED_PER_STEP]
    for k, (*_, work, g, decision) in enumerate(tried):
        tl = _replay(problem, costs, [d for _, d in taken] + [decision])
        if tl is None:
            continue
        # measured as estimated: excess per op (a rebuild step folded into the op after it), per µs rebuilt
        gain = excess - int(np.maximum(_held_per_op(problem, tl) - budget_bytes, 0).sum())
        rate = gain / (work + 1e-3)
        if gain > 0 and (best is None or rate > best[0]):
            best = (rate, g, decision, tl)
        if best is not None and k + 1 < len(tried) and best[0] >= -tried[k + 1][0]:
            break  # the next gaps are estimated no better than what a replay has confirmed
    return best


class _HeldThere:
    """What a rebuild before op ``at`` may read without rebuilding it: what the plan holds there anyway (read at
    or after ``at``, or by a rebuild of the plan at or after it, or an output of the step), not dropped across it.
    ``held_to``: each tensor's last reader in the step as written (``_held_to``), past the end if it lives on."""

    def __init__(self, held_to: dict[str, int], at: int, away: set[str], read_until: dict[str, int]) -> None:
        self.held_to, self.at, self.away, self.read_until = held_to, at, away, read_until

    def __contains__(self, name: object) -> bool:
        return (name not in self.away and (self.held_to[name] >= self.at  # type: ignore[index]
                                           or self.read_until.get(name, -1) >= self.at))  # type: ignore[arg-type]


def _held_to(problem: Problem) -> dict[str, int]:
    """Each tensor's last reader in the step as written; past the last op for inputs and outputs of the step."""
    end = len(problem.ops)
    return {s.name: end if s.producer is None or s.lives_to_end else max([s.producer, *s.users])
            for s in problem.storages}


def rebuild(problem: Problem, graph: nx.DiGraph, gap: IdleGap, plan: list[IdleGap],
            held: tuple[dict[str, int], dict[str, int]] | None = None) -> Recompute | None:
    """The recompute that drops ``gap``'s tensor and rebuilds it before ``gap.before``, reading what ``plan``
    leaves there (its other gaps open across that op are rebuilt too), or None if it cannot be rebuilt.

    Without ``held``, every other input is kept alive until the rebuild. With ``held`` (``_held_to`` and
    ``_read_by_rebuilds_until``), the rebuild reads only what the plan holds there anyway and rebuilds the rest
    too, at most ``DEEPEST`` ops: greedy offers both. The second form, first tried with the ranking by bytes times
    ops over the budget, changed nothing; with gaps ranked by their estimated effect it fits a 1000-node
    Moccasin-shaped graph (``random_wide_graph(1000, 1000)``) at 0.8 of its peak, where the first alone stops at
    0.85."""
    away = {g.tensor for g in plan if g.after < gap.before <= g.before and g is not gap} | {gap.tensor}
    resident = _NotAway(away) if held is None else _HeldThere(held[0], gap.before, away, held[1])
    try:
        chain = recompute_ops(problem, [gap.tensor], resident, graph, None if held is None else DEEPEST)
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


def _held_per_op(problem: Problem, timeline: Timeline) -> np.ndarray:
    """``base.per_op_memory`` as an array: the device bytes during each op, or during the rebuilds just before it."""
    return np.asarray(per_op_memory(problem, timeline), dtype=np.int64)


def _read_by_rebuilds_until(problem: Problem, decisions: list[Recompute]) -> dict[str, int]:
    """Tensor → the latest op before which a rebuild of the plan reads it (it is kept alive until then)."""
    until: dict[str, int] = {}
    for d in decisions:
        at = problem.op_index(d.reload_before)
        for name in chain_reads(problem, d):
            until[name] = max(until.get(name, -1), at)
    return until


def _estimated_gain(problem: Problem, gap: IdleGap, decision: Recompute, held_at: np.ndarray,
                    budget_bytes: int, read_until: dict[str, int]) -> int:
    """What dropping ``gap`` and rebuilding it as ``decision`` removes from the bytes over the budget (summed over
    ops), estimated from the current plan's memory per op without replaying it: the tensor is gone inside the gap,
    and each input the rebuild reads is kept alive from its last touch (a read, or a rebuild of the plan reading
    it) to the rebuild. Replaying every gap is exact but takes minutes on a thousand-node graph; ranking by bytes
    times the ops over the budget alone put first the gaps whose rebuilds keep larger inputs alive, and greedy
    stopped at 0.97 of a 1000-node graph's peak where it reaches 0.8 replaying every gap."""
    start, end = gap.after + 1, gap.before  # the rebuild runs before op ``gap.before``: count it there
    kept: list[tuple[int, int]] = []
    for name in chain_reads(problem, decision):
        storage = problem.storage(name)
        if storage.lives_to_end or storage.producer is None:
            continue
        last = max([storage.producer, *storage.users, read_until.get(name, -1)])
        if last < gap.before:  # otherwise alive across the rebuild already
            kept.append((last + 1, storage.size_bytes))
            start = min(start, last + 1)
    delta = np.zeros(end + 1 - start, dtype=np.int64)
    delta[gap.after + 1 - start:gap.before - start] -= gap.size_bytes
    for first, size in kept:
        delta[first - start:end - start] += size  # freed after the rebuild: op ``gap.before`` does not read it
    held = held_at[start:end + 1]
    return int(np.maximum(held - budget_bytes, 0).sum() - np.maximum(held + delta - budget_bytes, 0).sum())
