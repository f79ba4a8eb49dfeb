"""What a recomputation costs where Inductor fuses it with the backward's loops: the price the planner needs.

A recompute chain the backward's loops join (``karma_fx.joins``) runs inside their kernel: it reads what they
read anyway, so its own cost is the rest of its traffic, the results it stores. A two-pass MLP's rebuilt GELU
costs a whole kernel alone (it reads the 4 MiB pre-activation and writes the 4 MiB GELU); fused with the
GELU's backward, which reads that pre-activation too, it adds about the write, 0.6 ms of 1.47 on one CPU
thread (the kernel profiles of ``docs/measurements.md``). Priced at its whole kernel, the planner preferred
other moves to PyTorch's own recompute set at PyTorch's budgets, and its plans ran 1.05-1.14x PyTorch's step
where that set, joined, ran 1.02x.

``rebuild_shares`` prices it before any plan exists: for each saved activation, the chain that rebuilds it alone
(as the strategies build it, ``RecomputeBuilder``) and the loops that would join it (``joined_ops``); each op
of the chain's last stretch of loops (the ops after its last extern kernel, which run in the joined kernel)
gets the share of that stretch's traffic the joined loops do not read, its stored results and what only it
reads (``Costs.rebuild_shares``; the largest share where an op is in several chains). The share is of bytes,
as Inductor's loops on a CPU and on a GPU are priced by their traffic (``karma_fx.fusion.kernel_costs``):
arithmetic the two kernels share, an ``erf`` computed again by the GELU's backward, Inductor computes once,
and arithmetic they do not share is left in the chain's traffic share, not counted apart (a chain's arithmetic
is rarely its cost under Inductor).

The strategies price every chain so (a chain they build may be joined, and the bound stays a bound). The
simulator charges the whole time to a chain the plan does not join, and to one it joins the share of the joins
it has (``joins.unshared_share``), never less than the strategies' price.
"""
from __future__ import annotations

from dataclasses import replace

from karma_fx.costs import Costs
from karma_fx.joins import joined_ops, last_stretch, unshared_share
from karma_fx.problem import Problem
from karma_fx.strategies.base import RecomputeBuilder, saved_gaps

__all__ = ["rebuild_shares", "with_rebuild_shares"]


def rebuild_shares(problem: Problem) -> dict[str, float]:
    """Op name -> the share of its time a rebuild costs where the backward's loops join its chain (the module
    docstring); ops in no chain that loops join are not named. Only on the step Inductor runs."""
    if not problem.loop_ops:
        return {}
    builder = RecomputeBuilder(problem)
    shares: dict[str, float] = {}
    for gap in saved_gaps(problem):
        producer = gap.storage.producer
        if producer is None or not problem.ops[producer].recomputable:
            continue
        try:
            chain = builder.group([gap], {gap.storage.name})
        except ValueError:
            continue
        joined = joined_ops(problem, chain)
        if not joined:
            continue
        stretch = last_stretch(problem, chain.ops)
        share = unshared_share(problem, stretch, joined)
        for name in stretch:
            shares[name] = max(shares.get(name, 0.0), share)
    return {name: share for name, share in shares.items() if share < 1.0}


def with_rebuild_shares(problem: Problem, costs: Costs) -> Costs:
    """``costs`` with the rebuild shares of ``problem`` (``rebuild_shares``), in op order."""
    shares = rebuild_shares(problem)
    ordered = tuple((op.name, shares[op.name]) for op in problem.ops if op.name in shares)
    return replace(costs, rebuild_shares=ordered)
