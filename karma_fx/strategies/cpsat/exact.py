"""The exact model: every candidate's choice, exact memory at every op, and time as the compute stream with a
wait before every op plus the two FIFO copy streams in the order the runtime issues them, so its step time
and the simulator's agree. Decisions can be hinted, timed when fixed (``evaluate``: the earliest schedule,
computed in Python, no solve) and read back; the whole-graph pass and the windows both use it.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.plan import Decision, Offload, Plan, Recompute
from karma_fx.problem import Problem
from karma_fx.strategies.cpsat.choice import KEEP, RECOMPUTE, Choice, Kind
from karma_fx.strategies.cpsat.model import (Candidate, add_decisions_and_memory, time_scale,
                                             chain_time, decisions_from, deterministic_solver, present_by)
from karma_fx.strategies.cpsat.segments import Segment, early_readers, early_reads, prefetch_slots, segments_of
from karma_fx.strategies.cpsat.options import SolverOptions


class Model:
    """The CP-SAT model over ``cands``; decisions can be hinted, timed when fixed, and read back."""

    def __init__(self, problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int],
                 cands: list[Candidate], unit: int, *, floor_us: float = 0.0,
                 pinned: Mapping[str, Choice] | None = None,
                 fixed_chains_us: Mapping[int, float] | None = None) -> None:
        """``floor_us``: a step time no plan of the model can beat (a lower bound proven elsewhere). The model
        minimises ``max(makespan, floor)``, so a search that reaches the floor has proven its incumbent optimal
        at once instead of closing the gap from its own, weaker, bound (and a gap limit counts from the floor).
        A floor that is not a true bound only makes the search stop at a plan that fast, never cuts one off.
        ``pinned``: candidates whose choice is fixed (a window's or a block's surroundings: their copies share
        the streams with the free candidates' ones); they are timed and counted but never decided on, so
        ``free`` lists the others and ``decisions`` leaves them out. ``fixed_chains_us``: op index -> time of
        the recompute chains that run before it whatever the model decides (the surroundings' own recomputes):
        they run first, then the op waits for what it needs (as in the simulator), except the candidates such a
        chain reads (``Candidate.before_chains``): they are waited for before the chains."""
        from ortools.sat.python import cp_model

        self.problem, self.cands = problem, cands
        self.pinned = dict(pinned or {})
        self.free = [c for c in cands if c.name not in self.pinned]
        self._slot_literals: dict[tuple[str, int | None], object] = {}
        n = len(problem.ops)
        m = self.m = cp_model.CpModel()
        self.all_vars: list = []

        def int_var(lo: int, hi: int, name: str):
            v = m.NewIntVar(lo, hi, name)
            self.all_vars.append(v)
            return v

        scale = self.scale = time_scale(problem, costs)

        def _t(us: float) -> int:
            return int(round(us * scale))

        dur = [_t(x) for x in costs.op_time_us]
        fixed = {i: _t(us) for i, us in (fixed_chains_us or {}).items() if _t(us) > 0}
        before_chains = {c.name for c in cands if c.before_chains}
        d2h = {c.name: _t(costs.copy_time_us(c.size, "d2h")) for c in cands}
        h2d = {c.name: _t(costs.copy_time_us(c.size, "h2d")) for c in cands}
        dv = self.dv = add_decisions_and_memory(m, problem, cands, base_bytes, budget_bytes, unit,
                                                allow_offload=costs.allow_offload)
        segs = [seg for seg in segments_of(cands) if seg.index in dv.seg]
        horizon = sum(dur) + 2 * sum(d2h.values()) + 2 * sum(h2d.values()) \
            + sum(_t(chain_time(problem, costs, c)) for c in cands) + sum(_t(chain_time(problem, costs, seg)) for seg in segs) + 1
        self.all_vars.extend(dv.created)
        self.keep, self.rec, self.off, self.rel, self.pre = dv.keep, dv.rec, dv.off, dv.rel, dv.pre
        pinned_cands = [c for c in cands if c.name in self.pinned]
        for lit in dv.literals(pinned_cands, self.pinned):
            m.Add(lit == 1)

        # ---- time: the compute stream with a wait before every op, FIFO copy streams --------------------
        swap_issue = 2 * _t(costs.copy_issue_us)
        horizon += sum(fixed.values()) + swap_issue * len(cands)
        T = [int_var(0, horizon, f"T_{i}") for i in range(n + 1)]
        wait = [int_var(0, horizon, f"wait_{i}") for i in range(n)]
        # op i: a wait for what the fixed chains read, the fixed chains, the wait for the rest, the model's own
        # chains, the op
        pre = {i: int_var(0, horizon, f"pre_wait_{i}") for i in fixed}
        ready = {i: T[i] + pre[i] + fixed[i] for i in fixed}  # where the op's own waits start
        m.Add(T[0] == 0)
        rec_at: dict[int, list] = {}
        for c in cands:
            if c.name in self.rec:
                rec_at.setdefault(c.first_bwd, []).append(_t(chain_time(problem, costs, c)) * self.rec[c.name])
        for seg in segs:
            rec_at.setdefault(seg.anchor, []).append(_t(chain_time(problem, costs, seg)) * dv.seg[seg.index])
        # A swap's two copy ops cost compute ``Costs.copy_issue_us`` each (threaded CPU copies): both charged
        # with op ``producer``, whose end issues the copy out (the simulator charges the copy back's where it is
        # issued; the total is the same).
        for c in cands if swap_issue else ():
            rec_at.setdefault(c.producer, []).append(swap_issue * dv.off[c.name])
        for i in range(n):
            m.Add(T[i + 1] == ready.get(i, T[i]) + wait[i] + sum(rec_at.get(i, ())) + dur[i])
        self._times = _Times(dur, d2h, h2d, {c.name: _t(chain_time(problem, costs, c)) for c in cands}, horizon, T, wait,
                             {seg.index: (seg, _t(chain_time(problem, costs, seg))) for seg in segs}, fixed, pre,
                             before_chains, swap_issue)
        self._literals: list | None = None
        end_d2h: dict[str, object] = {}
        prev = None
        for c in sorted(cands, key=lambda c: (c.producer, c.first_bwd, c.name)):
            off = self.off[c.name]
            e = int_var(0, horizon, f"E_{c.name}")
            if prev is not None:
                m.Add(e >= prev + d2h[c.name] * off)
            m.Add(e >= T[c.producer + 1] + d2h[c.name]).OnlyEnforceIf(off)
            for r, v in self.rel[c.name].items():
                m.Add(ready.get(r, T[r]) + wait[r] >= e).OnlyEnforceIf(v)
            end_d2h[c.name] = prev = e
            self._times.out_order.append((c, e))
        last_d2h = prev
        prev = prev_pos = None
        for c, at, group in prefetch_slots(cands, set(dv.seg)):
            # the copy back takes this place when the tensor is offloaded and, for a segment's place, that
            # segment is chosen (it reads the tensor early); its own place otherwise
            off = self.off[c.name]
            readers = _early_in(c, dv)
            if group is None:
                act = self._slot_literal(c.name, None)
                m.Add(act + sum(self._slot_literal(c.name, g.index) for g in readers) == off)
            else:
                # the first chosen segment that reads it early: this one, and none before it
                act = self._slot_literal(c.name, group)
                before = [dv.seg[g.index] for g in readers[:[g.index for g in readers].index(group)]]
                m.AddBoolAnd([off, dv.seg[group]] + [x.Not() for x in before]).OnlyEnforceIf(act)
                m.AddBoolOr([off.Not(), dv.seg[group].Not(), act] + before)
            h = int_var(0, horizon, f"H_{c.name}_{group}")
            pos = int_var(0, at, f"P_{c.name}_{group}")  # an issue position only an active place pins
            m.Add(pos == sum(p * v for p, v in self.pre[c.name].items())).OnlyEnforceIf(act)
            if prev_pos is not None:
                m.Add(prev_pos <= pos)
            if prev is not None:
                m.Add(h >= prev + h2d[c.name] * act)
            for p, v in self.pre[c.name].items():
                m.Add(h >= T[p] + h2d[c.name]).OnlyEnforceIf([v, act])
            m.Add(h >= end_d2h[c.name] + h2d[c.name]).OnlyEnforceIf(act)
            if group is None and c.name in before_chains and at in pre:
                m.Add(T[at] + pre[at] >= h).OnlyEnforceIf(act)
            else:
                m.Add(ready.get(at, T[at]) + wait[at] >= h).OnlyEnforceIf(act)
            prev, prev_pos = h, pos
            self._times.in_order.append((c, at, group, h, pos, act))
        self.makespan = int_var(0, horizon, "makespan")
        m.AddMaxEquality(self.makespan, [T[n]] + [v for v in (last_d2h, prev) if v is not None])
        self.floor = min(horizon, max(0, int(math.floor(floor_us * self.scale))))
        self.objective = int_var(self.floor, horizon, "objective")
        m.AddMaxEquality(self.objective, [self.makespan, m.NewConstant(self.floor)])
        m.Minimize(self.objective)

    def _slot_literal(self, name: str, group: int | None):
        """The literal of candidate ``name`` taking its copy-back place ``group`` (made once)."""
        key = (name, group)
        if key not in self._slot_literals:
            self._slot_literals[key] = self.m.NewBoolVar(f"A_{name}_{group}")
            self.all_vars.append(self._slot_literals[key])
        return self._slot_literals[key]

    # ---- decisions in and out -----------------------------------------------------------------------------
    def literals(self, choices: dict[str, Choice]) -> list:
        return self.dv.literals(self.cands, choices)

    def read(self, solver) -> dict[str, Choice]:
        return self.dv.read(self.cands, solver.Value)

    def decisions(self, choices: dict[str, Choice]) -> tuple[Decision, ...]:
        by_name = {c.name: c for c in self.cands}
        return decisions_from(self.problem, {by_name[k]: v for k, v in choices.items()
                                             if v.kind is not Kind.KEEP and k not in self.pinned})

    def _solver(self, options: SolverOptions, time_limit_s: float):
        """A solver for at most ``time_limit_s``, and never past the deadline of the call (``progress``): its
        deterministic limit and its wall-clock cap are both cut to the time left."""
        left = max(progress.seconds_left(), 0.01)
        solver = deterministic_solver(min(time_limit_s, left), options.workers, options.seed)
        if left < solver.parameters.max_time_in_seconds:
            solver.parameters.max_time_in_seconds = left
        return solver

    def evaluate(self, choices: dict[str, Choice]) -> tuple[float | None, list | None]:
        """The model's step time (µs) for fixed decisions and a complete assignment to hint with, computed
        directly: with every decision fixed the model is a longest path (each op starts as soon as its waits
        allow, each copy as soon as its stream and its tensor are ready), so the earliest start of everything
        is its optimum. ``(None, None)`` where the choices break the model (memory over the budget at an op,
        prefetches out of issue order). Replaces a CP-SAT solve per start that cost about 1 s on a 157-op
        graph."""
        if not self.dv.admits(self.cands, choices) or any(choices.get(k) != v for k, v in self.pinned.items()):
            return None, None
        true = {v.Index() for v in self.literals(choices)}
        memory = self.dv.memory_values(true)
        if memory is None:
            return None, None
        timed = self._times.earliest(choices)
        if timed is None:
            return None, None
        makespan, assignment = timed
        if self._literals is None:  # every decision variable but the memory ones, with its index
            memory_vars = {m.Index() for m, *_ in self.dv.memory}
            self._literals = [(v, v.Index()) for v in self.dv.created if v.Index() not in memory_vars]
        assignment += [(v, 1 if i in true else 0) for v, i in self._literals]
        assignment += memory
        assignment += [(self.makespan, makespan), (self.objective, max(makespan, self.floor))]
        return makespan / self.scale, assignment

    def solve(self, options: SolverOptions, hint: list | None, *,
              gap_us: float = 0.0) -> tuple[str, dict[str, Choice], float, float] | None:
        """The best decisions found: (status, choices, model step time µs, the search's bound µs). The search
        stops once its incumbent is within ``gap_us`` of its bound (which starts at the floor). OPTIMAL only
        when the model proves it: the gap closed and the step time above the floor (at or below a floor, the
        model's optimality rests on the floor, which only the caller can vouch for)."""
        from ortools.sat.python import cp_model

        self.m.ClearHints()
        for var, value in hint or ():
            self.m.AddHint(var, value)
        solver = self._solver(options, options.time_limit_s)
        solver.parameters.absolute_gap_limit = max(0.0, gap_us * self.scale)
        status = solver.Solve(self.m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        makespan = solver.Value(self.makespan)
        proven = (status == cp_model.OPTIMAL and solver.ObjectiveValue() <= solver.BestObjectiveBound() + 0.5
                  and makespan > self.floor)
        return ("OPTIMAL" if proven else "FEASIBLE", self.read(solver), makespan / self.scale,
                solver.BestObjectiveBound() / self.scale)


def choices_from_plan(problem: Problem, cands: list[Candidate], plan: Plan, *, allow_offload: bool = True,
                      landed: dict[str, int] | None = None) -> dict[str, Choice]:
    """A heuristic plan in the model's terms (nearest release / prefetch options, in the model's copy-back
    order), to start the search from. A recompute whose chain reads a moved candidate becomes an offload, or
    (``allow_offload`` false) a keep; so does a rebuilt segment whose chain reads what is not back in time.
    An offload that never waits for its copy out is released where ``landed`` says it has landed
    (``base.copies_landed``), else at its latest option."""
    idx = problem.op_index
    offloaded = {d.tensor: d for d in plan.decisions if isinstance(d, Offload)}
    recomputed = {t for d in plan.decisions if isinstance(d, Recompute) for t in d.tensors}
    names = {c.name for c in cands}
    out: dict[str, Choice] = {}
    # A group the plan rebuilds together (a checkpointed block) whose candidates are exactly a segment's
    # members takes that segment's choice (the one with the plan's own chain, if offered:
    # ``segments.attach_plan_choices``): one chain per tensor could not read the others, dropped too.
    segs = segments_of(cands)
    by_members = {frozenset(seg.members): seg for seg in segs}
    by_chain = {(frozenset(seg.members), seg.decision.ops): seg for seg in segs}
    for d in plan.decisions:
        if isinstance(d, Recompute):
            members = frozenset(d.tensors) & names
            seg = by_chain.get((members, d.ops)) or (by_members.get(members) if len(d.tensors) > 1 else None)
            if seg is not None:
                out.update({t: Choice.segment(seg.index) for t in seg.members})
    for c in cands:
        if c.name in out:
            continue
        if c.name in offloaded:
            d = offloaded[c.name]
            release = idx(d.release_before) if d.release_before else (landed or {}).get(c.name, c.releases[-1])
            r = max([x for x in c.releases if x <= release], default=c.releases[0])
            p = max([x for x in c.prefetches if x <= idx(d.prefetch_at)], default=c.prefetches[0])
            out[c.name] = Choice.offload(r, max(p, r) if max(p, r) in c.prefetches else c.prefetches[-1])
        elif c.name in recomputed and c.chain is not None:
            out[c.name] = RECOMPUTE
    by_name = {c.name: c for c in cands}
    for name, choice in list(out.items()):  # a chain may only read kept candidates
        c = by_name[name]
        if choice.kind is Kind.RECOMPUTE and any(out.get(t, KEEP).kind is not Kind.KEEP for t in c.needs_kept):
            out[name] = Choice.offload(c.releases[0], c.first_bwd) if allow_offload else KEEP
    for seg in segs:  # and a segment's chain only what is on the device when it runs
        if out.get(seg.members[0], KEEP) == Choice.segment(seg.index) and not all(
                t in by_name and present_by(by_name[t], out.get(t, KEEP), seg.anchor, seg.index)
                for t in seg.needs_kept):
            for t in seg.members:
                out[t] = Choice.offload(by_name[t].releases[0], by_name[t].first_bwd) if allow_offload else KEEP
    return in_prefetch_order(cands, out)


def leanest_choices(cands: list[Candidate], allow_offload: bool = True) -> dict[str, Choice]:
    """Everything swapped out synchronously and fetched just in time: the lowest peak the model can reach.
    Without offloading: every candidate with a chain recomputed (a start only; it may break a chain's reads)."""
    if not allow_offload:
        return {c.name: RECOMPUTE for c in cands if c.chain is not None}
    return {c.name: Choice.offload(c.releases[0], c.first_bwd) for c in cands}


def in_prefetch_order(cands: list[Candidate], choices: dict[str, Choice]) -> dict[str, Choice]:
    """``choices`` with every offload's prefetch moved later where needed to respect the exact model's issue
    order (prefetch positions non-decreasing along ``prefetch_slots``). The capacity model has no such order,
    so its decisions were often inexpressible here (resnet1001 tiny at 0.5: the exact pass then started from
    a heuristic at 978 µs instead of the capacity plan near 530 µs). A later prefetch never raises memory,
    and every candidate's own first backward read is one of its options, so the result fits wherever
    ``choices`` did, unless a copy that a segment's chain waits for early would have to move past it (the
    model then rejects it)."""
    out = dict(choices)
    running = -1
    early = early_reads(cands, choices)
    for c, _, group in prefetch_slots(cands):
        choice = out.get(c.name, KEEP)
        if choice.kind is Kind.OFFLOAD and early.get(c.name) == group:
            assert choice.prefetch is not None and choice.release is not None
            wanted = max(choice.prefetch, running)
            prefetch = min((p for p in c.prefetches if p >= wanted), default=None)
            if prefetch is None:
                return out  # no place left for it: the model rejects these choices
            if prefetch != choice.prefetch:
                out[c.name] = Choice.offload(choice.release, prefetch)
            running = prefetch
    return out


def _early_in(c: Candidate, dv) -> list:
    """``c``'s early readers that the model offers."""
    return [g for g in early_readers(c) if g.index in dv.seg]


class _Times:
    """The exact model's timing data and variables, and the earliest schedule of fixed decisions."""

    def __init__(self, dur: list[int], d2h: dict[str, int], h2d: dict[str, int], chain: dict[str, int],
                 horizon: int, T: list, wait: list, segments: dict[int, tuple[Segment, int]],
                 fixed: dict[int, int], pre: dict[int, object], before_chains: set[str], swap_issue: int = 0) -> None:
        self.dur, self.d2h, self.h2d, self.chain, self.horizon = dur, d2h, h2d, chain, horizon
        self.swap_issue = swap_issue  # compute time a swap's two copy ops cost, charged after its producer
        self.fixed, self.pre, self.before_chains = fixed, pre, before_chains
        self.segments = segments  # index -> (segment, its chain's time)
        self.T, self.wait = T, wait
        self.out_order: list[tuple[Candidate, object]] = []  # (candidate, its copy-out end variable), FIFO order
        self.in_order: list[tuple] = []
        """The copy-back places (``prefetch_slots``): (candidate, the op that waits, segment index or None,
        copy-in end, issue position, the place's literal)."""

    def earliest(self, choices: dict[str, Choice]) -> tuple[int, list] | None:
        """(makespan, assignment of every timing variable) in model units, or ``None`` if a value leaves its
        domain (prefetch positions out of order, a time past the horizon). One sweep over the ops: at op
        ``i`` the copies out of tensors produced just before it start, the copies in of tensors first read at
        ``i`` are placed, and op ``i`` waits for every copy its position waits on."""
        n = len(self.dur)
        chosen = lambda c: choices.get(c.name, KEEP)  # noqa: E731
        rec_at = [0] * n
        for c, _ in self.out_order:
            if chosen(c).kind is Kind.RECOMPUTE and c.chain is not None:
                rec_at[c.first_bwd] += self.chain[c.name]
            elif chosen(c).kind is Kind.OFFLOAD:
                rec_at[c.producer] += self.swap_issue  # added after the op, as the model adds it
        for seg, time in self.segments.values():
            if choices.get(seg.members[0], KEEP) == Choice.segment(seg.index):
                rec_at[seg.anchor] += time
        outs_at: dict[int, list[int]] = {}  # op -> indices into out_order whose copy may start at T[op]
        for k, (c, _) in enumerate(self.out_order):
            outs_at.setdefault(c.producer + 1, []).append(k)
        early = early_reads([c for c, _ in self.out_order], choices)
        out_end: dict[str, int] = {}
        due: list[int] = [0] * n  # the time op i may not start before (after its wait)
        due_pre: dict[int, int] = {}  # the time the fixed chains before op i may not start before
        T = [0] * (n + 1)
        wait = [0] * n
        pre_wait: dict[int, int] = {}
        prev_out = prev_in = 0
        prev_pos = -1
        positions: dict[tuple[str, int | None], int] = {}
        in_end: dict[tuple[str, int | None], int] = {}
        active: set[tuple[str, int | None]] = set()
        next_out = next_in = 0
        for i in range(n + 1):
            while next_out < len(self.out_order) and self.out_order[next_out][0].producer + 1 <= i:
                c, _ = self.out_order[next_out]
                choice = chosen(c)
                if choice.kind is Kind.OFFLOAD:
                    prev_out = max(prev_out + self.d2h[c.name], T[c.producer + 1] + self.d2h[c.name])
                    assert choice.release is not None
                    due[choice.release] = max(due[choice.release], prev_out)
                out_end[c.name] = prev_out
                next_out += 1
            if i == n:
                break
            # copies in, in FIFO order, each once compute has reached its issue position (a tensor that is
            # not offloaded passes its predecessor's position on)
            while next_in < len(self.in_order):
                c, at, group, _, _, _ = self.in_order[next_in]
                choice = chosen(c)
                if choice.kind is Kind.OFFLOAD and early.get(c.name) == group:
                    assert choice.prefetch is not None
                    if choice.prefetch < prev_pos or choice.prefetch > at:
                        return None
                    if choice.prefetch > i:
                        break
                    prev_pos = choice.prefetch
                    prev_in = max(prev_in + self.h2d[c.name], T[choice.prefetch] + self.h2d[c.name],
                                  out_end[c.name] + self.h2d[c.name])
                    if group is None and c.name in self.before_chains and at in self.fixed:
                        due_pre[at] = max(due_pre.get(at, 0), prev_in)
                    else:
                        due[at] = max(due[at], prev_in)
                    active.add((c.name, group))
                positions[(c.name, group)], in_end[(c.name, group)] = max(prev_pos, 0), prev_in
                next_in += 1
            start = T[i]
            if i in self.fixed:
                pre_wait[i] = max(0, due_pre.get(i, 0) - T[i])
                start = T[i] + pre_wait[i] + self.fixed[i]
            wait[i] = max(0, due[i] - start)
            T[i + 1] = start + wait[i] + rec_at[i] + self.dur[i]
        makespan = max([T[n], prev_out, prev_in])
        if makespan > self.horizon:
            return None
        assignment = list(zip(self.T, T)) + list(zip(self.wait, wait))
        assignment += [(v, pre_wait[i]) for i, v in self.pre.items()]
        assignment += [(e, out_end[c.name]) for c, e in self.out_order]
        assignment += [(h, in_end[(c.name, g)]) for c, _, g, h, _, _ in self.in_order]
        assignment += [(p, positions[(c.name, g)]) for c, _, g, _, p, _ in self.in_order]
        assignment += [(a, int((c.name, g) in active)) for c, _, g, _, _, a in self.in_order]
        return makespan, assignment
