"""``offload``: offload every saved activation, prefetch one block ahead (what torchtune's
``OffloadActivations`` does).

Each saved activation is copied to the host as soon as it is produced, dropped after its last forward read,
and copied back when the backward reaches the block after it (in backward order), one block ahead of need.
The strategy does not look at the budget: it is the all-offload baseline. Without a host link
(``costs.allow_offload`` false) it moves nothing.
"""
from __future__ import annotations

from karma_fx.costs import Costs
from karma_fx.plan import Plan
from karma_fx.problem import Problem
from karma_fx.strategies.base import blocks_from_cuts, offload_for, saved_gaps


def block_of(blocks: list[tuple[int, int]], op: int) -> int:
    for b, (first, last) in enumerate(blocks):
        if first <= op <= last:
            return b
    return len(blocks) - 1


class OffloadAll:
    name = "offload"

    def __init__(self, blocks: int = 12) -> None:
        self.blocks = blocks

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        if not costs.allow_offload:
            return Plan(strategy=self.name, budget_bytes=budget_bytes,
                        notes=("no host link (recompute only): nothing can be offloaded",))
        blocks = blocks_from_cuts(problem, self.blocks)
        gaps = saved_gaps(problem)
        # When the backward first needs something of each block: that is where the previous block's
        # prefetches are issued.
        reload_of_block: dict[int, int] = {}
        for g in gaps:
            b = block_of(blocks, g.storage.producer or 0)
            reload_of_block[b] = min(reload_of_block.get(b, g.first_bwd_use), g.first_bwd_use)
        decisions = []
        for g in gaps:
            b = block_of(blocks, g.storage.producer or 0)
            later = [reload_of_block[x] for x in reload_of_block if x > b]
            prefetch_at = max(later) if later else problem.num_fwd_ops
            decisions.append(offload_for(problem, g, prefetch_at=prefetch_at))
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=tuple(decisions),
                    notes=(f"prefetch one of {len(blocks)} blocks ahead",))
