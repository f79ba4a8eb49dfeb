"""A budget no plan meets, said so that the user can act on it.

``refusal`` builds the ``InfeasibleBudgetError`` a session raises: the total that works (every run at its leanest
plan, by the step ledger's arithmetic, as a fresh compile will first count it), where that floor is reached (the
run, the phase and the op, by module), and what no plan can move (gradients held from an earlier micro-batch,
tensors pinned by graph breaks, with where each break is and how much it pins).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from karma_fx.between import loss_head_guess
from karma_fx.budget import format_bytes
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.regions import Run, Step, pinned_by_breaks
from karma_fx.strategies import DEFAULT_STRATEGY
from karma_fx.strategies.leanest import LEANEST_SWAPS

MARGIN_FRACTION = 0.001
MARGIN_BYTES = 1024
"""A named total keeps 0.1% (1 KiB at least) for the few bytes no plan sees: the loss's scalars, the seed of the
backward."""


def total_that_works(base: int, views: Sequence[Run], gaps: Sequence[int]) -> int:
    """The budget to name for ``views`` (each run with a leanest plan): the step as the session now knows it,
    and as a fresh compile's first steps will see it (before it learns which outputs the caller lets go and what
    the code after the forward allocates, it assumes all kept and guesses), whichever is more, since whoever is
    told a total starts again from scratch with it; and the margin."""
    known = Step(base, tuple(views), tuple(gaps)).peak_bytes
    guessed = [max(g, loss_head_guess(v) if k == len(views) - 1 else 0) for k, (g, v) in enumerate(zip(gaps, views))]
    fresh = Step(base, tuple(replace(v, caller_keeps=None) for v in views), tuple(guessed)).peak_bytes
    needed = max(known, fresh)
    return needed + max(MARGIN_BYTES, int(needed * MARGIN_FRACTION))


def refusal(*, strategy: str, budget_bytes: int, views: list[Run], regions: list[Any], base: int, gaps: list[int],
            leanest: Callable[[Any], Any], unplanned: int, held_grad_bytes: int, partial: bool,
            as_written: bool = False) -> InfeasibleBudgetError:
    """The error for a step of ``views`` (its runs, each at its leanest plan: ``leanest`` gives it for a region)
    over ``regions`` (the region of each run) that does not fit ``budget_bytes``. ``partial``: the step's first
    run, what follows not known. ``as_written``: the lowest the step goes is every run with nothing moved."""
    needed = total_that_works(base, views, gaps)
    split = any(leanest(r).plan.splits for r in regions if r.prepared is not None)
    how = "nothing moved: the step as written, Inductor's own partition" if as_written else LEANEST_SWAPS
    message = (
        f"strategy {strategy!r} cannot fit the training step in {format_bytes(budget_bytes)}"
        + (f" (its {len(views)} compiled region runs share the budget)" if len(views) > 1 else "")
        + f": the smallest budget known to work is {format_bytes(needed)} ({needed} bytes: {how}"
        + (", convolutions run a piece of the batch at a time" if split else "")
        + f"), which the default strategy {DEFAULT_STRATEGY!r} "
          f"reaches; with nothing moved the step peaks at {format_bytes(unplanned)}"
        + where_the_floor_is(Step(base, tuple(views), tuple(gaps)), regions, leanest)
        + what_is_held(held_grad_bytes, views, regions)
        + (". That total is for the step's first compiled region: if graph breaks split the model, the regions "
           "after it need room too, and a step that runs to its end names the total for all of them"
           if partial else ""))
    return InfeasibleBudgetError(message, min_budget_bytes=needed, budget_bytes=budget_bytes)


def where_the_floor_is(step: Step, regions: list[Any], leanest: Callable[[Any], Any]) -> str:
    """Where ``step`` peaks: the phase, and the op there (by module), replayed with the leanest plan."""
    from karma_fx.problem import describe_op
    from karma_fx.simulate import simulate

    phase = step.peak
    if phase.stage == "after":
        return (f"; that floor is reached after the forward of run {phase.run + 1}, in the code that runs between "
                f"compiled regions (the loss head after the last one)")
    from karma_fx.variants import source_of

    region = regions[phase.run]
    plan = leanest(region).plan
    p = source_of(region, plan).prepared
    timeline = simulate(p.problem, plan, p.costs)
    items = [iv for iv in timeline.compute if iv.kind in ("op", "recompute")]
    span = range(timeline.forward_items) if phase.stage == "forward" else \
        range(timeline.forward_items, len(timeline.memory))
    if not span or len(items) != len(timeline.memory):
        return ""
    name = items[max(span, key=lambda i: timeline.memory[i][1])].label
    known = {op.name for op in p.problem.ops}
    where = describe_op(p.problem.ops[p.problem.op_index(name)]) if name in known else name
    run = f"run {phase.run + 1}'s (region {region.index})" if len(regions) > 1 else "the"
    return f"; that floor is reached in {run} {phase.stage}, at {where}"


def what_is_held(held_grad_bytes: int, views: list[Run], regions: list[Any]) -> str:
    """The parts of the step no plan can move: gradients held from an earlier micro-batch, tensors pinned by
    graph breaks (where each break is, and how much it pins)."""
    notes = []
    if held_grad_bytes:
        notes.append(f"{format_bytes(held_grad_bytes)} of it are gradients held from an earlier backward "
                     f"(accumulating: they count; otherwise call optimizer.zero_grad(set_to_none=True) before the "
                     f"step)")
    pinned = pinned_by_breaks(views)
    if any(pinned):
        at: dict[str, list[int]] = {}
        for k, b in enumerate(pinned):
            if b > 0:
                before = regions[k - 1]
                at.setdefault(before.ends_at or f"where region {before.index} returns", []).append(b)
        parts = [f"{format_bytes(sum(bs))} at {where}" + (f" ({len(bs)} runs)" if len(bs) > 1 else "")
                 for where, bs in sorted(at.items(), key=lambda e: -sum(e[1]))]
        notes.append(f"graph breaks pin {format_bytes(sum(pinned))} that the backward reads across them, which no "
                     f"plan can move: " + "; ".join(parts[:4]) + (f"; {len(parts) - 4} more" if len(parts) > 4
                                                                  else ""))
    return "".join(f". {n}" for n in notes)
