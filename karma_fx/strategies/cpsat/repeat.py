"""The exact planner where the step is too big for one model but made of repeated blocks (``blocks.py``).

Why: past a few hundred candidates the whole-graph CP-SAT models do not finish, but a transformer layer or a
ResNet bottleneck has a dozen saved tensors. For each group of identical blocks, one representative (the last
one, nearest the forward/backward turn where the peak is) is solved at tensor level by the exact model
(keep / offload with its copy timing / recompute), everything outside it pinned to the incumbent plan, so its
memory allowance at every op is the budget minus what the rest of the step holds there, and its copies queue
with the rest's (``window.pin_outside_copies``). Its decisions are copied to every block of the group by
relative position, the whole plan is simulated, and it replaces the incumbent only if it fits and is faster.
When copying into every block overshoots the budget (the representative was solved against the incumbent's
other blocks, which then change), the copies go into each half of the group, recursively, wherever they fit:
the repair across block boundaries. The simulator has the last word, so this never returns a plan worse than
the incumbent it was given.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Decision
from karma_fx.problem import Problem
from karma_fx.strategies.base import copies_landed, figures_of, reconcile
from karma_fx.strategies.cpsat.blocks import Block, BlockGroup, find_groups, replicate, touches
from karma_fx.strategies.cpsat.descent import descend
from karma_fx.strategies.cpsat.exact import leanest_choices
from karma_fx.strategies.cpsat.model import Candidate
from karma_fx.strategies.cpsat.options import SolverOptions
from karma_fx.strategies.cpsat.segments import attach_plan_choices
from karma_fx.strategies.cpsat.window import pinned_model


@dataclass
class BlockResult:
    """What the block pass did: the decisions, their simulated step time, and per group whether its
    representative's model was solved to optimality (for that sub-problem: its block's tensors, the rest
    of the step pinned) and whether its copies made it into the plan."""

    decisions: tuple[Decision, ...]
    step_us: float
    blocks_total: int = 0
    blocks_proven: int = 0
    blocks_replicated: int = 0
    notes: list[str] = field(default_factory=list)


def representative(group: BlockGroup) -> Block:
    """The middle block: the first and last ones sit next to the embedding or the head, whose release and
    prefetch points differ from the bulk's."""
    return group.blocks[len(group.blocks) // 2]


def _solve_representative(problem: Problem, costs: Costs, budget_bytes: int, current: tuple[Decision, ...],
                          landed: dict[str, int], group: BlockGroup, cands: list[Candidate],
                          options: SolverOptions) -> tuple[str, tuple[Decision, ...]] | None:
    """The representative's best decisions with the rest of ``current`` pinned: (CP-SAT status, decisions), or
    ``None`` when the model finds none. ``landed``: where ``current``'s copies out landed."""
    rep = representative(group)
    names = set(rep.saved)
    if not any(c.name in names for c in cands):
        return None
    outside = tuple(d for d in current if not touches(problem, d, rep))
    model, start = pinned_model(problem, costs, budget_bytes, current, cands, names, outside, landed,
                                options.memory_unit_bytes)
    if model.evaluate(start)[0] is None:
        start = {**leanest_choices(model.free, costs.allow_offload), **model.pinned}
    _, _, hint = descend(model, start, allow_offload=costs.allow_offload)
    if progress.past_deadline():
        return None
    limit = options.effort_s(len(model.free), options.block_seconds_per_candidate)
    result = model.solve(SolverOptions(limit, options.workers, options.seed), hint)
    if result is None:
        return None
    status, choices, _, _ = result
    return status, model.decisions(choices)


MAX_COPY_TRIALS = 32
"""Past this many simulated trials per group, the copies go into halves level by level (the largest chunks
first) and stop there. Why: the full recursion tries up to 2m-1 subsets of m blocks; on ResNet-1001 at real
size (a group of 327 bottlenecks, ~0.1 s per simulation) it took 434 trials and 42 s to copy one block (0.01%
faster), while every group of the tiny zoo has at most 5 blocks (9 trials) and keeps the full recursion."""


def _try_copy(problem: Problem, costs: Costs, budget_bytes: int, group: BlockGroup, solved: tuple[Decision, ...],
              out: "BlockResult", targets: list[Block]) -> bool:
    """Copy ``solved`` into ``targets`` if the whole plan then fits and is faster (then ``out`` takes it)."""
    try:
        trial = reconcile(problem, replicate(problem, group, representative(group), solved, out.decisions, targets))
        tl = figures_of(problem, costs, trial)
    except (InvalidPlanError, ValueError):
        return False
    if tl.peak_bytes <= budget_bytes and tl.makespan_us < out.step_us - 1e-6:
        out.decisions, out.step_us = trial, tl.makespan_us
        return True
    return False


def _copy_into(problem: Problem, costs: Costs, budget_bytes: int, group: BlockGroup,
               solved: tuple[Decision, ...], out: "BlockResult", targets: list[Block]) -> int:
    """Copy ``solved`` into ``targets`` if the whole plan then fits and is faster; otherwise into each half of
    them, recursively (the copies fit where the incumbent's other blocks leave room: a plan that frees more
    early and less late keeps its early blocks). Returns how many blocks took the copy. Past
    ``MAX_COPY_TRIALS`` possible trials, the halves are tried level by level, at most that many trials."""
    if 2 * len(targets) - 1 > MAX_COPY_TRIALS:
        return _copy_by_levels(problem, costs, budget_bytes, group, solved, out, targets)
    if not targets or progress.past_deadline():
        return 0
    if _try_copy(problem, costs, budget_bytes, group, solved, out, targets):
        return len(targets)
    if len(targets) == 1:
        return 0
    half = len(targets) // 2
    return (_copy_into(problem, costs, budget_bytes, group, solved, out, targets[:half])
            + _copy_into(problem, costs, budget_bytes, group, solved, out, targets[half:]))


def _copy_by_levels(problem: Problem, costs: Costs, budget_bytes: int, group: BlockGroup,
                    solved: tuple[Decision, ...], out: "BlockResult", targets: list[Block]) -> int:
    """``_copy_into``'s halving, breadth first (every half before any quarter), at most ``MAX_COPY_TRIALS``
    trials: a capped search should spend its trials on large chunks, not on the first half's single blocks.
    The first trial is the representative alone, the block the solver planned with everything else as it is:
    when even that copy is no faster, the copies elsewhere (the same block in much the same surroundings)
    will not be either, and the group costs one simulation instead of ``MAX_COPY_TRIALS``."""
    rep = representative(group)
    copied = trials = 0
    if rep in targets:
        trials = 1
        if not _try_copy(problem, costs, budget_bytes, group, solved, out, [rep]):
            return 0
        copied = 1
        targets = [b for b in targets if b != rep]
    queue: deque[list[Block]] = deque([targets] if targets else [])
    while queue and trials < MAX_COPY_TRIALS and not progress.past_deadline():
        chunk = queue.popleft()
        trials += 1
        if _try_copy(problem, costs, budget_bytes, group, solved, out, chunk):
            copied += len(chunk)
        elif len(chunk) > 1:
            half = len(chunk) // 2
            queue.extend((chunk[:half], chunk[half:]))
    return copied


def plan_by_blocks(problem: Problem, costs: Costs, budget_bytes: int, incumbent: tuple[Decision, ...],
                   incumbent_us: float, cands: list[Candidate], options: SolverOptions) -> BlockResult:
    """Improve ``incumbent`` (simulated ``incumbent_us``, fitting ``budget_bytes``) group by group, the
    largest group first; stops at the deadline of the call (``progress``)."""
    groups = find_groups(problem, decisions=incumbent)  # blocks that take the incumbent's rebuilt groups whole
    # the incumbent's own groups and copy points are choices of the blocks' models, so each starts from it
    landed, landed_of = copies_landed(problem, costs, incumbent), incumbent
    attach_plan_choices(problem, cands, incumbent, landed)
    out = BlockResult(incumbent, incumbent_us, blocks_total=sum(len(g.blocks) for g in groups))
    if not groups:
        out.notes.append("no repeated blocks found")
        return out
    out.notes.append(f"{len(groups)} groups of identical blocks ("
                     + ", ".join(f"{len(g.blocks)} x {g.size} ops" for g in groups) + ")")
    for k, group in enumerate(groups):
        if progress.past_deadline():
            out.notes.append(f"{len(groups) - k} groups skipped: out of time")
            break
        progress.report(f"solver, block group {k + 1} of {len(groups)}")
        label = f"block group {k + 1} ({len(group.blocks)} x {group.size} ops)"
        if out.decisions is not landed_of:  # a group's copies changed the plan
            landed, landed_of = copies_landed(problem, costs, out.decisions), out.decisions
        solved = _solve_representative(problem, costs, budget_bytes, out.decisions, landed, group, cands, options)
        if solved is None:
            out.notes.append(f"{label}: the solver found nothing")
            continue
        status, decisions = solved
        before = out.step_us
        copied = _copy_into(problem, costs, budget_bytes, group, decisions, out, list(group.blocks))
        out.blocks_replicated += copied
        out.blocks_proven += copied if status == "OPTIMAL" else 0
        out.notes.append(f"{label}: {status.lower()} for its block, copied into {copied} of {len(group.blocks)}: "
                         f"{before / 1e3:.3f} -> {out.step_us / 1e3:.3f} ms")
    return out
