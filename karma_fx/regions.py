"""What one planned run of a compiled region costs the rest of the step, and how runs share the budget.

A graph-broken model is several compiled regions, and one region may run many times in a step (a block
compiled once and called for each of six layers). Each run keeps its saved tensors on the device from the end
of its forward until its backward, while every later run goes through its own forward and backward; its
parameter gradients stay from its backward to the end of the step, while every earlier run goes through its
backward. So a run ``k`` planned alone must fit in what the others leave:

    persistent bytes not its own + held by the runs before it + gradients of the runs after it + its peak
    <= budget

``Footprint`` is what a run's plan means for the others; ``room`` applies the inequality. When the sequence of
runs is known (from the previous step), ``room`` also caps what run ``k`` may hold so that every later run can
still fit with its leanest plan, and ``total_that_works`` is the smallest budget under which every run fits
with its leanest plan, which that cap makes sufficient. All of it is plain arithmetic over integers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from karma_fx.plan import GradToHost, Offload, Plan, Recompute
from karma_fx.problem import Problem
from karma_fx.simulate import Timeline


@dataclass(frozen=True)
class Footprint:
    """Device bytes of one planned run, as the other runs of the step see them."""

    peak_bytes: int
    """Its simulated peak, with its own parameters and inputs."""
    own_bytes: int
    """Its parameters and buffers: on the device all step long, counted once for the whole step."""
    held_bytes: int
    """What it keeps on the device from the end of its forward to its backward: the tensors its backward reads
    that the plan neither offloads nor recomputes (its parameters and buffers aside)."""
    grad_bytes: int
    """Its parameters' gradients, alive from its backward to the end of the step. (The gradients of its
    inputs are the previous run's incoming gradients: that run counts them.)"""
    out_bytes: int = 0
    """Its forward outputs; those of the step's last run stay alive through the whole backward."""


@dataclass(frozen=True)
class Boundary:
    """Which storages of a region's problem leave its forward and which are its parameters' gradients."""

    outputs: frozenset[str] = frozenset()
    param_grads: frozenset[str] | None = None
    """``None``: not known, every gradient output counts."""


def footprint(problem: Problem, timeline: Timeline, plan: Plan, *, offload_weights: bool = False,
              boundary: Boundary = Boundary()) -> Footprint:
    """The footprint of ``plan`` on ``problem`` (``timeline`` is its simulation)."""
    own_kinds = ("buffer",) if offload_weights else ("param", "buffer")
    own = sum(s.size_bytes for s in problem.storages if s.kind in own_kinds)
    out = sum(s.size_bytes for s in problem.storages if s.name in boundary.outputs and s.kind not in own_kinds)
    # What the backward reads from the forward, as the plan leaves it: tensors with a backward reader and the
    # inputs of the recompute chains, less what the plan offloads or recomputes.
    n = problem.num_fwd_ops
    moved = {d.tensor for d in plan.decisions if isinstance(d, Offload)}
    moved |= {t for d in plan.decisions if isinstance(d, Recompute) for t in d.tensors}
    op_index = {op.name: i for i, op in enumerate(problem.ops)}
    replayed = {s for d in plan.decisions if isinstance(d, Recompute) for name in d.ops
                for s in problem.ops[op_index[name]].inputs}
    held = sum(st.size_bytes for st in problem.storages
               if st.kind not in ("param", "buffer", "tangent", "gradient") and st.name not in moved
               and (st.producer is None or st.producer < n)
               and (st.name in replayed or any(u >= n for u in st.users)))
    to_host = {d.tensor for d in plan.decisions if isinstance(d, GradToHost)}
    grads = sum(s.size_bytes for s in problem.storages
                if s.kind == "gradient" and s.is_output and s.name not in to_host
                and (boundary.param_grads is None or s.name in boundary.param_grads))
    return Footprint(peak_bytes=timeline.peak_bytes, own_bytes=own, held_bytes=held, grad_bytes=grads,
                     out_bytes=out)


@dataclass(frozen=True)
class Room:
    """What run ``k`` may use: its peak at most ``peak_bytes``, and at most ``held_bytes`` kept for backward."""

    peak_bytes: int
    held_bytes: float = math.inf

    def admits(self, fp: Footprint) -> bool:
        return fp.peak_bytes <= self.peak_bytes and fp.held_bytes <= self.held_bytes


def room(budget_bytes: int, persistent_bytes: int, own_bytes: int, held_before: Sequence[int],
         later: Sequence[Footprint] | None, unseen_grad_bytes: int = 0) -> Room:
    """Room for the next run. ``later``: the leanest footprints of the runs known to follow (``None``: not
    known, then ``unseen_grad_bytes`` stands for their gradients)."""
    before = sum(held_before)
    grads_after = _alive_after(later, -1) if later is not None else unseen_grad_bytes
    peak = budget_bytes - (persistent_bytes - own_bytes) - before - grads_after
    if not later:
        return Room(peak_bytes=peak)
    cap = math.inf
    between = 0
    for i, lean in enumerate(later):
        cap = min(cap, budget_bytes - (persistent_bytes - lean.own_bytes) - before - between
                  - _alive_after(later, i) - lean.peak_bytes)
        between += lean.held_bytes
    return Room(peak_bytes=peak, held_bytes=cap)


def _alive_after(runs: Sequence[Footprint], k: int) -> int:
    """What the runs after ``k`` leave on the device while run ``k`` goes through its backward: their
    parameters' gradients, and the outputs of the step's last run (the loss, logits the caller holds)."""
    if k >= len(runs) - 1:
        return 0
    return sum(f.grad_bytes for f in runs[k + 1:]) + runs[-1].out_bytes


def total_that_works(persistent_bytes: int, leanest: Sequence[Footprint]) -> int:
    """The smallest budget under which every run of the sequence fits with its leanest plan. With it, ``room``
    always admits the leanest plan of the next run whatever the earlier runs chose within their rooms."""
    worst = 0
    for k, lean in enumerate(leanest):
        before = sum(f.held_bytes for f in leanest[:k])
        worst = max(worst, persistent_bytes - lean.own_bytes + before + _alive_after(leanest, k) + lean.peak_bytes)
    return worst
