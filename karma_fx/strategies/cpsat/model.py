"""The exact planner's model: candidates and their options as plain data, then one CP-SAT model over them.

Formulation (it is "F" of the probe that compared CP-SAT formulations: all linear, with a tight LP bound,
where interval variables with enforcement literals gave a flat bound and no plan at 48 layers):

* the compute order is the traced order; positions are ops;
* each candidate (a saved activation) is kept, recomputed from what the unplanned step still holds at its
  first backward read, or offloaded: copied out after its producer, *released* (compute waits for the copy
  before position r, the device bytes are free from r), and prefetched at position p, waited for before its
  first backward read b; r and p come from short candidate lists;
* or, with every other candidate of a *segment* (``segments.py``: the forward ops of consecutive stretches
  between cut points, or one tensor of a stretch alone), it is dropped and rebuilt by one chain from the
  segment's input before the segment's first backward read: checkpointing's choice, which one-tensor chains
  cannot express (a chain that reads a dropped tensor would have to rebuild it too). Without it the models
  could not reach the plans the heuristics win with at low budgets (on a 4-layer slice of GPT-2-48 at 0.7
  the whole-graph model's best was 2x karma's block recompute);
* memory is exact at every position by incremental sums (it depends on where tensors leave and come back,
  never on timing), rounded to units of 2^-17 of the unplanned peak (``memory_unit``) with savings rounded
  down and usage up;
* time is the compute stream with a wait variable at every position, plus two FIFO copy streams in the order
  the runtime issues them (offloads by producer, prefetches by issue position), exactly as the simulator
  replays them, so the model's step time and the simulator's agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from karma_fx.costs import Costs
from karma_fx.dependencies import dependency_graph, recompute_ops
from karma_fx.plan import Decision, Offload, Recompute
from karma_fx.problem import Problem
from karma_fx.strategies.base import ResidentAt, saved_gaps
from karma_fx.strategies.cpsat.candidate import Candidate, Segment
from karma_fx.strategies.cpsat.choice import KEEP, RECOMPUTE, Choice, Kind
from karma_fx.strategies.cpsat.segments import (attach_segments, chain_reads, early_reads, early_readers,
                                                segment_named, segments_of, waited_at)

MEMORY_UNIT_SHIFT = 17
"""The models count memory in units of 2^-17 of the unplanned peak: 72 KiB on GPT-2 in bf16-mixed (9.12 GiB),
much as the fixed 64 KiB units before, and 8 bytes on a tiny model of 1 MiB."""
CANDIDATE_SHIFT = 12
"""A saved tensor of less than 2^-12 of the unplanned peak stays on the device: a hundred of them are 2.4% of
the peak. The threshold was the 64 KiB unit itself, so the solver ignored every saved tensor of the tiny zoo
models (all under 64 KiB) and of a graph written in small abstract units. At 2^-17 the tiny ResNet-1001
offered 77 tensors instead of 39 and planned in 12-25 s instead of 3-7 s (H100 preset, 0.9 to 0.7 of its
peak, no time limit), its plans worse at two of the three budgets: the models' time went on tensors that
could not matter."""
TIME_SCALE = 10
"""The models count time in units of 0.1 µs at least, and finer on a short step (``time_scale``)."""
TIME_UNITS_PER_STEP = 2 ** 14
"""...so that the step's compute spans at least this many units: a step of 1.6 ms or more keeps 0.1 µs units,
a tiny model on the H100 preset (130 to 630 µs) gets 2.6 to 12 times finer ones, and a graph timed in small
abstract units is not rounded to nothing (at 0.1 µs, ops of 0.04 units all took no time)."""


MAX_TIME_SCALE = 1e6
"""...but never finer than a picosecond: copies do not shrink with the ops' times, and a graph timed in 1e-12
units at 2^14 units a step made a model whose domains overflowed 64 bits (CP-SAT: MODEL_INVALID)."""


FIXED_UNITS_UNDER_INDUCTOR = 64 * 1024
"""The step Inductor runs (``Problem.fused_kernels``) keeps the fixed 64 KiB unit and threshold and 0.1 µs: with
relative ones the solver moved tensors of a few KiB on tiny models, and a planned Inductor step of a 2-layer GPT
(0.88 of its peak) then measured 4.2% above its plan in the full suite, where the kernel model misses small
buffers. Relative thresholds there wait for a kernel model that counts them."""


def time_scale(problem: Problem, costs: Costs) -> float:
    """Model time units per µs for a graph of these costs (``TIME_UNITS_PER_STEP``, ``MAX_TIME_SCALE``)."""
    compute_us = sum(t for t in costs.op_time_us if t > 0)
    if compute_us <= 0 or problem.fused_kernels:
        return float(TIME_SCALE)
    return min(MAX_TIME_SCALE, max(float(TIME_SCALE), TIME_UNITS_PER_STEP / compute_us))


def memory_unit(unplanned_peak_bytes: int) -> int:
    """The models' memory unit for a graph of this unplanned peak: scale-free, so that a graph counted in bytes
    and the same graph in abstract units plan alike. With savings rounded down and usage up, each tensor a
    position counts is off by less than a unit, so a plan the models accept stays within the budget, and at
    most a few hundred units (a fraction of a percent of the peak) of room go unused."""
    return max(1, int(unplanned_peak_bytes) >> MEMORY_UNIT_SHIFT)


def candidate_bytes(unplanned_peak_bytes: int) -> int:
    """The smallest saved tensor the solver decides on, for a graph of this unplanned peak (``CANDIDATE_SHIFT``)."""
    return max(1, int(unplanned_peak_bytes) >> CANDIDATE_SHIFT)


def solver_units(problem: Problem, unplanned_peak: Callable[[], int], fixed: int | None = None) -> tuple[int, int]:
    """(memory unit, smallest saved tensor decided on) for planning ``problem``, the one place both are chosen:
    ``fixed`` where an option fixes them, the fixed 64 KiB on the step Inductor runs
    (``FIXED_UNITS_UNDER_INDUCTOR``), else relative to the graph's ``unplanned_peak()`` (``memory_unit``,
    ``candidate_bytes``), called only then."""
    if fixed is None and problem.fused_kernels:
        fixed = FIXED_UNITS_UNDER_INDUCTOR
    if fixed is not None:
        return fixed, fixed
    peak = unplanned_peak()
    return memory_unit(peak), candidate_bytes(peak)


def candidates(problem: Problem, min_bytes: int, choices: int = 3,
               max_chain: int = 24, max_segment_chain: int = 400) -> list[Candidate]:
    """The saved activations worth deciding on, each with its release / prefetch positions, its own recompute
    chain and its segment (``Segment``)."""
    nf = problem.num_fwd_ops
    gaps = [g for g in saved_gaps(problem) if g.storage.size_bytes >= min_bytes]
    names = {g.storage.name for g in gaps}
    fwd_sync = sorted({c + 1 for c in problem.cut_points if c + 1 < nf} | {nf})
    bwd_sync = sorted({g.first_bwd_use for g in gaps})
    graph = dependency_graph(problem)
    out: list[Candidate] = []
    for g in gaps:
        s = g.storage
        f, b = g.last_fwd_use, g.first_bwd_use
        releases = [f + 1] + [x for x in fwd_sync if f + 1 < x <= b][:choices]
        prefetches = sorted({b, *[x for x in bwd_sync if max(releases[0], nf) <= x < b][-choices:]})
        cand = Candidate(s.name, s.size_bytes, s.producer or 0, f, b, sorted(set(releases)), prefetches)
        if problem.ops[cand.producer].recomputable:
            _attach_chain(problem, cand, names, graph, max_chain)
        out.append(cand)
    attach_segments(problem, out, graph, max_segment_chain)
    return out


def _attach_chain(problem: Problem, cand: Candidate, names: set[str], graph, max_chain: int) -> None:
    b = cand.first_bwd
    resident = ResidentAt(problem, b, excluding={cand.name})
    try:
        chain = recompute_ops(problem, [cand.name], resident, graph)
    except ValueError:
        return
    if not chain or len(chain) > max_chain:
        return
    made, cand.needs_kept, cand.extends = chain_reads(problem, chain, b, names)
    cand.chain = chain
    cand.chain_temp_bytes = sum(problem.storage(s).size_bytes for s in made if s != cand.name)


def chain_time(problem: Problem, costs: Costs, cand: Candidate | Segment) -> float:
    """What rebuilding ``cand``'s chain costs, each op at its rebuild price (``Costs.rebuild_us``)."""
    return sum(costs.rebuild_us(problem, i) for i in cand.chain or ())


def decisions_from(problem: Problem, chosen: dict[Candidate, Choice]) -> tuple[Decision, ...]:
    """Decisions in the order the runtime issues them: offloads by (producer, name) so the D2H FIFO matches,
    then (stable) prefetch order is by reload position, which the model keeps monotone in issue position."""
    ops = problem.ops
    out: list[Decision] = []
    early = early_reads(list(chosen), {c.name: x for c, x in chosen.items()})
    offloads = sorted(((c, x) for c, x in chosen.items() if x.kind is Kind.OFFLOAD),
                      key=lambda e: (waited_at(e[0], early), e[0].first_bwd, e[0].name))
    for c, x in offloads:
        assert x.release is not None and x.prefetch is not None
        out.append(Offload(tensor=c.name, offload_after=ops[c.producer].name, free_after=ops[c.last_fwd].name,
                           prefetch_at=ops[x.prefetch].name, reload_before=ops[waited_at(c, early)].name,
                           release_before=ops[x.release].name))
    # Recomputes at the same op run in production order, so a chain finds the tensors it reads rebuilt.
    rebuilt: list[tuple[int, int, str, Recompute]] = []
    for c, x in chosen.items():
        if x.kind is Kind.RECOMPUTE:
            rebuilt.append((c.first_bwd, c.producer, c.name,
                            Recompute(tensors=(c.name,), ops=tuple(ops[i].name for i in c.chain or ()),
                                      reload_before=ops[c.first_bwd].name)))
    segs = {x.group: segment_named(c, x.group) for c, x in chosen.items() if x.kind is Kind.SEGMENT}
    for seg in segs.values():
        assert seg is not None
        rebuilt.append((seg.anchor, seg.chain[0], seg.members[0], seg.decision))
    out.extend(d for *_, d in sorted(rebuilt, key=lambda e: e[:3]))
    return tuple(out)


@dataclass
class DecisionVars:
    """The decision literals shared by the capacity model and the exact model, with exact memory attached."""

    keep: dict
    rec: dict
    off: dict
    rel: dict
    pre: dict
    created: list
    seg: dict = field(default_factory=dict)
    """Segment index -> its literal: every member of the segment rebuilt by the segment's chain."""
    early: list = field(default_factory=list)
    """(a segment's literal, a candidate its chain reads, the op the chain runs before, the segment's index):
    where that candidate is offloaded and first read later, it comes back for the chain, waited for there."""
    memory: list = field(default_factory=list)
    """Per op: (its memory variable, the base change at the op, (coefficient, literal index) terms of the
    plan's change, the (coefficient, literal index) of each recompute chain run before the op (how far it
    rises above what it brings back), and the units the op's own outputs take, which no chain before it
    sees). Indices, not literals: ``memory_values`` runs for every plan the local search times."""
    budget_units: int = 0
    allow_offload: bool = True

    def admits(self, cands: list[Candidate], choices: dict[str, Choice]) -> bool:
        """Whether fixed ``choices`` meet the decision constraints (memory and timing aside): offloads only
        with a host link, at positions among the candidate's options, and a recompute chain's reads of other
        candidates on the device when it runs (kept, or back at their own earlier first backward read)."""
        by_name = {c.name: c for c in cands}
        for c in cands:
            choice = choices.get(c.name, KEEP)
            if choice.kind is Kind.OFFLOAD and (not self.allow_offload or choice.release not in self.rel[c.name]
                                                or choice.prefetch not in self.pre[c.name]):
                return False
            if choice.kind is Kind.RECOMPUTE and c.name in self.rec:
                if not all(present_by(by_name[t], choices.get(t, KEEP), c.first_bwd) for t in c.needs_kept):
                    return False
            if choice.kind is Kind.SEGMENT:
                seg = segment_named(c, choice.group)
                if seg is None or seg.index not in self.seg:
                    return False
                if any(choices.get(t, KEEP) != choice for t in seg.members):
                    return False
                if not all(present_by(by_name[t], choices.get(t, KEEP), seg.anchor, seg.index)
                           for t in seg.needs_kept):
                    return False
        return True

    def memory_values(self, true: set[int]) -> list[tuple[object, int]] | None:
        """Every memory variable's value when exactly the literals with indices ``true`` hold, or ``None``
        where the choices exceed the budget at some op: the memory check of a fixed-decision model, without
        a solve."""
        out, previous = [], 0
        budget = self.budget_units
        for mem, base_change, delta, temps, fresh in self.memory:
            previous += base_change + sum(k for k, v in delta if v in true)
            if previous < 0 or previous > budget or any(previous - fresh + k > budget for k, v in temps if v in true):
                return None
            out.append((mem, previous))
        return out

    def literals(self, cands: list[Candidate], choices: dict[str, Choice]) -> list:
        """Literals fixing every candidate to ``choices`` (missing: keep)."""
        out = []
        for c in cands:
            choice = choices.get(c.name, KEEP)
            if choice.kind is Kind.OFFLOAD:
                out += [self.off[c.name], self.rel[c.name][choice.release], self.pre[c.name][choice.prefetch]]
            elif choice.kind is Kind.RECOMPUTE and c.name in self.rec:
                out.append(self.rec[c.name])
            elif choice.kind is Kind.SEGMENT and choice.group in self.seg:
                out.append(self.seg[choice.group])
            else:
                out.append(self.keep[c.name])
        return out

    def read(self, cands: list[Candidate], value) -> dict[str, Choice]:
        """The choices of a solution (``value`` maps a literal to 0/1)."""
        choices: dict[str, Choice] = {}
        for c in cands:
            if value(self.off[c.name]):
                r = next(r for r, v in self.rel[c.name].items() if value(v))
                p = next(p for p, v in self.pre[c.name].items() if value(v))
                choices[c.name] = Choice.offload(r, p)
            elif c.name in self.rec and value(self.rec[c.name]):
                choices[c.name] = RECOMPUTE
            elif any(seg.index in self.seg and value(self.seg[seg.index]) for seg in c.segments):
                group = next(seg.index for seg in c.segments if seg.index in self.seg and value(self.seg[seg.index]))
                choices[c.name] = Choice.segment(group)
            else:
                choices[c.name] = KEEP
        return choices


def present_by(t: Candidate, choice: Choice, at: int, segment: int | None = None) -> bool:
    """Whether candidate ``t``, under ``choice``, is on the device at backward op ``at`` (where a chain that
    reads it runs): kept, or back already (prefetched or rebuilt at its own first backward read, or with its
    segment at the segment's, no later than ``at``), or, for the chain of ``segment`` that reads it early,
    prefetched at ``at`` or before."""
    if choice.kind is Kind.KEEP:
        return True
    if choice.kind is Kind.OFFLOAD:
        assert choice.prefetch is not None
        return t.first_bwd <= at or (choice.prefetch <= at and any(seg.index == segment for seg in early_readers(t)))
    if choice.kind is Kind.RECOMPUTE and t.chain is not None:
        return t.first_bwd <= at
    seg = segment_named(t, choice.group)
    return seg is not None and seg.anchor <= at


def add_decisions_and_memory(m, problem: Problem, cands: list[Candidate], base_bytes, budget_bytes: int,
                             unit: int, *, allow_offload: bool = True) -> DecisionVars:
    """Decision literals (keep / offload at (release, prefetch) / recompute) and the memory constraint at
    every op, by incremental sums in ``unit``-byte units (savings rounded down, usage up: at 1 MiB units a
    plan at 99.9% of the budget could be rejected, at ``memory_unit``'s it is not). ``allow_offload=False`` fixes every
    offload literal to 0 (no host link: keep or recompute only)."""
    created: list = []

    def bool_var():
        v = m.NewBoolVar("")
        created.append(v)
        return v

    dv = DecisionVars({}, {}, {}, {}, {}, created, allow_offload=allow_offload)
    by_name = {c.name: c for c in cands}
    segs = [s for s in segments_of(cands) if all(t in by_name for t in s.members)]
    for seg in segs:
        dv.seg[seg.index] = bool_var()
    for c in cands:
        dv.keep[c.name], dv.off[c.name] = bool_var(), bool_var()
        dv.rel[c.name] = {r: bool_var() for r in c.releases}
        dv.pre[c.name] = {p: bool_var() for p in c.prefetches}
        parts = [dv.keep[c.name], dv.off[c.name]]
        if c.chain is not None:
            dv.rec[c.name] = bool_var()
            parts.append(dv.rec[c.name])
        # each segment's literal is shared by its members: all rebuilt together or none
        parts += [dv.seg[seg.index] for seg in c.segments if seg.index in dv.seg]
        m.AddExactlyOne(parts)
        if not allow_offload:
            m.Add(dv.off[c.name] == 0)
        m.Add(sum(dv.rel[c.name].values()) == dv.off[c.name])
        m.Add(sum(dv.pre[c.name].values()) == dv.off[c.name])
        m.Add(sum(r * v for r, v in dv.rel[c.name].items()) <= sum(p * v for p, v in dv.pre[c.name].items()))
    def reads(x, name: str, at: int, segment: int | None = None) -> None:
        """A chain chosen by literal ``x`` runs before op ``at`` and reads candidate ``name``: it must be on the
        device there, i.e. kept, or back already (recomputed or prefetched at its own first backward read,
        or rebuilt with a segment, no later than ``at``), or prefetched early, at ``at`` or before (then
        ``at`` waits for that copy: ``DecisionVars.early``)."""
        t = by_name[name]
        back = ([dv.off[name]] + ([dv.rec[name]] if name in dv.rec else [])) if t.first_bwd <= at else []
        back += [dv.seg[seg.index] for seg in t.segments if seg.index in dv.seg and seg.anchor <= at]
        if segment is not None and any(seg.index == segment for seg in early_readers(t)):
            back.append(dv.off[name])
            m.Add(sum(p * v for p, v in dv.pre[name].items()) <= at).OnlyEnforceIf([x, dv.off[name]])
            dv.early.append((x, name, at, segment))
        m.Add(x <= dv.keep[name] + sum(back))

    for c in cands:
        for name in c.needs_kept if c.name in dv.rec else ():
            reads(dv.rec[c.name], name, c.first_bwd)
    for seg in segs:
        for name in seg.needs_kept:
            reads(dv.seg[seg.index], name, seg.anchor, seg.index)

    # Memory as (coefficient, literal) terms per op, kept on ``dv`` so fixed choices can be checked in Python.
    delta: list[list[tuple[int, object]]] = [[] for _ in range(len(problem.ops) + 1)]
    temps: dict[int, list[tuple[int, object]]] = {}
    up = lambda b: -(-b // unit)  # noqa: E731

    def rebuilt(x, tensors: list[Candidate], at: int, extends, temp_bytes: int) -> None:
        """Literal ``x``: ``tensors`` leave after their last forward read and a chain brings them back before
        op ``at``; what it reads is kept alive until then (``extends``) and it rises ``temp_bytes`` above them."""
        for c in tensors:
            delta[c.last_fwd + 1].append((-(c.size // unit), x))
            delta[at].append((c.size // unit, x))
        for storage, start, stop in extends:
            size = up(problem.storage(storage).size_bytes)
            delta[start].append((size, x))
            delta[stop].append((-size, x))
        if temp_bytes:
            temps.setdefault(at, []).append((up(temp_bytes), x))

    for c in cands:
        down = c.size // unit
        for r, v in dv.rel[c.name].items():
            delta[r].append((-down, v))
        for p, v in dv.pre[c.name].items():
            delta[p].append((down, v))
        if c.name in dv.rec:
            rebuilt(dv.rec[c.name], [c], c.first_bwd, c.extends, c.chain_temp_bytes)
    for seg in segs:
        rebuilt(dv.seg[seg.index], [by_name[name] for name in seg.members], seg.anchor, seg.extends, seg.temp_bytes)
    base = [up(b) for b in base_bytes]
    extended = [e for c in cands for e in c.extends] + [e for seg in segs for e in seg.extends]
    cap = max(base) + sum(up(c.size) for c in cands) + sum(up(problem.storage(e[0]).size_bytes) for e in extended) + 1
    budget_units = budget_bytes // unit
    previous = 0
    for i in range(len(problem.ops)):
        mem = m.NewIntVar(0, cap, "")
        created.append(mem)
        m.Add(mem == previous + base[i] - (base[i - 1] if i else 0) + sum(k * v for k, v in delta[i]))
        m.Add(mem <= budget_units)
        # A chain runs before op i, one after the other: each rises above mem[i] less op i's outputs (not yet
        # made), on its own. Summing every chain's rise on top of mem[i] overstated ResNet-50's block rebuilds
        # in bf16 at a quarter of its peak by up to 411 MB (a batch-norm backward's output and a rebuilt
        # block's last forward output, which are never on the device together).
        fresh = sum(problem.storage(o).size_bytes for o in problem.ops[i].outputs) // unit
        for k, v in temps.get(i, ()):
            m.Add(mem + k * v <= budget_units + fresh)
        dv.memory.append((mem, base[i] - (base[i - 1] if i else 0), [(k, v.Index()) for k, v in delta[i]],
                          [(k, v.Index()) for k, v in temps.get(i, ())], fresh))
        previous = mem
    dv.budget_units = budget_units
    return dv


DETERMINISTIC_UNITS_PER_S = 0.25
"""CP-SAT deterministic-time units granted per second of ``time_limit_s``. Measured on this project's 2-core
runner, 2 interleaved workers, GPT-2 real at a 0.7 budget: the capacity model used 6.1 units in 22 s and found
its bound (at 1 unit it found nothing); the exact model used 1.9 units in 13 s. A solve overshoots its unit
limit (it stops between interleaved batches)."""


INTERLEAVE_BATCH = 1
"""Tasks per interleaved batch. CP-SAT's default batch waits for its slowest task before the search may stop:
on resnet1001 tiny the capacity model met its gap limit after 2.6 s and returned after 12.5 s, waiting on an
LP worker (at 1: 0.8 s, the same decisions; wrn28_10 tiny at 0.7 and resnet1001 at 0.5 planned the same or
better plans). The answer still depends only on the model and the seed."""


def deterministic_solver(time_limit_s: float, workers: int, seed: int):
    """A CP-SAT solver whose answer depends only on the model and the seed, not on machine load: its limit is
    CP-SAT's deterministic time (``time_limit_s`` converted at ``DETERMINISTIC_UNITS_PER_S``), its workers
    interleave their searches in fixed batches, and a wall-clock cap of four times the limit only guards
    against a pathological run (that cap, if ever hit, is the one non-reproducible exit).

    Ctrl-C stays the user's: by default CP-SAT takes SIGINT for itself during a solve (ending the search as if
    its limit were reached, so planning went on and the CLI exited 0) and leaves the default handler behind
    (a later Ctrl-C killed the process without a word). Without it the interrupt is raised as soon as the
    solve returns, within its time limit."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s * DETERMINISTIC_UNITS_PER_S
    solver.parameters.max_time_in_seconds = 4 * time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = seed
    solver.parameters.interleave_batch_size = INTERLEAVE_BATCH
    solver.parameters.catch_sigint_signal = False
    return solver
