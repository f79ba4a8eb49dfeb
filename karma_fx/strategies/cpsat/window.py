"""The exact planner's refinement: the tensor-level CP-SAT model re-solved inside a window of candidates,
everything outside pinned to the incumbent plan (a model whose size does not grow with the graph).

The whole-graph model does not scale past a few hundred candidates, so it rarely beats the heuristics there.
A window can: the incumbent's decisions outside it stay as they are (their device bytes become the window
model's base memory, measured by the simulator), and inside it the model chooses keep / offload (release,
prefetch) / recompute per tensor or per segment wholly inside the window, warm-started from the
incumbent's own choices (``AddHint`` with a completed assignment). A window whose incumbent choices the model
cannot express (no hint) is skipped: without a start the model's few seconds find nothing better. The
outside's copies are pinned candidates of the model (they share the copy streams with the window's) and its
recompute chains are timed before the ops they precede (what they read is due before them); the model still
approximates (a free tensor's copy back queues at the read it is due for, not where it is issued), so the
simulator has the last word: a window's plan replaces the incumbent only if it fits and is faster.

No window starts once the deadline of the call has passed (``karma_fx.progress``); each solve is cut to the
time left by the model itself.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Decision, Offload, Plan, Recompute
from karma_fx.problem import Problem
from karma_fx.strategies.base import (copies_landed, figures_of, per_op_memory, read_by_chains, reconcile,
                                     timeline_of)
from karma_fx.strategies.cpsat.descent import descend
from karma_fx.strategies.cpsat.exact import Model, choices_from_plan
from karma_fx.strategies.cpsat.choice import Choice
from karma_fx.strategies.cpsat.model import Candidate, solver_units
from karma_fx.strategies.cpsat.segments import Segment, attach_plan_choices, segments_of
from karma_fx.strategies.cpsat.options import SolverOptions


def _moved(d: Decision) -> set[str]:
    return set(d.tensors) if isinstance(d, Recompute) else {getattr(d, "tensor")}


def _whole_groups(decisions: Sequence[Decision], names: set[str], candidates: set[str]) -> set[str]:
    """``names`` with every other candidate that a decision rebuilds together with one of them: a window that
    takes half of a rebuilt group leaves the other half outside and kept (the window's base), which did not fit
    (ResNet-200 in bf16 at 0.35: three of four windows skipped)."""
    out = set(names)
    grown = True
    while grown:
        grown = False
        for d in decisions:
            if isinstance(d, Recompute) and len(d.tensors) > 1 and out & set(d.tensors):
                more = (set(d.tensors) & candidates) - out
                if more:
                    out |= more
                    grown = True
    return out


def window_candidates(problem: Problem, window: list[Candidate], outside: Sequence[Decision]) -> list[Candidate]:
    """The window's candidates as the pinned plan leaves them: a recompute chain may read only what the
    outside keeps on the device, and a tensor that an outside chain reads is not recomputed (it must be there
    for that chain); a chain's reads of other window tensors stay constraints of the model. A segment is
    offered only when all its members are in the window."""
    names = {c.name for c in window}
    away = set().union(*(_moved(d) for d in outside)) if outside else set()
    read_outside = read_by_chains(problem, outside)
    segs: dict[int, Segment] = {}
    for seg in segments_of(window):
        reads = {s for i in seg.chain for s in problem.ops[i].inputs}
        if all(t in names for t in seg.members) and not (set(seg.members) & read_outside.keys()) and not reads & away:
            segs[seg.index] = dataclasses.replace(seg, needs_kept=[t for t in seg.needs_kept if t in names])
    out = []
    for c in window:
        if c.chain is not None:
            reads = {s for i in c.chain for s in problem.ops[i].inputs}
            if reads & away or c.name in read_outside:
                c = dataclasses.replace(c, chain=None, needs_kept=[], extends=[])
        out.append(_due_at_chain(dataclasses.replace(c, needs_kept=[t for t in c.needs_kept if t in names],
                                                     segments=tuple(segs[g.index] for g in c.segments
                                                                    if g.index in segs)), read_outside))
    return out


def _due_at_chain(c: Candidate, read_by: dict[str, int]) -> Candidate:
    """``c`` as a model around pinned chains must see it: back before the first of those chains that reads it
    (its ``first_bwd`` that op, its prefetch options no later, ``before_chains``), where that is no later than
    its own first read."""
    at = read_by.get(c.name)
    if at is None or at > c.first_bwd:
        return c
    if at == c.first_bwd:
        return dataclasses.replace(c, before_chains=True)
    return dataclasses.replace(c, first_bwd=at, prefetches=[p for p in c.prefetches if p <= at] or [at],
                               before_chains=True)


def pin_outside_copies(problem: Problem, cands: list[Candidate], names: set[str], outside: Sequence[Decision],
                       landed: dict[str, int]) -> tuple[list[Candidate], dict[str, Choice], tuple[Decision, ...]]:
    """The outside's offloads of candidates (not in ``names``) as pinned candidates of a window's or a block's
    model, each with the plan's own release (where a copy the plan never waits for has ``landed``) and prefetch
    as its only option, due back before the first outside chain that reads it: (those candidates, their
    choices, the outside decisions left for the base memory). Why: their copies share the two copy streams
    with the window's, and a model that did not time them saw free streams: on GPT-2-48 in bf16-mixed at 0.35
    (211 tensors swapped) a layer's model swapped six more tensors for a predicted 0.7 ms gain, and the
    whole step ran 12 ms slower."""
    idx = problem.op_index
    by_name = {c.name: c for c in cands if c.name not in names}
    read_by = read_by_chains(problem, outside)
    pinned_cands, pinned = [], {}
    for d in outside:
        c = by_name.get(getattr(d, "tensor", ""))
        if c is None or not isinstance(d, Offload):
            continue
        due = min(c.first_bwd, read_by.get(c.name, c.first_bwd))
        prefetch = min(idx(d.prefetch_at), due)
        release = idx(d.release_before) if d.release_before else landed.get(c.name, c.releases[-1])
        release = max(min(release, prefetch), c.last_fwd + 1)
        if release > prefetch:
            continue  # not a copy the model can time: its bytes stay in the base
        pinned[c.name] = Choice.offload(release, prefetch)
        pinned_cands.append(dataclasses.replace(c, first_bwd=due, releases=[release], prefetches=[prefetch],
                                                chain=None, needs_kept=[], extends=[], segments=(), reading=(),
                                                queued_at=prefetch, before_chains=c.name in read_by
                                                and read_by[c.name] <= c.first_bwd))
    rest = tuple(d for d in outside if not (isinstance(d, Offload) and d.tensor in pinned))
    return pinned_cands, pinned, rest


def chains_before(problem: Problem, costs: Costs, decisions: Sequence[Decision]) -> dict[int, float]:
    """Op index -> the price (``Costs.rebuild_us``) of ``decisions``' recompute chains that run before it: the
    pinned surroundings of a model run them whatever it decides, and a model that left them out timed GPT-2-48's
    step at 206 ms where the simulator ran it in 246 ms, so copies looked slow beside compute that was missing."""
    out: dict[int, float] = {}
    for d in decisions:
        if isinstance(d, Recompute):
            at = problem.op_index(d.reload_before)
            out[at] = out.get(at, 0.0) + sum(costs.rebuild_us(problem, problem.op_index(o)) for o in d.ops)
    return out


def pinned_model(problem: Problem, costs: Costs, budget_bytes: int, current: tuple[Decision, ...],
                 cands: list[Candidate], names: set[str], outside: Sequence[Decision], landed: dict[str, int],
                 unit: int | None) -> tuple[Model, dict[str, Choice]]:
    """The exact model over the candidates named ``names`` (their choices free, ``Model.free``) with
    ``outside``, the rest of ``current``, pinned: its offloads of candidates as pinned candidates, its chains
    timed, the rest of its bytes the base memory; and ``current``'s own choices as the model's start. The
    windows and the block pass both solve it. ``landed``: where ``current``'s copies out have landed; ``unit``
    the memory unit (``None``: ``solver_units``'s, as the planner takes it)."""
    if unit is None:
        unit = solver_units(problem, lambda: timeline_of(problem, costs, ()).peak_bytes)[0]
    wcands = window_candidates(problem, [c for c in cands if c.name in names], outside)
    pinned_cands, pinned, rest = pin_outside_copies(problem, cands, names, outside, landed)
    base = per_op_memory(problem, timeline_of(problem, costs, rest))
    model = Model(problem, costs, budget_bytes, base, wcands + pinned_cands, unit, pinned=pinned,
                  fixed_chains_us=chains_before(problem, costs, rest))
    incumbent = Plan(strategy="incumbent", budget_bytes=budget_bytes, decisions=current)
    start = {**choices_from_plan(problem, wcands, incumbent, allow_offload=costs.allow_offload, landed=landed),
             **pinned}
    return model, start


MAX_ROUNDS = 3
"""Under a deadline, the windows go round again while a round improved the plan and time is left, each round's
windows shifted by half a window from the last one's (a choice that spans two windows gets one of its own).
Why: with 30 s per plan, WRN-28-10 in bf16-mixed at 0.35 finished its four windows in 20 s, every one of them
faster; without a deadline one round keeps the planning time bounded."""


def refine_in_windows(problem: Problem, costs: Costs, budget_bytes: int, incumbent: tuple[Decision, ...],
                      incumbent_us: float, cands: list[Candidate], *, size: int, max_windows: int,
                      options: SolverOptions) -> tuple[tuple[Decision, ...], list[str]]:
    """Re-solve up to ``max_windows`` windows of ``size`` candidates, the last-produced first (their tensors
    are the ones alive at the forward/backward turn, where the peak is), around ``incumbent`` (simulated step
    ``incumbent_us``), in rounds (``MAX_ROUNDS``); return the improved decisions and a note per window."""
    # the incumbent's own groups and copy points become choices (it may come from the block pass, whose
    # copied plans the heuristics' choices do not cover): without them the windows around a ResNet-200 block
    # plan were skipped as inexpressible
    landed = copies_landed(problem, costs, incumbent)  # of ``current``: recomputed when a window improves it
    attach_plan_choices(problem, cands, incumbent, landed)
    ordered = sorted(cands, key=lambda c: (c.producer, c.name))
    current, best_us = incumbent, incumbent_us
    notes: list[str] = []
    rounds = MAX_ROUNDS if math.isfinite(progress.seconds_left()) else 1
    for round_ in range(rounds):
        shift = (size // 2) * (round_ % 2)
        ends = list(range(len(ordered) - shift, 0, -size))[:max_windows]
        improved = False
        for k, end in enumerate(ends):
            if progress.past_deadline():
                notes.append(f"{len(ends) - k} of {len(ends)} windows skipped: out of time")
                return current, notes
            start = max(0, end - size)
            progress.report(f"solver window {k + 1} of {len(ends)}" + (f", round {round_ + 1}" if round_ else ""))
            label = f"window over tensors {start}-{end - 1}" + (f" (round {round_ + 1})" if round_ else "")
            trial, why = _solve_window(problem, costs, budget_bytes, current, landed, ordered, ordered[start:end],
                                       options)
            if trial is None:
                notes.append(f"{label}: {why}")
                continue
            tl = figures_of(problem, costs, trial)
            if tl.peak_bytes <= budget_bytes and tl.makespan_us < best_us - 1e-6:
                notes.append(f"{label}: faster, {best_us / 1e3:.3f} -> {tl.makespan_us / 1e3:.3f} ms")
                current, best_us, improved = trial, tl.makespan_us, True
                landed = copies_landed(problem, costs, current)
                attach_plan_choices(problem, cands, current, landed)  # the next windows pin its copies as they are
            else:
                notes.append(f"{label}: no faster plan")
        if not improved:
            break
    return current, notes


def _solve_window(problem: Problem, costs: Costs, budget_bytes: int, current: tuple[Decision, ...],
                  landed: dict[str, int], ordered: list[Candidate], chosen: list[Candidate],
                  options: SolverOptions) -> tuple[tuple[Decision, ...] | None, str]:
    """The window over ``chosen`` (grown to whole rebuilt groups) solved around ``current`` (whose copies out
    have ``landed``): (the whole plan with the window's decisions, ""), or (``None``, why not)."""
    names = _whole_groups(current, {c.name for c in chosen}, {c.name for c in ordered})
    outside = tuple(d for d in current if not (_moved(d) & names))
    model, start = pinned_model(problem, costs, budget_bytes, current, ordered, names, outside, landed,
                                options.memory_unit_bytes)
    # the local search first (milliseconds a timing): from the incumbent, or from where one change makes it
    # expressible (a prefetch the model's issue order moved, ...)
    _, _, hint = descend(model, start, allow_offload=costs.allow_offload)
    if hint is None:
        return None, "skipped, the solver cannot express the current plan there"
    result = model.solve(options, hint)
    if result is None:
        return None, "the solver found nothing in its time limit"
    _, choices, _, _ = result
    try:
        trial = reconcile(problem, list(outside) + list(model.decisions(choices)))
        figures_of(problem, costs, trial)
    except (InvalidPlanError, ValueError) as exc:
        return None, f"the solver's plan does not run in the simulator ({exc})"
    return trial, ""
