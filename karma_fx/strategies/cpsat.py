"""``cpsat``: the exact planner. One OR-Tools CP-SAT model decides jointly, per saved activation, keep /
offload (with its release and prefetch points) / recompute, under the budget at every op, minimising the
step time of the compute stream and the two copy streams (model: ``cpsat_model.py``).

It is never worse than the heuristics: every heuristic plan that fits is simulated, the best one is the
fallback, and the solver's plan is kept only if the simulator confirms it is at least as fast. The status
says which won: OPTIMAL / FEASIBLE (solver, with its bound) or FALLBACK:<strategy>.

Without a host link (``costs.allow_offload`` false) the fallbacks, the models and the bound only keep or
recompute: this is then Checkmate's problem (rematerialization under a memory budget).

``CpSat(time_limit_s=...)`` bounds the whole call by the wall clock (``karma_fx.progress.deadline``): the lower
bound, each heuristic, each solver model and each window starts only while time is left, every solve is cut to
the time left, and the best plan so far is returned, noting that the limit stopped it. Until some heuristic
has made a plan that fits, the heuristics run even past the limit (the cheapest come first), so the caller
always gets a plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.plan import Decision, Plan
from karma_fx.problem import Problem
from karma_fx.simulate import paused_gc
from karma_fx.strategies.base import Strategy, leanest_decisions, leanest_moves, timeline_of
from karma_fx.strategies.bound import lower_bound_us
from karma_fx.strategies.cpsat_capacity import solve_capacity
from karma_fx.strategies.cpsat_window import refine_in_windows
from karma_fx.strategies.cpsat_model import (MEMORY_UNIT, TIME_SCALE, Candidate, add_decisions_and_memory, candidates,
                                            chain_time, decisions_from, deterministic_solver)


@dataclass(frozen=True)
class SolverOptions:
    time_limit_s: float = 20.0
    workers: int = 2
    seed: int = 0
    max_candidates: int = 200
    """Above this many candidates the whole-graph CP-SAT models are not built; the best heuristic is returned
    with the LP bound. Measured (bench/compare.py, H100 spec, 0.7 to 0.25): they improved on the heuristics at
    wrn28_10 (63 candidates) and resnet50 (105), never at gpt2 (221) or bert (239), where they cost ~60 s a
    plan for nothing."""
    memory_unit_bytes: int = MEMORY_UNIT
    """Granularity of the memory constraints; candidates smaller than this stay on the device."""
    good_enough_gap: float = 0.01
    """Skip the CP-SAT models when the best heuristic is proven within this fraction of the LP bound."""
    window_size: int = 30
    max_windows: int = 4
    """The rolling-window refinement (``cpsat_window``): at most this many windows of ``window_size``
    candidates are re-solved around the best plan."""
    max_window_ops: int = 2000
    """No windows on graphs with more ops: each window model times every op. Measured (bench/compare.py):
    windows gained on resnet50 (403 ops) and resnet200 (1553), never on megatron_gpt (2755), where they
    cost ~25 s a plan, nor on any transformer; with them cpsat took 182 s on gpt2 with 48 layers (3545 ops)."""


@dataclass
class Solution:
    decisions: tuple[Decision, ...]
    status: str
    objective_us: float
    bound_us: float


def _t(us: float) -> int:
    return int(round(us * TIME_SCALE))


Choice = tuple  # ("keep",) | ("offload", release, prefetch) | ("recompute",)


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
        return decisions_from(self.problem, {by_name[k]: (v[0], *(v[1:] or (None, None))) for k, v in choices.items()
                                             if v[0] != "keep"})

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
            out[name] = ("offload", c.releases[0], c.first_bwd) if allow_offload else ("keep",)
    return out


def leanest_choices(cands: list[Candidate], allow_offload: bool = True) -> dict[str, Choice]:
    """Everything swapped out synchronously and fetched just in time: the lowest peak the model can reach.
    Without offloading: every candidate with a chain recomputed (a start only; it may break a chain's reads)."""
    if not allow_offload:
        return {c.name: ("recompute",) for c in cands if c.chain is not None}
    return {c.name: ("offload", c.releases[0], c.first_bwd) for c in cands}


class CpSat:
    name = "cpsat"

    def __init__(self, fallbacks: Sequence[Strategy] = (), options: SolverOptions | None = None, *,
                 time_limit_s: float | None = None) -> None:
        self.fallbacks = tuple(fallbacks)
        self.options = options or SolverOptions()
        self.time_limit_s = time_limit_s

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        # paused GC: hundreds of replays and big models built over one large problem
        with paused_gc(), progress.deadline(self.time_limit_s):
            return self._plan(problem, costs, budget_bytes)

    def _plan(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        keep = timeline_of(problem, costs, ())
        if keep.peak_bytes <= budget_bytes:
            return Plan(strategy=self.name, budget_bytes=budget_bytes, status="OPTIMAL",
                        lower_bound_us=keep.makespan_us, notes=("everything fits: nothing moves",))
        base = [b for _, b in keep.memory]
        opts = self.options
        notes: list[str] = []
        stopped: list[str] = []

        def out_of_time() -> bool:
            """Past the deadline: skip the next piece of work, and say once in the notes that it was cut."""
            if progress.past_deadline():
                if not stopped:
                    stopped.append(progress.stopped_note())
                return True
            return False

        # A proven lower bound on the step time of every plan (the LP relaxation of ``bound.py``), or a proof
        # that no plan fits at all. Skipped only when the deadline has passed already.
        proven: float | None = None
        if not out_of_time():
            progress.report("lower bound", strategy=self.name)
            proven = lower_bound_us(problem, costs, budget_bytes, base)
            if proven is None:
                return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=leanest_moves(problem, costs),
                            status="INFEASIBLE", notes=(
                                "no plan can fit this budget: a relaxed model of every possible plan (a linear "
                                "program) proves it; the plan with the lowest peak is returned",))
            notes.append(f"no plan can be faster than {proven / 1e3:.3f} ms at this budget (a proven lower bound)")
        best: tuple[float, Plan, int] | None = None  # simulated step time, plan, simulated peak

        def say(stage: str, strategy: str) -> None:
            progress.report(stage, strategy=strategy, slowdown=best[0] / keep.makespan_us if best else None,
                            peak_bytes=best[2] if best else None)

        for strategy in self.fallbacks:
            if best is not None and out_of_time():
                break  # until a plan fits, the heuristics run even past the deadline
            say("heuristics", strategy.name)
            plan = strategy(problem, costs, budget_bytes)
            tl = timeline_of(problem, costs, plan.decisions)
            if tl.peak_bytes <= budget_bytes and (best is None or tl.makespan_us < best[0]):
                best = (tl.makespan_us, plan, tl.peak_bytes)

        def fallback(*why: str) -> Plan:
            assert best is not None
            extra = tuple(n for n in best[1].notes if n not in stopped)
            return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=best[1].decisions,
                        status=f"FALLBACK:{best[1].strategy}", lower_bound_us=proven,
                        notes=tuple(notes) + why + extra + tuple(stopped))

        if best is not None and proven is not None and best[0] <= proven * (1 + opts.good_enough_gap):
            return fallback(f"{best[1].strategy}'s plan is within {best[0] / proven - 1:.2%} of the lower bound, so "
                            "the solver was not run")
        cands = candidates(problem, min_bytes=opts.memory_unit_bytes)
        notes.append(f"{len(cands)} tensors large enough for the solver to decide on")
        all_cands = cands
        if len(cands) > opts.max_candidates:
            notes.append(f"more than {opts.max_candidates} of them: the whole-graph solver was not run (too slow "
                         "at that size)")
            cands = []
        if cands and not out_of_time():
            best = self._solve_whole(problem, costs, budget_bytes, base, cands, best, proven, notes, say)
        if best is None:  # no heuristic fits: the leanest plan is the last resort, and the floor quoted to users
            leanest = leanest_decisions(problem, costs)
            if timeline_of(problem, costs, leanest).peak_bytes <= budget_bytes:
                return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=leanest,
                            status="FALLBACK:leanest", lower_bound_us=proven,
                            notes=tuple(notes) + ("only the leanest plan fits: every saved tensor moved out and back "
                                                  "just in time",) + tuple(stopped))
            return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=leanest,
                        status="INFEASIBLE", lower_bound_us=proven,
                        notes=tuple(notes) + ("no plan found fits: the plan with the lowest peak is returned",)
                        + tuple(stopped))
        if (len(problem.ops) <= opts.max_window_ops and (proven is None or best[0] > proven * (1 + opts.good_enough_gap))
                and not out_of_time()):
            window_opts = SolverOptions(opts.time_limit_s / 4, opts.workers, opts.seed,
                                        memory_unit_bytes=opts.memory_unit_bytes)
            say("solver windows", self.name)
            refined, window_notes = refine_in_windows(problem, costs, budget_bytes, best[1].decisions, best[0],
                                                      all_cands, size=opts.window_size,
                                                      max_windows=opts.max_windows, options=window_opts)
            notes.extend(window_notes)
            out_of_time()  # the windows stop at the deadline too: say so if they did
            if refined != best[1].decisions:
                origin = "the solver's" if best[1].strategy == self.name else f"{best[1].strategy}'s"
                return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=refined, status="FEASIBLE",
                            lower_bound_us=proven, notes=tuple(notes) + (f"the windows improved {origin} plan",)
                            + tuple(stopped))
        if best[1].strategy == self.name:
            return replace(best[1], notes=tuple(notes) + tuple(stopped))
        return fallback()

    def _solve_whole(self, problem: Problem, costs: Costs, budget_bytes: int, base: list[int], cands: list[Candidate],
                     best: tuple[float, Plan, int] | None, proven: float | None, notes: list[str],
                     say) -> tuple[float, Plan, int] | None:
        """The whole-graph models: the all-linear capacity model picks decisions among the candidates' options,
        then the exact FIFO model times them and polishes from the best start it is given. Returns the new best
        (simulated time, plan, peak): the solver's plan if the simulator says it fits and is no slower."""
        opts = self.options
        say("solver, memory-only pass", self.name)
        phase1 = solve_capacity(problem, costs, budget_bytes, base, cands,
                                time_limit_s=min(opts.time_limit_s, max(progress.seconds_left() / 4, 0.01)),
                                workers=opts.workers, seed=opts.seed, unit=opts.memory_unit_bytes)
        if phase1 is not None:
            notes.append(f"solver, memory-only pass: {phase1[2].lower()} (at best {phase1[1] / 1e3:.3f} ms with "
                         "the copy and release points it considers)")
        if progress.past_deadline():
            return best
        say("solver, exact pass", self.name)
        model = Model(problem, costs, budget_bytes, base, cands, opts.memory_unit_bytes)
        starts = [leanest_choices(cands, costs.allow_offload)] + ([phase1[0]] if phase1 else []) \
            + ([choices_from_plan(problem, cands, best[1], allow_offload=costs.allow_offload)] if best else [])
        hint, hint_time = None, math.inf
        for choices in starts:
            if progress.past_deadline():
                break
            t, assignment = model.evaluate(choices, opts)
            if t is not None and t < hint_time:
                hint, hint_time = assignment, t
        if progress.past_deadline():
            return best
        result = model.solve(SolverOptions(opts.time_limit_s / 4, opts.workers, opts.seed), hint)
        if result is None:
            notes.append("the solver found no plan in its time limit")
            return best
        status, choices, objective, _ = result
        decisions = model.decisions(choices)
        predicted, _ = model.evaluate(choices, opts)
        tl = timeline_of(problem, costs, decisions)
        quality = "optimal" if status == "OPTIMAL" else "best found"
        notes.append(f"solver, exact pass: {quality} among the points it considers, predicted "
                     f"{(predicted or objective) / 1e3:.3f} ms, simulated {tl.makespan_us / 1e3:.3f} ms")
        if tl.peak_bytes <= budget_bytes and (best is None or tl.makespan_us <= best[0]):
            solved = Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=decisions, status=status,
                          lower_bound_us=proven, predicted_step_time_us=round(predicted or objective, 3),
                          notes=tuple(notes))
            return (tl.makespan_us, solved, tl.peak_bytes)
        return best
