"""The exact model: every candidate's choice, exact memory at every op, and time as the compute stream with a
wait before every op plus the two FIFO copy streams in the order the runtime issues them, so its step time
and the simulator's agree. Decisions can be hinted, fixed (assumptions) and read back; the whole-graph pass
and the windows both use it.
"""
from __future__ import annotations

from typing import Sequence

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.plan import Decision, Offload, Plan, Recompute
from karma_fx.problem import Problem
from karma_fx.strategies.cpsat.choice import KEEP, RECOMPUTE, Choice, Kind
from karma_fx.strategies.cpsat.model import (MEMORY_UNIT, TIME_SCALE, Candidate, add_decisions_and_memory, chain_time,
                                             decisions_from, deterministic_solver)
from karma_fx.strategies.cpsat.options import SolverOptions


def _t(us: float) -> int:
    return int(round(us * TIME_SCALE))


class Model:
    """The CP-SAT model over ``cands``; decisions can be hinted, fixed (assumptions) and read back."""

    def __init__(self, problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int],
                 cands: list[Candidate], unit: int = MEMORY_UNIT) -> None:
        from ortools.sat.python import cp_model

        self.problem, self.cands = problem, cands
        n = len(problem.ops)
        m = self.m = cp_model.CpModel()
        self.all_vars: list = []

        def int_var(lo: int, hi: int, name: str):
            v = m.NewIntVar(lo, hi, name)
            self.all_vars.append(v)
            return v

        dur = [_t(x) for x in costs.op_time_us]
        d2h = {c.name: _t(costs.copy_time_us(c.size, "d2h")) for c in cands}
        h2d = {c.name: _t(costs.copy_time_us(c.size, "h2d")) for c in cands}
        horizon = sum(dur) + 2 * sum(d2h.values()) + 2 * sum(h2d.values()) \
            + sum(_t(chain_time(costs, c)) for c in cands) + 1

        dv = self.dv = add_decisions_and_memory(m, problem, cands, base_bytes, budget_bytes, unit,
                                                allow_offload=costs.allow_offload)
        self.all_vars.extend(dv.created)
        self.keep, self.rec, self.off, self.rel, self.pre = dv.keep, dv.rec, dv.off, dv.rel, dv.pre

        # ---- time: the compute stream with a wait before every op, FIFO copy streams --------------------
        T = [int_var(0, horizon, f"T_{i}") for i in range(n + 1)]
        wait = [int_var(0, horizon, f"wait_{i}") for i in range(n)]
        m.Add(T[0] == 0)
        rec_at: dict[int, list] = {}
        for c in cands:
            if c.name in self.rec:
                rec_at.setdefault(c.first_bwd, []).append(_t(chain_time(costs, c)) * self.rec[c.name])
        for i in range(n):
            m.Add(T[i + 1] == T[i] + wait[i] + sum(rec_at.get(i, ())) + dur[i])
        end_d2h: dict[str, object] = {}
        prev = None
        for c in sorted(cands, key=lambda c: (c.producer, c.first_bwd, c.name)):
            off = self.off[c.name]
            e = int_var(0, horizon, f"E_{c.name}")
            if prev is not None:
                m.Add(e >= prev + d2h[c.name] * off)
            m.Add(e >= T[c.producer + 1] + d2h[c.name]).OnlyEnforceIf(off)
            for r, v in self.rel[c.name].items():
                m.Add(T[r] + wait[r] >= e).OnlyEnforceIf(v)
            end_d2h[c.name] = prev = e
        last_d2h = prev
        prev = prev_pos = None
        for c in sorted(cands, key=lambda c: (c.first_bwd, c.name)):
            off = self.off[c.name]
            h = int_var(0, horizon, f"H_{c.name}")
            pos = int_var(min(c.prefetches), c.first_bwd, f"P_{c.name}")
            m.Add(pos == sum(p * v for p, v in self.pre[c.name].items())).OnlyEnforceIf(off)
            if prev_pos is not None:
                m.Add(prev_pos <= pos)
            if prev is not None:
                m.Add(h >= prev + h2d[c.name] * off)
            for p, v in self.pre[c.name].items():
                m.Add(h >= T[p] + h2d[c.name]).OnlyEnforceIf(v)
            m.Add(h >= end_d2h[c.name] + h2d[c.name]).OnlyEnforceIf(off)
            m.Add(T[c.first_bwd] + wait[c.first_bwd] >= h).OnlyEnforceIf(off)
            prev, prev_pos = h, pos
        self.makespan = int_var(0, horizon, "makespan")
        m.AddMaxEquality(self.makespan, [T[n]] + [v for v in (last_d2h, prev) if v is not None])
        m.Minimize(self.makespan)

    # ---- decisions in and out -----------------------------------------------------------------------------
    def literals(self, choices: dict[str, Choice]) -> list:
        return self.dv.literals(self.cands, choices)

    def read(self, solver) -> dict[str, Choice]:
        return self.dv.read(self.cands, solver.Value)

    def decisions(self, choices: dict[str, Choice]) -> tuple[Decision, ...]:
        by_name = {c.name: c for c in self.cands}
        return decisions_from(self.problem, {by_name[k]: v for k, v in choices.items() if v.kind is not Kind.KEEP})

    def _solver(self, options: SolverOptions, time_limit_s: float):
        """A solver for at most ``time_limit_s``, and never past the deadline of the call (``progress``): its
        deterministic limit and its wall-clock cap are both cut to the time left."""
        left = max(progress.seconds_left(), 0.01)
        solver = deterministic_solver(min(time_limit_s, left), options.workers, options.seed)
        if left < solver.parameters.max_time_in_seconds:
            solver.parameters.max_time_in_seconds = left
        return solver

    def evaluate(self, choices: dict[str, Choice], options: SolverOptions) -> tuple[float | None, list | None]:
        """The model's step time (µs) for fixed decisions, and a full assignment to hint with (None: infeasible
        in the model, whose memory accounting is conservative)."""
        from ortools.sat.python import cp_model

        self.m.ClearAssumptions()
        self.m.AddAssumptions(self.literals(choices))
        solver = self._solver(options, max(2.0, options.time_limit_s / 4))
        status = solver.Solve(self.m)
        self.m.ClearAssumptions()
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, None
        return solver.ObjectiveValue() / TIME_SCALE, [(v, solver.Value(v)) for v in self.all_vars]

    def solve(self, options: SolverOptions, hint: list | None) -> tuple[str, dict[str, Choice], float, float] | None:
        from ortools.sat.python import cp_model

        self.m.ClearHints()
        for var, value in hint or ():
            self.m.AddHint(var, value)
        solver = self._solver(options, options.time_limit_s)
        status = solver.Solve(self.m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return (cp_model.OPTIMAL == status and "OPTIMAL" or "FEASIBLE", self.read(solver),
                solver.ObjectiveValue() / TIME_SCALE, solver.BestObjectiveBound() / TIME_SCALE)


def choices_from_plan(problem: Problem, cands: list[Candidate], plan: Plan, *,
                      allow_offload: bool = True) -> dict[str, Choice]:
    """A heuristic plan in the model's terms (nearest release / prefetch options), to start the search from.
    A recompute whose chain reads a moved candidate becomes an offload, or (``allow_offload`` false) a keep."""
    idx = problem.op_index
    offloaded = {d.tensor: d for d in plan.decisions if isinstance(d, Offload)}
    recomputed = {t for d in plan.decisions if isinstance(d, Recompute) for t in d.tensors}
    out: dict[str, Choice] = {}
    for c in cands:
        if c.name in offloaded:
            d = offloaded[c.name]
            release = idx(d.release_before) if d.release_before else c.releases[-1]
            r = max([x for x in c.releases if x <= release], default=c.releases[0])
            p = max([x for x in c.prefetches if x <= idx(d.prefetch_at)], default=c.prefetches[0])
            out[c.name] = Choice.offload(r, max(p, r) if max(p, r) in c.prefetches else c.prefetches[-1])
        elif c.name in recomputed and c.chain is not None:
            out[c.name] = RECOMPUTE
    for name, choice in list(out.items()):  # a chain may only read kept candidates
        c = next(x for x in cands if x.name == name)
        if choice.kind is Kind.RECOMPUTE and any(out.get(t, KEEP).kind is not Kind.KEEP for t in c.needs_kept):
            out[name] = Choice.offload(c.releases[0], c.first_bwd) if allow_offload else KEEP
    return out


def leanest_choices(cands: list[Candidate], allow_offload: bool = True) -> dict[str, Choice]:
    """Everything swapped out synchronously and fetched just in time: the lowest peak the model can reach.
    Without offloading: every candidate with a chain recomputed (a start only; it may break a chain's reads)."""
    if not allow_offload:
        return {c.name: RECOMPUTE for c in cands if c.chain is not None}
    return {c.name: Choice.offload(c.releases[0], c.first_bwd) for c in cands}
