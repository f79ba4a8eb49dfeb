"""Segments: stretches of the forward that one recompute chain rebuilds together, as choices of the exact
planner's models (``model.py``).

Why: a tensor's own recompute chain may read only what is kept or already back, so a block rebuilt from its
input (checkpointing's plan, karma's blocks, greedy's by-block order) is not one tensor's choice; it is a
choice shared by all the block's tensors. A segment is one to ``MAX_SPAN`` consecutive stretches between cut
points, or one tensor of a stretch rebuilt alone from the stretch's input (nested recompute). What a
segment's chain reads and cannot rebuild (its input, outputs of random ops) may be offloaded and fetched
back for it before its own first backward read; each such copy has a fixed place in the copy-back stream
(``prefetch_slots``), so the models stay linear.
"""
from __future__ import annotations

from typing import Sequence

from karma_fx.dependencies import recompute_ops
from karma_fx.plan import Decision, Offload, Recompute
from karma_fx.problem import Problem
from karma_fx.strategies.base import ResidentAt, _alive_at, block_input_after
from karma_fx.strategies.cpsat.blocks import segments
from karma_fx.strategies.cpsat.candidate import Candidate, Segment
from karma_fx.strategies.cpsat.choice import KEEP, Choice, Kind

def early_readers(t: Candidate) -> list[Segment]:
    """The segments whose chain may read offloaded ``t`` before its own first backward read, earliest
    first: it comes back for the first of them that is chosen, prefetched by that segment's anchor (the input
    of a checkpointed block, a random op's output inside it), and stays for the others."""
    return sorted((seg for seg in t.reading if seg.anchor in t.prefetches and seg.anchor < t.first_bwd),
                  key=lambda seg: (seg.anchor, seg.index))


def prefetch_slots(cands: Sequence[Candidate],
                   segments: set[int] | None = None) -> list[tuple[Candidate, int, int | None]]:
    """The FIFO copy-in stream's places, in order: (candidate, the op that waits for the copy, the segment
    it comes back for, or ``None`` for its own first backward read). An offloaded candidate takes exactly
    one place: the one of the segment that reads it early, if one is chosen, else its own. Fixed places keep
    the model linear; prefetch positions must be non-decreasing along them. ``segments``: the indices of
    the segments a model offers (default: all)."""
    slots = [(c, c.first_bwd, None) for c in cands]
    slots += [(c, seg.anchor, seg.index) for c in cands for seg in early_readers(c)
              if segments is None or seg.index in segments]

    def place(e: tuple[Candidate, int, int | None]) -> int:
        return e[0].queued_at if e[0].queued_at is not None and e[2] is None else e[1]

    return sorted(slots, key=lambda e: (place(e), e[1], e[0].first_bwd, e[0].name, -1 if e[2] is None else e[2]))


def chain_reads(problem: Problem, chain: tuple[int, ...], at: int,
                candidates: set[str]) -> tuple[set[str], list[str], list[tuple[str, int, int]]]:
    """What a recompute ``chain`` run before op ``at`` makes, and what it reads from outside itself: the
    candidates among those reads (each must be on the device there), and the others that the unplanned step
    has freed by ``at`` (forward-only outputs the chain keeps alive until then: (storage, from, to))."""
    made = {o for i in chain for o in problem.ops[i].outputs}
    reads = {x for i in chain for x in problem.ops[i].inputs} - made
    extends = []
    for r in sorted(reads - candidates):
        st = problem.storage(r)
        if not _alive_at(st, at):
            extends.append((r, max(st.users, default=st.producer or 0) + 1, at))
    return made, sorted(reads & candidates), extends


MAX_SPAN = 4
"""The longest segment, in stretches between consecutive cut points. A transformer layer is two stretches
(attention, MLP), so segments reach two layers; karma's blocks on GPT-2 span a layer."""


def attach_segments(problem: Problem, cands: list[Candidate], graph, max_chain: int) -> None:
    """Give each candidate the segments whose one chain can rebuild all their members together: the
    recomputable candidates produced in one to ``MAX_SPAN`` consecutive stretches between cut points, less
    the last stretch's output that the next one reads (``block_input_after``: checkpointing keeps it so that
    every chain stays inside its block). A segment of one member is left out when that member has a chain of
    its own (the same choice), and so is a segment with the same members as a shorter one.

    And, inside each stretch of several members, one *nested* segment per member: that member alone, rebuilt
    from the stretch's input with everything in between made again and dropped as the chain goes on. Why:
    where one rebuilt block's tensors do not fit beside what the backward holds (ResNet-50 in bf16 at a
    quarter of its peak), a block's tensors must come back one by one, each rebuilt from the block's input,
    at the price of running the block's first ops once per tensor."""
    spans = segments(problem)
    by_name = {c.name: c for c in cands}
    by_producer: dict[int, list[Candidate]] = {}
    for c in cands:
        if problem.ops[c.producer].recomputable:
            by_producer.setdefault(c.producer, []).append(c)
    saved = {s.name for s in problem.saved_activations()}
    outputs = [block_input_after(problem, stop, saved) for _, stop in spans]
    found: list[Segment] = []
    seen: set[tuple[frozenset[str], tuple[int, ...]]] = set()

    def add(members: list[Candidate], dropped: frozenset[str]) -> None:
        """The segment rebuilding ``members`` from what stays resident when ``dropped`` is gone."""
        names = frozenset(c.name for c in members)
        anchor = min(c.first_bwd for c in members)
        try:
            chain = recompute_ops(problem, sorted(names), ResidentAt(problem, anchor, excluding=dropped), graph)
        except ValueError:
            return
        if not chain or len(chain) > max_chain or (names, chain) in seen:
            return
        if len(members) == 1 and chain == members[0].chain:
            return  # the member's own chain: the same choice
        seen.add((names, chain))
        found.append(_segment(problem, len(found), names, anchor, chain, by_name))

    for first in range(len(spans)):
        for last in range(first, min(first + MAX_SPAN, len(spans))):
            start, stop = spans[first][0], spans[last][1]
            members = [c for i in range(start, stop + 1) for c in by_producer.get(i, ()) if c.name not in outputs[last]]
            if members:
                names = frozenset(c.name for c in members)
                add(members, names)
                if first == last and len(members) > 1:
                    for c in members:
                        add([c], names)
    for segment in found:
        _register(problem, segment, by_name)


def attach_plan_choices(problem: Problem, cands: list[Candidate], decisions: Sequence[Decision],
                        landed: dict[str, int] | None = None) -> int:
    """Offer a heuristic plan's own choices to the models: its release and prefetch points as options of the
    tensors it offloads, and as segments the groups it rebuilds with one chain each that no choice expresses
    yet (their candidates, rebuilt by the plan's own chain before its op); returns how many segments were
    added. Why: greedy rebuilds together the tensors the backward first needs at one op, a chain that reads
    others it dropped too, which neither a tensor's own chain nor a stretch's segment is, and fetches a
    tensor's chain inputs back early for it, which only a segment's chain may do: on ResNet-50 in
    bf16 at a quarter of its peak none of greedy's 28 groups mapped, so the search started from a plan 1.4x
    slower than greedy's and never came back to it; from greedy's own plan it finds one 22% faster. The
    tensors of a group too small to decide on stay on the device (the models assume so). ``landed``: where
    the copies out that the plan never waits for have landed (``base.copies_landed``), their release."""
    by_name = {c.name: c for c in cands}
    for d in decisions:
        c = by_name.get(getattr(d, "tensor", ""))
        if c is None or not isinstance(d, Offload):
            continue
        release = problem.op_index(d.release_before) if d.release_before else (landed or {}).get(c.name)
        if release is not None and c.last_fwd < release <= c.first_bwd:
            c.releases = sorted(set(c.releases) | {release})
        at = problem.op_index(d.prefetch_at)
        if max(c.releases[0], problem.num_fwd_ops) <= at < c.first_bwd:
            c.prefetches = sorted(set(c.prefetches) | {at})
    existing = segments_of(cands)
    known = {(frozenset(seg.members), seg.chain) for seg in existing}
    index = max((seg.index for seg in existing), default=-1) + 1
    offloaded = {d.tensor for d in decisions if isinstance(d, Offload)}
    added = 0
    for d in decisions:
        if not isinstance(d, Recompute):
            continue
        names = frozenset(t for t in d.tensors if t in by_name)
        chain = tuple(problem.op_index(op) for op in d.ops)
        if not names or (names, chain) in known:
            continue
        own = by_name[next(iter(names))]
        if len(names) == 1 and own.chain == chain and not offloaded & set(own.needs_kept):
            continue  # the tensor's own chain, reading nothing that must come back early for it
        known.add((names, chain))
        _register(problem, _segment(problem, index, names, problem.op_index(d.reload_before), chain, by_name),
                  by_name)
        index += 1
        added += 1
    return added


def _segment(problem: Problem, index: int, names: frozenset[str], anchor: int, chain: tuple[int, ...],
             by_name: dict[str, Candidate]) -> Segment:
    """The segment rebuilding candidates ``names`` by ``chain`` before op ``anchor``."""
    _, needs_kept, extends = chain_reads(problem, chain, anchor, set(by_name))
    ordered = tuple(sorted(names, key=lambda n: (by_name[n].producer, n)))
    return Segment(index, ordered, anchor, chain,
                   Recompute(tensors=ordered, ops=tuple(problem.ops[i].name for i in chain),
                             reload_before=problem.ops[anchor].name),
                   temp_bytes=_chain_overshoot(problem, chain, names), needs_kept=needs_kept, extends=extends)


def _register(problem: Problem, segment: Segment, by_name: dict[str, Candidate]) -> None:
    """Make ``segment`` a choice of its members, and of what its chain reads a reason to come back early."""
    for name in segment.members:
        by_name[name].segments += (segment,)
    for name in segment.needs_kept:  # what the chain reads may come back for it, before its own first read
        t = by_name[name]
        t.reading += (segment,)
        if t.releases[0] <= segment.anchor < t.first_bwd and segment.anchor >= problem.num_fwd_ops:
            t.prefetches = sorted(set(t.prefetches) | {segment.anchor})


def _chain_overshoot(problem: Problem, chain: tuple[int, ...], members: frozenset[str]) -> int:
    """How far the chain's memory rises above all ``members`` back on the device, at its worst step: the
    members made so far plus the other outputs still to be read by a later step of the chain (an output
    nobody in the chain reads lives for its own step only). Counting every other output at once, as if
    none were freed, overstated a 4-layer GPT's block rebuild by 67 KB, enough to reject checkpointing
    plans the simulator fits."""
    last_read: dict[str, int] = {}
    for k, i in enumerate(chain):
        for x in problem.ops[i].inputs:
            last_read[x] = k
    total = sum(problem.storage(m).size_bytes for m in members)
    made = worst = 0
    live: dict[str, int] = {}
    for k, i in enumerate(chain):
        for o in problem.ops[i].outputs:
            size = problem.storage(o).size_bytes
            if o in members:
                made += size
            else:
                live[o] = size
        worst = max(worst, made + sum(live.values()))
        live = {o: b for o, b in live.items() if last_read.get(o, -1) > k}
    return max(0, worst - total)


def segments_of(cands: Sequence[Candidate]) -> list[Segment]:
    """The distinct segments of ``cands``, in forward order."""
    seen: dict[int, Segment] = {}
    for c in cands:
        for seg in c.segments:
            seen.setdefault(seg.index, seg)
    return [seen[k] for k in sorted(seen)]


def segment_named(cand: Candidate, group: int | None) -> Segment | None:
    """``cand``'s segment with index ``group``, if it belongs to one."""
    return next((seg for seg in cand.segments if seg.index == group), None)


def early_reads(cands: Sequence[Candidate], choices: dict[str, Choice]) -> dict[str, int]:
    """Offloaded candidates that a chosen segment's chain reads before their own first backward read:
    name -> the index of the first such segment (``early_readers`` order), which it comes back for."""
    out: dict[str, int] = {}
    for c in cands:
        if choices.get(c.name, KEEP).kind is Kind.OFFLOAD:
            for seg in early_readers(c):
                if choices.get(seg.members[0], KEEP) == Choice.segment(seg.index):
                    out[c.name] = seg.index
                    break
    return out


def waited_at(c: Candidate, early: dict[str, int]) -> int:
    """The op that waits for offloaded ``c``'s copy back: its first backward read, or the anchor of the
    segment that reads it early."""
    seg = next((g for g in early_readers(c) if g.index == early.get(c.name)), None)
    return c.first_bwd if seg is None else seg.anchor
