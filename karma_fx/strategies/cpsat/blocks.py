"""Repeated blocks of a training step: found once, so a plan solved for one block can be copied to the others.

Why: a transformer's layers and a ResNet's bottlenecks are the same computation over and over, so the
tensor-level choices that are best for one are a strong guess for every copy, and one model of a block is
small enough for CP-SAT where a model of the whole step is not. A block is the stretch of forward ops between
two consecutive cut points; two blocks are *identical* when their ops, their tensors' sizes, the relative
positions of producers and readers, and the backward reads of their saved activations (relative to the
block's first backward read) all match. Identical blocks differ only by two shifts, one for forward op
indices and one for backward op indices, which is how a decision is mapped from one to the other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Sequence

from karma_fx.plan import Decision, Offload, Recompute
from karma_fx.problem import Problem


@dataclass(frozen=True)
class Block:
    """Forward ops ``[start, stop]`` and the first backward op reading any of their saved activations."""

    start: int
    stop: int
    bwd_anchor: int
    saved: tuple[str, ...]
    """The block's saved activations in production order (what a plan decides on)."""


@dataclass(frozen=True)
class BlockGroup:
    """Identical blocks, in forward order."""

    blocks: tuple[Block, ...]

    @property
    def size(self) -> int:
        return self.blocks[-1].stop - self.blocks[-1].start + 1


def segments(problem: Problem) -> list[tuple[int, int]]:
    """The forward split at every cut point: ``[(first op, last op)]``."""
    out, start = [], 0
    for c in sorted(problem.cut_points):
        if start <= c < problem.num_fwd_ops:
            out.append((start, c))
            start = c + 1
    if start < problem.num_fwd_ops:
        out.append((start, problem.num_fwd_ops - 1))
    return out


def _saved_by_producer(problem: Problem) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for s in problem.saved_activations():
        out.setdefault(s.producer or 0, []).append(s.name)
    return out


def _saved_in(by_producer: dict[int, list[str]], start: int, stop: int) -> list[str]:
    return [n for i in range(start, stop + 1) for n in by_producer.get(i, ())]


def signature(problem: Problem, start: int, stop: int,
              by_producer: dict[int, list[str]] | None = None) -> tuple[Hashable, int] | None:
    """The block's structure with every index relative to the block (forward) or its first backward read
    (backward), and that anchor; ``None`` when the block saves nothing (nothing to plan there)."""
    nf = problem.num_fwd_ops
    names = _saved_in(by_producer if by_producer is not None else _saved_by_producer(problem), start, stop)
    if not names:
        return None
    saved = [problem.storage(n) for n in names]
    anchor = min(u for s in saved for u in s.users if u >= nf)
    fwd = []
    for i in range(start, stop + 1):
        op = problem.ops[i]
        ins = []
        for name in op.inputs:
            s = problem.storage(name)
            if s.producer is not None and start <= s.producer <= stop:
                ins.append(("i", s.producer - start, problem.ops[s.producer].outputs.index(name)))
            else:
                ins.append(("x", s.kind, s.size_bytes))
        outs = tuple((problem.storage(o).size_bytes,
                      tuple(u - start if u < nf else ("b", u - anchor) for u in problem.storage(o).users))
                     for o in op.outputs)
        fwd.append((op.target, op.recomputable, tuple(ins), outs))
    bwd = tuple(problem.ops[u].target for s in saved for u in s.users if u >= nf)
    return (tuple(fwd), bwd), anchor


MAX_PERIOD = 4
"""Blocks are made of up to this many consecutive segments. Why: a cut point splits a transformer layer into
its attention and its MLP half, and greedy rebuilds a layer's tail across that cut (the attention's residual
sum with the MLP's inputs); with half-layer blocks, taking such a group out of one block left its other half
kept, over the budget, so the block models of GPT-2-48 were infeasible and found nothing."""


def _groups_of(problem: Problem, spans: list[tuple[int, int]], by_producer: dict[int, list[str]],
               min_count: int) -> list[BlockGroup]:
    by_sig: dict[Hashable, list[Block]] = {}
    for start, stop in spans:
        sig = signature(problem, start, stop, by_producer)
        if sig is None:
            continue
        key, anchor = sig
        by_sig.setdefault(key, []).append(Block(start, stop, anchor, tuple(_saved_in(by_producer, start, stop))))
    groups = [BlockGroup(tuple(bs)) for bs in by_sig.values() if len(bs) >= min_count]
    return sorted(groups, key=lambda g: (-len(g.blocks), g.blocks[0].start))


def straddling(groups: Sequence[BlockGroup], decisions: Sequence[Decision]) -> int:
    """How many of ``decisions``' rebuilt groups span more than one block, or a block and what lies outside
    the groups' blocks: those a block model cannot take whole."""
    home = {t: k for k, b in enumerate(b for g in groups for b in g.blocks) for t in b.saved}
    cut = 0
    for d in decisions:
        if isinstance(d, Recompute) and len(d.tensors) > 1:
            where = {home.get(t) for t in d.tensors}
            cut += len(where) > 1
    return cut


def find_groups(problem: Problem, min_count: int = 2, decisions: Sequence[Decision] = ()) -> list[BlockGroup]:
    """Groups of at least ``min_count`` identical blocks, the largest first. A block belongs to one group;
    blocks are never nested. A block is one segment between consecutive cut points, or ``period`` of them in
    a row from some ``phase``: the shortest period (and its phase) whose blocks split the fewest of the
    groups that ``decisions`` (the incumbent plan) rebuild together."""
    by_producer = _saved_by_producer(problem)
    segs = segments(problem)
    best: tuple[tuple[int, int], list[BlockGroup]] | None = None
    for period in range(1, MAX_PERIOD + 1):
        for phase in range(min(period, len(segs))):
            spans = [(segs[i][0], segs[min(i + period, len(segs)) - 1][1]) for i in range(phase, len(segs), period)]
            groups = _groups_of(problem, spans, by_producer, min_count)
            if not groups:
                continue
            key = (straddling(groups, decisions), period)
            if best is None or key < best[0]:
                best = (key, groups)
        if best is not None and best[0][0] == 0:
            break
    return best[1] if best is not None else []


class BlockMap:
    """Op and storage names of block ``src`` translated to the matching ones of block ``dst``: forward ops by
    the forward shift, backward ops by the shift of the first backward reads, storages by their producer and
    output position. A name with no counterpart (outside the step, or a different op there) maps to ``None``."""

    def __init__(self, problem: Problem, src: Block, dst: Block) -> None:
        self.problem, self.src, self.dst = problem, src, dst
        self.fwd_shift = dst.start - src.start
        self.bwd_shift = dst.bwd_anchor - src.bwd_anchor

    def op(self, name: str | None) -> str | None:
        if name is None:
            return None
        p = self.problem
        i = p.op_index(name)
        j = i + (self.fwd_shift if i < p.num_fwd_ops else self.bwd_shift)
        lo, hi = (0, p.num_fwd_ops) if i < p.num_fwd_ops else (p.num_fwd_ops, len(p.ops))
        if not lo <= j < hi or p.ops[j].target != p.ops[i].target:
            return None
        return p.ops[j].name

    def storage(self, name: str) -> str | None:
        p = self.problem
        s = p.storage(name)
        if s.producer is None:
            return None
        op = self.op(p.ops[s.producer].name)
        if op is None:
            return None
        k = p.ops[s.producer].outputs.index(name)
        outs = p.ops[p.op_index(op)].outputs
        if k >= len(outs) or p.storage(outs[k]).size_bytes != s.size_bytes:
            return None
        return outs[k]

    def decision(self, d: Decision) -> Decision | None:
        """``d`` as block ``dst`` would make it, or ``None`` if some part of it has no counterpart."""
        if isinstance(d, Offload):
            fields = dict(tensor=self.storage(d.tensor), offload_after=self.op(d.offload_after),
                          free_after=self.op(d.free_after), prefetch_at=self.op(d.prefetch_at),
                          reload_before=self.op(d.reload_before))
            release = self.op(d.release_before)
            if None in fields.values() or (d.release_before is not None and release is None):
                return None
            return replace(d, release_before=release, **fields)
        if isinstance(d, Recompute):
            tensors = tuple(self.storage(t) for t in d.tensors)
            ops = tuple(self.op(o) for o in d.ops)
            reload = self.op(d.reload_before)
            if None in tensors or None in ops or reload is None:
                return None
            return replace(d, tensors=tensors, ops=ops, reload_before=reload)
        return None


def touches(problem: Problem, d: Decision, block: Block) -> bool:
    """Whether ``d`` decides on one of ``block``'s saved activations."""
    names = set(block.saved)
    tensors = d.tensors if isinstance(d, Recompute) else (getattr(d, "tensor", None),)
    return any(t in names for t in tensors)


def replicate(problem: Problem, group: BlockGroup, source: Block, solved: Sequence[Decision],
              others: Sequence[Decision], targets: Sequence[Block] | None = None) -> tuple[Decision, ...]:
    """``others`` (decisions on tensors outside the group's blocks, or in blocks not in ``targets``) with
    ``source``'s decisions ``solved`` copied into every block of ``targets`` (default: the whole group). A
    decision that does not map leaves its tensor kept in that block."""
    targets = list(group.blocks if targets is None else targets)
    kept = [d for d in others if not any(touches(problem, d, b) for b in targets)]
    copied: list[Decision] = []
    for block in targets:
        if block == source:
            copied.extend(solved)
            continue
        mapping = BlockMap(problem, source, block)
        copied.extend(m for m in (mapping.decision(d) for d in solved) if m is not None)
    return tuple(kept) + tuple(copied)
