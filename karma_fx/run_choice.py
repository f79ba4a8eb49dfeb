"""Which compiled plan a region's run gets: the session's decision as a pure function over plain data.

``karma_fx.session`` knows the step (what earlier runs left, the runs expected after this one) and turns each
compiled plan of the region into a ``Candidate``: its predicted step time, its own peak, and the whole step's
peak if this run used it. ``choose_plan`` then decides, with no state of its own:

* the plan that moves nothing, wherever the whole step fits with it: moving a tensor never makes a step faster
  in fact, even where the model of fused kernels says so (a 4-layer GPT under Inductor: a plan of 12 moves
  predicted 2.3% faster than the step as written ran as slow, and kept running after one step that held
  gradients had needed it);
* else the fastest candidate under which the whole step fits the budget (ties: the lower own peak);
* but the plan this run used last step wherever it still fits (and it is not the leanest), unless the fastest
  has run before: a step a little faster on paper is not worth a recompile and a change of memory profile
  mid-training, but going back to a plan already compiled costs neither (a step that held gradients, or
  the step a benchmark measured, needed a leaner plan once; the steps after it need not keep it);
* where only the leanest plan fits, plan anew at ``target_bytes`` (the room this run has), unless a plan was
  already made at about that target (within 2%): that one was no better, and planning again would be too;
* where nothing fits, plan anew at the target as well; the session tries a few lower targets and, failing
  those, falls back to the leanest plan or refuses the budget.

Example::

    choose_plan([Candidate(0, 90.0, 5 << 20, 9 << 20), Candidate(1, 120.0, 3 << 20, 7 << 20, leanest=True)],
                budget_bytes=8 << 20, target_bytes=4 << 20, planned_at=())
    # Choice(use=None, plan_at=4194304): only the leanest fits, and no plan was made for 4 MiB yet
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

SAME_TARGET = 0.02
"""Targets within this fraction of one already planned at are not planned again."""


@dataclass(frozen=True)
class Candidate:
    """One compiled plan of the region, as the choice sees it."""

    key: int
    """What the caller knows it by (its position among the region's variants)."""
    step_time_us: float
    own_peak_bytes: int
    """The region's own peak under this plan."""
    step_peak_bytes: int
    """The whole step's peak if this run used this plan (the runs before as they ran, those after leanest)."""
    leanest: bool = False
    ran_last_step: bool = False
    ran_before: bool = False
    """Compiled and run at some earlier step: running it again compiles nothing and allocates nothing new."""
    keep: bool = False
    """The plan that moves nothing (the step as written)."""


@dataclass(frozen=True)
class Choice:
    """Run ``use`` (a candidate's key), or plan anew at ``plan_at`` bytes: exactly one is set."""

    use: int | None = None
    plan_at: int | None = None


def worth_planning(target_bytes: int, planned_at: Sequence[int]) -> bool:
    """Whether a plan at ``target_bytes`` could differ from the plans already made at ``planned_at``."""
    return not any(abs(target_bytes - t) <= SAME_TARGET * t for t in planned_at)


def choose_plan(candidates: Sequence[Candidate], budget_bytes: int, target_bytes: int,
                planned_at: Sequence[int]) -> Choice:
    """The plan for this run (see the module's docstring)."""
    usable = [c for c in candidates if c.step_peak_bytes <= budget_bytes]
    kept = next((c for c in usable if c.keep), None)
    if kept is not None:
        return Choice(use=kept.key)
    best = min(usable, key=lambda c: (c.step_time_us, c.own_peak_bytes)) if usable else None
    ran = next((c for c in usable if c.ran_last_step and not c.leanest), None)
    if ran is not None and best is not None and not best.ran_before:
        best = ran
    if best is not None and (not best.leanest or not worth_planning(target_bytes, planned_at)):
        return Choice(use=best.key)
    return Choice(plan_at=target_bytes)
