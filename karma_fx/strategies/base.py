"""What every strategy is and the building blocks they share.

A strategy is any callable ``(problem, costs, budget_bytes) -> Plan`` with a ``name``; it returns decisions
and a status, and leaves the simulated figures to ``karma_fx.simulate`` so all strategies are judged alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from karma_fx.costs import Costs
from karma_fx.plan import Decision, Offload, Plan, Recompute
from karma_fx.problem import Problem, Storage
from karma_fx.passes.liveness import dependency_graph, recompute_ops
from karma_fx.simulate import Timeline, simulate


@runtime_checkable
class Strategy(Protocol):
    name: str

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan: ...


@dataclass(frozen=True)
class Gap:
    """Where a saved activation is idle: after its last forward read, until its first backward read."""

    storage: Storage
    last_fwd_use: int
    first_bwd_use: int


def saved_gaps(problem: Problem) -> list[Gap]:
    """One gap per saved activation, in production order."""
    gaps = []
    for s in problem.saved_activations():
        fwd = [u for u in s.users if u < problem.num_fwd_ops]
        bwd = [u for u in s.users if u >= problem.num_fwd_ops]
        gaps.append(Gap(storage=s, last_fwd_use=max(fwd, default=s.producer), first_bwd_use=min(bwd)))
    return gaps


def offload_for(problem: Problem, gap: Gap, prefetch_at: int | None = None, *,
                release: bool | int = False) -> Offload:
    """Offload right after production, drop after the last forward read, prefetch at ``prefetch_at``.

    ``release``: ``True`` waits for the copy right after the last forward read; an op index waits before
    that op (clamped into the gap); ``False`` never waits.
    """
    ops = problem.ops
    producer = gap.storage.producer if gap.storage.producer is not None else 0
    pf = gap.first_bwd_use if prefetch_at is None else max(gap.last_fwd_use + 1, min(prefetch_at, gap.first_bwd_use))
    release_before = None
    if release is not False:
        at = gap.last_fwd_use + 1 if release is True else int(release)
        release_before = ops[max(gap.last_fwd_use + 1, min(at, pf))].name
    return Offload(tensor=gap.storage.name, offload_after=ops[producer].name, free_after=ops[gap.last_fwd_use].name,
                   prefetch_at=ops[pf].name, reload_before=ops[gap.first_bwd_use].name, release_before=release_before)


class RecomputeBuilder:
    """Builds ``Recompute`` decisions for groups of dropped activations, sharing one dependency graph."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.graph = dependency_graph(problem)

    def group(self, dropped: list[Gap], dropped_names: set[str]) -> Recompute:
        """Rebuild ``dropped`` together before the first backward read of any of them.

        Everything not in ``dropped_names`` counts as resident; every rebuilt activation that the chain makes
        and that was dropped is listed, so it is rebuilt once and kept until its last read.
        """
        problem = self.problem
        resident = {s.name for s in problem.storages} - dropped_names
        targets = [g.storage.name for g in dropped]
        chain = recompute_ops(problem, targets, resident, self.graph)
        made = {s for i in chain for s in problem.ops[i].outputs}
        tensors = tuple(s for s in sorted(made & dropped_names, key=lambda n: problem.storage(n).producer or 0))
        reload = min(g.first_bwd_use for g in dropped)
        return Recompute(tensors=tensors, ops=tuple(problem.ops[i].name for i in chain),
                         reload_before=problem.ops[reload].name)


def blocks_from_cuts(problem: Problem, count: int) -> list[tuple[int, int]]:
    """Split the forward into about ``count`` blocks of similar size at cut points: ``[(first_op, last_op)]``."""
    n = problem.num_fwd_ops
    cuts = [c for c in problem.cut_points if c < n - 1]
    if n == 0:
        return []
    if not cuts or count <= 1:
        return [(0, n - 1)]
    bounds: list[int] = []
    target = n / count
    next_mark = target
    for c in cuts:
        if c + 1 >= next_mark:
            bounds.append(c)
            next_mark = c + 1 + target
    blocks, start = [], 0
    for b in bounds:
        if b >= start:
            blocks.append((start, b))
            start = b + 1
    if start <= n - 1:
        blocks.append((start, n - 1))
    return blocks


def timeline_of(problem: Problem, costs: Costs, decisions: tuple[Decision, ...] | list[Decision]) -> Timeline:
    return simulate(problem, tuple(decisions), costs)
