"""``karma``: the strategy of the KARMA paper (SC20), on our simulator.

Layers are grouped into blocks. Walking the blocks from the first (whose activations wait longest for the
backward), each block is evicted until the step fits the budget: by *swapping* (offload after the forward,
prefetch while the backward of the next block runs) when the concurrency model says the copies hide behind
that compute, and by *recomputing* it from its input otherwise. A few block granularities are tried and the
fastest fitting plan is kept. Without a host link (``costs.allow_offload`` false) every block is recomputed
and what cannot be rebuilt (a random op's output, the block's boundary) stays on the device.
"""
from __future__ import annotations

from karma_fx.costs import Costs
from karma_fx.plan import Decision, Plan
from karma_fx.problem import Problem
from karma_fx.strategies.base import (Gap, RecomputeBuilder, blocks_from_cuts, offload_for, pick_best, reconcile,
                                     saved_gaps, figures_of)

_BLOCK_COUNTS = (4, 8, 12, 16, 24, 32, 48)


class Karma:
    name = "karma"

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        builder = RecomputeBuilder(problem)
        gaps = saved_gaps(problem)
        n_cuts = max(1, len(problem.cut_points))
        options = (self._plan_for(problem, costs, budget_bytes, blocks_from_cuts(problem, count), gaps, builder)
                   for count in sorted({min(c, n_cuts) for c in _BLOCK_COUNTS}))
        decisions, note = pick_best(problem, costs, budget_bytes, options)
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=decisions, notes=(note,))

    def _plan_for(self, problem: Problem, costs: Costs, budget_bytes: int, blocks: list[tuple[int, int]],
                  gaps: list[Gap], builder: RecomputeBuilder) -> tuple[tuple[Decision, ...], str]:
        per_block: list[list[Gap]] = [[] for _ in blocks]
        for g in gaps:
            for b, (first, last) in enumerate(blocks):
                if g.storage.producer is not None and first <= g.storage.producer <= last:
                    per_block[b].append(g)
                    break
        reload = [min((g.first_bwd_use for g in gs), default=None) for gs in per_block]
        fwd_time = [sum(costs.op_time_us[first:last + 1]) for first, last in blocks]
        choices: list[tuple[str, list[Decision]]] = []
        for b, gs in enumerate(per_block):
            if not gs:
                choices.append(("none", []))
                continue
            # The window that hides this block's copies: the next block's forward (offload) and the backward
            # that runs between the next block's reload and this block's (prefetch).
            nxt = next((r for r in reload[b + 1:] if r is not None), problem.num_fwd_ops)
            bwd_window = sum(costs.op_time_us[nxt: reload[b]]) if reload[b] is not None else 0.0
            fwd_window = fwd_time[b + 1] if b + 1 < len(blocks) else 0.0
            size = sum(g.storage.size_bytes for g in gs)
            swap_hidden = max(costs.copy_time_us(size, "d2h"), costs.copy_time_us(size, "h2d")) <= min(fwd_window, bwd_window)
            boundary = set(problem.ops[blocks[b][1]].outputs)
            recomputable = [g for g in gs if problem.ops[g.storage.producer or 0].recomputable
                            and g.storage.name not in boundary]
            # KARMA's swap-out of block b overlaps block b+1's forward and must be done when b+2 starts.
            release = blocks[b + 2][0] if b + 2 < len(blocks) else problem.num_fwd_ops
            if not costs.allow_offload:  # recompute only: what cannot be rebuilt stays
                choices.append(("recompute", [builder.group(recomputable, {g.storage.name for g in recomputable})])
                               if recomputable else ("none", []))
            elif swap_hidden or not recomputable:
                choices.append(("swap", [offload_for(problem, g, prefetch_at=nxt, release=release) for g in gs]))
            else:
                rest = [g for g in gs if g not in recomputable]
                choices.append(("recompute", [builder.group(recomputable, {g.storage.name for g in recomputable})]
                                + [offload_for(problem, g, prefetch_at=nxt, release=release) for g in rest]))

        def prefix(k: int) -> tuple[Decision, ...]:
            return reconcile(problem, [d for _, ds in choices[:k] for d in ds])

        # Evict blocks front to back until the step fits: the smallest fitting prefix, by bisection (the peak
        # falls as more blocks leave; the simulator has the last word on each probe).
        lo, hi = 0, len(choices)
        none, every = figures_of(problem, costs, prefix(0)), figures_of(problem, costs, prefix(hi))
        if none.peak_bytes <= budget_bytes or (every.peak_bytes, every.makespan_us) >= (none.peak_bytes,
                                                                                          none.makespan_us):
            hi = 0  # fits as it is, or evicting everything does not even lower the peak
        elif every.peak_bytes <= budget_bytes:
            while lo < hi:
                mid = (lo + hi) // 2
                if figures_of(problem, costs, prefix(mid)).peak_bytes <= budget_bytes:
                    hi = mid
                else:
                    lo = mid + 1
        k = hi
        kinds = [kind for kind, _ in choices[:k]]
        kept_random = sum(1 for kind, ds in choices[:k] if kind == "recompute" for d in ds[1:])
        return prefix(k), (f"{len(blocks)} blocks: {kinds.count('swap')} swapped, "
                           f"{kinds.count('recompute')} recomputed (their {kept_random} random-op outputs swapped)")
