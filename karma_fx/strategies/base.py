"""What every strategy is and the building blocks they share.

A strategy is any callable ``(problem, costs, budget_bytes) -> Plan`` with a ``name``; it returns decisions
and a status, and leaves the simulated figures to ``karma_fx.simulate`` so all strategies are judged alike.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, NamedTuple, Protocol, Sequence, TypeVar, runtime_checkable

from karma_fx.costs import Costs
from karma_fx.dependencies import dependency_graph, recompute_ops
from karma_fx.plan import Decision, Offload, Plan, Recompute
from karma_fx.problem import Problem, Storage
from karma_fx.simulate import Timeline, decisions_as_run, peak_and_makespan, simulate


T = TypeVar("T")


@runtime_checkable
class Strategy(Protocol):
    name: str

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan: ...


@dataclass(frozen=True)
class Gap:
    """Where a saved activation is idle: after its last forward read, until its first backward read."""

    storage: Storage
    last_fwd_use: int
    first_bwd_use: int


def saved_gaps(problem: Problem) -> list[Gap]:
    """One gap per saved activation, in production order."""
    gaps = []
    for s in problem.saved_activations():
        fwd = [u for u in s.users if u < problem.num_fwd_ops]
        bwd = [u for u in s.users if u >= problem.num_fwd_ops]
        gaps.append(Gap(storage=s, last_fwd_use=max(fwd, default=s.producer), first_bwd_use=min(bwd)))
    return gaps


def offload_for(problem: Problem, gap: Gap, prefetch_at: int | None = None, *,
                release: bool | int = False) -> Offload:
    """Offload right after production, drop after the last forward read, prefetch at ``prefetch_at``.

    ``release``: ``True`` waits for the copy right after the last forward read; an op index waits before
    that op (clamped into the gap); ``False`` never waits.
    """
    ops = problem.ops
    producer = gap.storage.producer if gap.storage.producer is not None else 0
    pf = gap.first_bwd_use if prefetch_at is None else max(gap.last_fwd_use + 1, min(prefetch_at, gap.first_bwd_use))
    release_before = None
    if release is not False:
        at = gap.last_fwd_use + 1 if release is True else int(release)
        release_before = ops[max(gap.last_fwd_use + 1, min(at, pf))].name
    return Offload(tensor=gap.storage.name, offload_after=ops[producer].name, free_after=ops[gap.last_fwd_use].name,
                   prefetch_at=ops[pf].name, reload_before=ops[gap.first_bwd_use].name, release_before=release_before)


class RecomputeBuilder:
    """Builds ``Recompute`` decisions for groups of dropped activations, sharing one dependency graph."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.graph = dependency_graph(problem)

    def group(self, dropped: list[Gap], dropped_names: set[str]) -> Recompute:
        """Rebuild ``dropped`` together before the first backward read of any of them.

        Everything not in ``dropped_names`` counts as resident; every rebuilt activation that the chain makes
        and that was dropped is listed, so it is rebuilt once and kept until its last read.
        """
        problem = self.problem
        reload = min(g.first_bwd_use for g in dropped)
        resident = ResidentAt(problem, reload, excluding=dropped_names)
        targets = [g.storage.name for g in dropped]
        chain = recompute_ops(problem, targets, resident, self.graph)
        made = {s for i in chain for s in problem.ops[i].outputs}
        tensors = tuple(sorted(made & dropped_names, key=lambda n: (problem.storage(n).producer or 0, n)))
        return Recompute(tensors=tensors, ops=tuple(problem.ops[i].name for i in chain),
                         reload_before=problem.ops[reload].name)


class ResidentAt:
    """The storages a recompute chain before ``op`` may read, as a lazy set (``name in resident``).

    Resident: what the unplanned step still holds at ``op`` (a forward-only temporary such as the pre-softmax
    scores is gone by then and must be rebuilt too; reading it would stretch its life across the step), plus
    outputs of random or mutating ops, which cannot be rebuilt (a chain that needs one keeps it alive);
    minus ``excluding`` (what the plan drops). Lazy, because a strategy asks this for thousands of reloads.
    """

    def __init__(self, problem: Problem, op: int, excluding: set[str] | frozenset[str] = frozenset()) -> None:
        self.problem, self.op, self.excluding = problem, op, excluding

    def __contains__(self, name: object) -> bool:
        if name in self.excluding or not isinstance(name, str):
            return False
        s = self.problem.storage(name)
        return _alive_at(s, self.op) or (s.producer is not None and not self.problem.ops[s.producer].recomputable)


def _alive_at(s: Storage, op: int) -> bool:
    """Whether the unplanned step holds ``s`` when ``op`` runs."""
    if s.producer is None:
        return True
    return s.producer < op and (s.lives_to_end or (bool(s.users) and s.users[-1] >= op))


def blocks_from_cuts(problem: Problem, count: int) -> list[tuple[int, int]]:
    """Split the forward into about ``count`` blocks of similar size at cut points: ``[(first_op, last_op)]``."""
    n = problem.num_fwd_ops
    cuts = [c for c in problem.cut_points if c < n - 1]
    if n == 0:
        return []
    if not cuts or count <= 1:
        return [(0, n - 1)]
    bounds: list[int] = []
    target = n / count
    next_mark = target
    for c in cuts:
        if c + 1 >= next_mark:
            bounds.append(c)
            next_mark = c + 1 + target
    blocks, start = [], 0
    for b in bounds:
        if b >= start:
            blocks.append((start, b))
            start = b + 1
    if start <= n - 1:
        blocks.append((start, n - 1))
    return blocks


def block_inputs(problem: Problem, blocks: list[tuple[int, int]]) -> set[str]:
    """What a block-wise plan keeps so that each block is rebuilt from its own input: the outputs of every
    block's last op, and where none of those is a saved activation, the saved outputs of the forward ops that
    read them. Why: a ResNet block ends with its residual add, which the backward reads only through the relu
    that starts the next block, so the add's output is freed in the forward and a chain that starts from it
    first rebuilds the previous block's last convolution, batch norm and add. Keeping the relu's output (the
    same bytes) keeps every chain inside its block: the checkpoint strategy on ResNet-50 (bf16-mixed, real size,
    H100 preset) went from 1.445x to 1.285x the unlimited step at 0.35 of the unplanned peak, its peak from 3.67
    to 3.56 GiB; ResNet-200's from 1.382x to 1.318x."""
    saved = {s.name for s in problem.saved_activations()}
    kept: set[str] = set()
    for _, last in blocks:
        kept |= block_input_after(problem, last, saved)
    return kept


def block_input_after(problem: Problem, last: int, saved: set[str]) -> set[str]:
    """``block_inputs`` for the one block ending at op ``last`` (``saved``: the saved activations' names)."""
    outs = set(problem.ops[last].outputs)
    if outs & saved:
        return outs
    kept = set(outs)
    for o in outs:
        for u in problem.storage(o).users:
            if u < problem.num_fwd_ops:
                kept |= {x for x in problem.ops[u].outputs if x in saved}
    return kept


def pick_best(problem: Problem, costs: Costs, budget_bytes: int,
              options: Iterable[tuple[Sequence[Decision], T]]) -> tuple[tuple[Decision, ...], T]:
    """The option that fits the budget fastest, or, if none fits, the one with the lowest peak (then fastest).

    Each option is (decisions, label); every one is judged by the simulator.
    """
    best: tuple[tuple[int, float, float], tuple[Decision, ...], T] | None = None
    for decisions, label in options:
        tl = figures_of(problem, costs, decisions)
        fits = tl.peak_bytes <= budget_bytes
        key = (0, tl.makespan_us, 0.0) if fits else (1, float(tl.peak_bytes), tl.makespan_us)
        if best is None or key < best[0]:
            best = (key, tuple(decisions), label)
    if best is None:
        raise ValueError("pick_best needs at least one option")
    return best[1], best[2]


def timeline_of(problem: Problem, costs: Costs, decisions: tuple[Decision, ...] | list[Decision]) -> Timeline:
    """The simulator's figures for ``decisions`` (without the per-op schedule rows a report needs)."""
    return simulate(problem, tuple(decisions), costs, detail=False)


def judged_figures(problem: Problem, costs: Costs, decisions: tuple[Decision, ...] | list[Decision],
                   budget_bytes: int) -> Figures:
    """The simulator's figures for ``decisions`` as the plan is run (``simulate.decisions_as_run``, as
    ``Prepared.judge`` runs it): its swap-outs waited for where they land, and its recompute chains joined by
    the backward's loops where the step is Inductor's and the plan still fits. The
    planner compares its candidate plans by these, so a plan whose rebuilds the backward's loops fuse is
    credited with the time it saves there (``Costs.rebuild_us``), as it is when judged."""
    decisions = tuple(decisions)
    plain = figures_of(problem, costs, decisions)
    if not problem.loop_ops or not any(isinstance(d, Recompute) and any(op in costs.share_of for op in d.ops)
                                       for d in decisions):
        return plain  # no join would make this plan faster
    run = decisions_as_run(problem, decisions, costs, budget_bytes,
                           lambda ds: figures_of(problem, costs, ds).peak_bytes)
    return plain if run == decisions else figures_of(problem, costs, run)


def copies_landed(problem: Problem, costs: Costs, decisions: tuple[Decision, ...] | list[Decision]) -> dict[str, int]:
    """For each offload that never waits for its copy out (``release_before`` unset): the first op of the step
    that starts once that copy has landed, under ``decisions`` (where the simulator frees its device bytes).
    Waiting for the copy there frees them at the same op without stalling: the release a model with fixed
    release points needs to express such a plan."""
    timeline = timeline_of(problem, costs, decisions)
    ops = [iv for iv in timeline.compute if iv.kind == "op"]
    starts = [iv.start_us for iv in ops]
    landed_at = {iv.label: iv.end_us for iv in timeline.d2h if iv.kind == "offload"}
    out: dict[str, int] = {}
    for d in decisions:
        if isinstance(d, Offload) and d.release_before is None and d.tensor in landed_at:
            k = bisect.bisect_left(starts, landed_at[d.tensor] - 1e-9)
            if k < len(ops):
                out[d.tensor] = problem.op_index(ops[k].label)
    return out


class Figures(NamedTuple):
    """A plan's simulated peak and step time: all a probe asks of the simulator."""

    peak_bytes: int
    makespan_us: float


FIGURES_CACHE = 64
"""How many recent (problem, costs, decisions) → figures ``figures_of`` remembers."""
_figures: "OrderedDict[tuple[Decision, ...], tuple[Problem, Costs, Figures]]" = OrderedDict()


def figures_of(problem: Problem, costs: Costs, decisions: tuple[Decision, ...] | list[Decision]) -> Figures:
    """The simulator's peak and step time for ``decisions``: the same numbers as ``timeline_of``, without the
    per-op intervals and memory profile (on ResNet-1001 a third less work per probe).

    The last ``FIGURES_CACHE`` answers are remembered (a replay is deterministic, and problems and costs are
    frozen): karma's seven granularities all probe the empty plan, and cpsat replays every fallback's final
    plan, which that fallback has just simulated; on ResNet-1001 each replay is ~0.1 s. An entry holds its
    problem and costs, so their ids cannot be reused while it is kept."""
    decisions = tuple(decisions)
    hit = _figures.get(decisions)
    if hit is not None and hit[0] is problem and hit[1] is costs:
        _figures.move_to_end(decisions)
        return hit[2]
    found = Figures(*peak_and_makespan(problem, decisions, costs))
    _figures[decisions] = (problem, costs, found)
    _figures.move_to_end(decisions)
    while len(_figures) > FIGURES_CACHE:
        _figures.popitem(last=False)
    return found


def chain_reads(problem: Problem, decision: Recompute) -> set[str]:
    """The storages a recompute chain's ops read that the chain does not make itself."""
    ops = [problem.ops[problem.op_index(name)] for name in decision.ops]
    return {i for op in ops for i in op.inputs} - {o for op in ops for o in op.outputs}


def read_by_chains(problem: Problem, decisions: Iterable[Decision]) -> dict[str, int]:
    """Storage -> the earliest op before which a recompute chain of ``decisions`` reads it (from outside the
    chain)."""
    needed_by: dict[str, int] = {}
    for d in decisions:
        if isinstance(d, Recompute):
            at = problem.op_index(d.reload_before)
            for s in chain_reads(problem, d):
                needed_by[s] = min(needed_by.get(s, at), at)
    return needed_by


def per_op_memory(problem: Problem, timeline: Timeline) -> list[int]:
    """Device bytes at every op of the step, a recompute chain's steps counted at the op it serves (whichever of
    the op and the rebuilds just before it holds more)."""
    out = [0] * len(problem.ops)
    pending = 0
    items = (iv for iv in timeline.compute if iv.kind in ("op", "recompute"))  # not stalls, not copy issues
    for interval, (_, live) in zip(items, timeline.memory):
        if interval.kind == "recompute":
            pending = max(pending, live)
        else:
            i = problem.op_index(interval.label)
            out[i], pending = max(live, pending), 0
    return out


def reconcile(problem: Problem, decisions: tuple[Decision, ...] | list[Decision]) -> tuple[Decision, ...]:
    """Make offloads and recomputes agree: an offloaded tensor that a recompute chain reads is back (and
    waited for) before that chain, not only before its own first backward read."""
    op_index = problem.op_index
    needed_by = read_by_chains(problem, decisions)
    out: list[Decision] = []
    for d in decisions:
        if isinstance(d, Offload) and d.tensor in needed_by and needed_by[d.tensor] < op_index(d.reload_before):
            at = needed_by[d.tensor]
            if at <= op_index(d.free_after):
                raise ValueError(f"{d.tensor} is needed by a recompute before it could be offloaded")
            prefetch = min(op_index(d.prefetch_at), at)
            release = d.release_before
            if release is not None and op_index(release) > prefetch:
                release = problem.ops[prefetch].name
            d = replace(d, prefetch_at=problem.ops[prefetch].name, reload_before=problem.ops[at].name,
                        release_before=release)
        out.append(d)
    return tuple(out)
