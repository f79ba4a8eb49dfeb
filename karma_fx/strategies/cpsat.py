"""``cpsat``: the exact planner. One OR-Tools CP-SAT model decides jointly, per saved activation, keep /
offload (with its release and prefetch points) / recompute, under the budget at every op, minimising the
step time of the compute stream and the two copy streams (model: ``cpsat_model.py``).

It is never worse than the heuristics: every heuristic plan that fits is simulated, the best one is the
fallback, and the solver's plan is kept only if the simulator confirms it is at least as fast. The status
says which won: OPTIMAL / FEASIBLE (solver, with its bound) or FALLBACK:<strategy>.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from karma_fx.costs import Costs
from karma_fx.plan import Decision, Plan
from karma_fx.problem import Problem
from karma_fx.strategies.base import Strategy, timeline_of
from karma_fx.strategies.cpsat_model import MEMORY_UNIT, TIME_SCALE, Candidate, candidates, chain_time, decisions_from


@dataclass(frozen=True)
class SolverOptions:
    time_limit_s: float = 20.0
    workers: int = 2
    seed: int = 0
    max_candidates: int = 4000
    """Above this many candidates the whole-graph model is not built; the best heuristic is returned."""


@dataclass
class Solution:
    decisions: tuple[Decision, ...]
    status: str
    objective_us: float
    bound_us: float


def _units_up(b: int) -> int:
    return -(-b // MEMORY_UNIT)


def _units_down(b: int) -> int:
    return b // MEMORY_UNIT


def _t(us: float) -> int:
    return int(round(us * TIME_SCALE))


Choice = tuple  # ("keep",) | ("offload", release, prefetch) | ("recompute",)


class Model:
    """The CP-SAT model over ``cands``; decisions can be hinted, fixed (assumptions) and read back."""

    def __init__(self, problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int],
                 cands: list[Candidate]) -> None:
        from ortools.sat.python import cp_model

        self.problem, self.cands = problem, cands
        n = len(problem.ops)
        m = self.m = cp_model.CpModel()
        self.all_vars: list = []

        def int_var(lo: int, hi: int, name: str):
            v = m.NewIntVar(lo, hi, name)
            self.all_vars.append(v)
            return v

        def bool_var(name: str):
            v = m.NewBoolVar(name)
            self.all_vars.append(v)
            return v

        dur = [_t(x) for x in costs.op_time_us]
        d2h = {c.name: _t(costs.copy_time_us(c.size, "d2h")) for c in cands}
        h2d = {c.name: _t(costs.copy_time_us(c.size, "h2d")) for c in cands}
        horizon = sum(dur) + 2 * sum(d2h.values()) + 2 * sum(h2d.values()) \
            + sum(_t(chain_time(costs, c)) for c in cands) + 1

        # ---- decisions ----------------------------------------------------------------------------------
        self.keep, self.rec, self.off, self.rel, self.pre = {}, {}, {}, {}, {}
        for c in cands:
            self.keep[c.name] = bool_var(f"keep_{c.name}")
            self.off[c.name] = bool_var(f"off_{c.name}")
            self.rel[c.name] = {r: bool_var(f"rel_{c.name}_{r}") for r in c.releases}
            self.pre[c.name] = {p: bool_var(f"pre_{c.name}_{p}") for p in c.prefetches}
            parts = [self.keep[c.name], self.off[c.name]]
            if c.chain is not None:
                self.rec[c.name] = bool_var(f"rec_{c.name}")
                parts.append(self.rec[c.name])
            m.AddExactlyOne(parts)
            m.Add(sum(self.rel[c.name].values()) == self.off[c.name])
            m.Add(sum(self.pre[c.name].values()) == self.off[c.name])
            m.Add(sum(r * v for r, v in self.rel[c.name].items()) <= sum(p * v for p, v in self.pre[c.name].items()))
        for c in cands:
            for t in c.needs_kept if c.name in self.rec else ():
                m.AddImplication(self.rec[c.name], self.keep[t])

        # ---- memory, exact at every op by incremental sums ----------------------------------------------
        delta: list[list] = [[] for _ in range(n + 1)]
        temps: dict[int, list] = {}
        for c in cands:
            down = _units_down(c.size)
            for r, v in self.rel[c.name].items():
                delta[r].append(-down * v)
            for p, v in self.pre[c.name].items():
                delta[p].append(down * v)
            if c.name in self.rec:
                x = self.rec[c.name]
                delta[c.last_fwd + 1].append(-down * x)
                delta[c.first_bwd].append(down * x)
                for storage, start, stop in c.extends:
                    up = _units_up(problem.storage(storage).size_bytes)
                    delta[start].append(up * x)
                    delta[stop].append(-up * x)
                if c.chain_temp_bytes:
                    temps.setdefault(c.first_bwd, []).append(_units_up(c.chain_temp_bytes) * x)
        budget_units = _units_down(budget_bytes)
        base = [_units_up(b) for b in base_bytes]
        cap = max(base) + sum(_units_up(c.size) for c in cands) + 1
        previous = 0
        for i in range(n):
            mem = int_var(0, cap, f"mem_{i}")
            m.Add(mem == previous + (base[i] - (base[i - 1] if i else 0)) + sum(delta[i]))
            m.Add(mem + sum(temps.get(i, ())) <= budget_units)
            previous = mem

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
        """Literals that fix every candidate to ``choices`` (missing candidates: keep)."""
        out = []
        for c in self.cands:
            choice = choices.get(c.name, ("keep",))
            if choice[0] == "offload":
                out += [self.off[c.name], self.rel[c.name][choice[1]], self.pre[c.name][choice[2]]]
            elif choice[0] == "recompute" and c.name in self.rec:
                out.append(self.rec[c.name])
            else:
                out.append(self.keep[c.name])
        return out

    def read(self, solver) -> dict[str, Choice]:
        choices: dict[str, Choice] = {}
        for c in self.cands:
            if solver.Value(self.off[c.name]):
                r = next(r for r, v in self.rel[c.name].items() if solver.Value(v))
                p = next(p for p, v in self.pre[c.name].items() if solver.Value(v))
                choices[c.name] = ("offload", r, p)
            elif c.name in self.rec and solver.Value(self.rec[c.name]):
                choices[c.name] = ("recompute",)
            else:
                choices[c.name] = ("keep",)
        return choices

    def decisions(self, choices: dict[str, Choice]) -> tuple[Decision, ...]:
        by_name = {c.name: c for c in self.cands}
        return decisions_from(self.problem, {by_name[k]: (v[0], *(v[1:] or (None, None))) for k, v in choices.items()
                                             if v[0] != "keep"})

    def _solver(self, options: SolverOptions, time_limit_s: float):
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = options.workers
        solver.parameters.random_seed = options.seed
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


def choices_from_plan(problem: Problem, cands: list[Candidate], plan: Plan) -> dict[str, Choice]:
    """A heuristic plan in the model's terms (nearest release / prefetch options), to start the search from."""
    from karma_fx.plan import Offload, Recompute

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
            out[c.name] = ("offload", r, max(p, r) if max(p, r) in c.prefetches else c.prefetches[-1])
        elif c.name in recomputed and c.chain is not None:
            out[c.name] = ("recompute",)
    for name, choice in list(out.items()):  # a chain may only read kept candidates
        c = next(x for x in cands if x.name == name)
        if choice[0] == "recompute" and any(out.get(t, ("keep",))[0] != "keep" for t in c.needs_kept):
            out[name] = ("offload", c.releases[0], c.first_bwd)
    return out


def leanest_choices(cands: list[Candidate]) -> dict[str, Choice]:
    """Everything swapped out synchronously and fetched just in time: the lowest peak the model can reach."""
    return {c.name: ("offload", c.releases[0], c.first_bwd) for c in cands}


class CpSat:
    name = "cpsat"

    def __init__(self, fallbacks: Sequence[Strategy] = (), options: SolverOptions | None = None) -> None:
        self.fallbacks = tuple(fallbacks)
        self.options = options or SolverOptions()

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        keep = timeline_of(problem, costs, ())
        if keep.peak_bytes <= budget_bytes:
            return Plan(strategy=self.name, budget_bytes=budget_bytes, status="OPTIMAL",
                        lower_bound_us=keep.makespan_us, notes=("everything fits: nothing moves",))
        best: tuple[float, Plan] | None = None
        for strategy in self.fallbacks:
            plan = strategy(problem, costs, budget_bytes)
            tl = timeline_of(problem, costs, plan.decisions)
            if tl.peak_bytes <= budget_bytes and (best is None or tl.makespan_us < best[0]):
                best = (tl.makespan_us, plan)
        cands = candidates(problem)
        notes: list[str] = [f"{len(cands)} candidates"]
        if len(cands) > self.options.max_candidates:
            notes.append(f"more than {self.options.max_candidates} candidates: whole-graph model skipped")
            cands = []
        if cands:
            model = Model(problem, costs, budget_bytes, [b for _, b in keep.memory], cands)
            starts = [leanest_choices(cands)] + ([choices_from_plan(problem, cands, best[1])] if best else [])
            hint, hint_time = None, math.inf
            for choices in starts:
                t, assignment = model.evaluate(choices, self.options)
                if t is not None and t < hint_time:
                    hint, hint_time = assignment, t
            result = model.solve(self.options, hint)
            if result is None:
                notes.append("solver found no plan in its time limit")
            else:
                status, choices, objective, bound = result
                decisions = model.decisions(choices)
                predicted, _ = model.evaluate(choices, self.options)
                tl = timeline_of(problem, costs, decisions)
                notes.append(f"solver {status}: predicted {(predicted or objective) / 1e3:.3f} ms, simulated "
                             f"{tl.makespan_us / 1e3:.3f} ms, bound {bound / 1e3:.3f} ms")
                if tl.peak_bytes <= budget_bytes and (best is None or tl.makespan_us <= best[0]):
                    return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=decisions, status=status,
                                lower_bound_us=max(bound, keep.makespan_us),
                                notes=tuple(notes) + (f"predicted_us={predicted or objective:.3f}",))
        if best is None:
            return Plan(strategy=self.name, budget_bytes=budget_bytes, status="INFEASIBLE", notes=tuple(notes))
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=best[1].decisions,
                    status=f"FALLBACK:{best[1].strategy}", notes=tuple(notes) + best[1].notes)
