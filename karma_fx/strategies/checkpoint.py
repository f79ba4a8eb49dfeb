"""``checkpoint``: Chen et al.'s gradient checkpointing over layer blocks.

The forward is split at cut points into blocks; each block keeps only its input and recomputes everything else
it saved from that input, once, just before its backward starts. Outputs of random ops (dropout masks) are
kept: they cannot be recomputed. The block count is the one knob: Chen's √n rule is tried together with a few
others, and the fastest plan that fits the budget wins (or the lowest peak when none fits); when the step
fits as it is, nothing is recomputed.
"""
from __future__ import annotations

import itertools
import math

from karma_fx.costs import Costs
from karma_fx.plan import Decision, Plan
from karma_fx.problem import Problem
from karma_fx.strategies.base import RecomputeBuilder, block_inputs, blocks_from_cuts, pick_best, saved_gaps


def checkpoint_decisions(problem: Problem, blocks: list[tuple[int, int]], builder: RecomputeBuilder) -> list[Decision]:
    gaps = saved_gaps(problem)
    decisions: list[Decision] = []
    boundary = block_inputs(problem, blocks)
    for first, last in blocks:
        dropped = [g for g in gaps
                   if g.storage.producer is not None and first <= g.storage.producer <= last
                   and g.storage.name not in boundary and problem.ops[g.storage.producer].recomputable]
        if dropped:
            decisions.append(builder.group(dropped, {g.storage.name for g in dropped}))
    return decisions


class Checkpoint:
    name = "checkpoint"

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        builder = RecomputeBuilder(problem)
        n = max(1, len(problem.cut_points))
        counts = sorted({max(1, round(math.sqrt(n))), 1, 2, 4, 8, 16, 32, 64} & set(range(1, n + 1)))
        options = itertools.chain([((), 0)], ((checkpoint_decisions(problem, blocks_from_cuts(problem, count), builder),
                                               count) for count in counts))
        decisions, count = pick_best(problem, costs, budget_bytes, options)
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=decisions,
                    notes=(f"{count} recompute blocks" if count else "everything fits: nothing recomputed",))
