"""``torch-budget``: PyTorch's own ``activation_memory_budget`` partitioner, judged by our simulator.

PyTorch picks what to save with a knapsack over recompute candidates for a budget given as a fraction of
activation memory; that fraction is not our budget in bytes, so a grid of fractions is tried and the fastest
plan whose simulated peak fits is kept (PyTorch's peak is not monotonic in its budget, pytorch#197838).
Whatever the backward needs and PyTorch did not save is recomputed just before its first backward read.
"""
from __future__ import annotations

import itertools
from typing import Callable

from karma_fx.costs import Costs
from karma_fx.plan import Decision, Plan
from karma_fx.problem import Problem
from karma_fx.strategies.base import Gap, RecomputeBuilder, pick_best, saved_gaps

SavedSetFn = Callable[[float], frozenset[str]]
GRID = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


def decisions_for_saved(problem: Problem, saved: frozenset[str], builder: RecomputeBuilder,
                        all_gaps: list[Gap] | None = None) -> list[Decision]:
    """Recompute every saved activation outside ``saved``, grouped by where the backward first needs it
    (``all_gaps``: ``saved_gaps(problem)``, if the caller has it already)."""
    gaps = [g for g in (saved_gaps(problem) if all_gaps is None else all_gaps) if g.storage.name not in saved]
    recomputable = [g for g in gaps if problem.ops[g.storage.producer or 0].recomputable]
    dropped = {g.storage.name for g in recomputable}
    by_reload: dict[int, list[Gap]] = {}
    for g in recomputable:
        by_reload.setdefault(g.first_bwd_use, []).append(g)
    decisions: list[Decision] = []
    rebuilt: set[str] = set()
    for reload in sorted(by_reload):
        todo = [g for g in by_reload[reload] if g.storage.name not in rebuilt]
        if not todo:
            continue
        # What earlier groups rebuilt stays resident until its last read, so it is not rebuilt again.
        r = builder.group(todo, dropped - rebuilt)
        rebuilt.update(r.tensors)
        decisions.append(r)
    return decisions


class TorchBudget:
    name = "torch-budget"

    def __init__(self, saved_set: SavedSetFn, grid: tuple[float, ...] = GRID) -> None:
        self.saved_set = saved_set
        self.grid = grid

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        builder = RecomputeBuilder(problem)
        options = itertools.chain([((), None)],
                                  ((decisions_for_saved(problem, self.saved_set(f), builder), f) for f in self.grid))
        decisions, fraction = pick_best(problem, costs, budget_bytes, options)
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=decisions,
                    notes=(f"activation_memory_budget={fraction}" if fraction is not None
                           else "everything fits: nothing recomputed",))
