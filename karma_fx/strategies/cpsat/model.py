"""The exact planner's model: candidates and their options as plain data, then one CP-SAT model over them.

Formulation (it is "F" of the probe that compared CP-SAT formulations: all linear, with a tight LP bound,
where interval variables with enforcement literals gave a flat bound and no plan at 48 layers):

* the compute order is the traced order; positions are ops;
* each candidate (a saved activation) is kept, recomputed from what the unplanned step still holds at its
  first backward read, or offloaded: copied out after its producer, *released* (compute waits for the copy
  before position r, the device bytes are free from r), and prefetched at position p, waited for before its
  first backward read b; r and p come from short candidate lists;
* memory is exact at every position by incremental sums (it depends on where tensors leave and come back,
  never on timing), rounded to 64 KiB units with savings rounded down and usage up;
* time is the compute stream with a wait variable at every position, plus two FIFO copy streams in the order
  the runtime issues them (offloads by producer, prefetches by issue position), exactly as the simulator
  replays them, so the model's step time and the simulator's agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from karma_fx.costs import Costs
from karma_fx.dependencies import dependency_graph, recompute_ops
from karma_fx.plan import Decision, Offload, Recompute
from karma_fx.problem import Problem
from karma_fx.strategies.base import ResidentAt, _alive_at, saved_gaps
from karma_fx.strategies.cpsat.choice import KEEP, RECOMPUTE, Choice, Kind

MEMORY_UNIT = 64 * 1024
TIME_SCALE = 10  # model time unit: 0.1 µs


@dataclass(eq=False)
class Candidate:
    name: str
    size: int
    producer: int
    last_fwd: int
    first_bwd: int
    releases: list[int]
    prefetches: list[int]
    chain: tuple[int, ...] | None = None
    chain_time: float = 0.0
    chain_temp_bytes: int = 0
    needs_kept: list[str] = field(default_factory=list)
    extends: list[tuple[str, int, int]] = field(default_factory=list)  # (storage, from position, to position)


def candidates(problem: Problem, min_bytes: int = MEMORY_UNIT, choices: int = 3,
               max_chain: int = 24) -> list[Candidate]:
    """The saved activations worth deciding on, each with its release / prefetch positions and recompute chain."""
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
    made = {s for i in chain for s in problem.ops[i].outputs}
    reads = {s for i in chain for s in problem.ops[i].inputs} - made
    cand.chain = chain
    cand.chain_temp_bytes = sum(problem.storage(s).size_bytes for s in made if s != cand.name)
    cand.needs_kept = sorted(r for r in reads if r in names)
    for r in sorted(reads - names):
        st = problem.storage(r)
        if not _alive_at(st, b):  # a forward-only output the chain keeps alive until b
            last = max(st.users, default=st.producer or 0)
            cand.extends.append((r, last + 1, b))


def chain_time(costs: Costs, cand: Candidate) -> float:
    return sum(costs.op_time_us[i] for i in cand.chain or ())


def decisions_from(problem: Problem, chosen: dict[Candidate, Choice]) -> tuple[Decision, ...]:
    """Decisions in the order the runtime issues them: offloads by (producer, name) so the D2H FIFO matches,
    then (stable) prefetch order is by reload position, which the model keeps monotone in issue position."""
    ops = problem.ops
    out: list[Decision] = []
    offloads = sorted(((c, x) for c, x in chosen.items() if x.kind is Kind.OFFLOAD),
                      key=lambda e: (e[0].first_bwd, e[0].name))
    for c, x in offloads:
        assert x.release is not None and x.prefetch is not None
        out.append(Offload(tensor=c.name, offload_after=ops[c.producer].name, free_after=ops[c.last_fwd].name,
                           prefetch_at=ops[x.prefetch].name, reload_before=ops[c.first_bwd].name,
                           release_before=ops[x.release].name))
    # Recomputes at the same op run in production order, so a chain finds the tensors it reads rebuilt.
    for c, x in sorted(chosen.items(), key=lambda e: (e[0].first_bwd, e[0].producer, e[0].name)):
        if x.kind is Kind.RECOMPUTE:
            out.append(Recompute(tensors=(c.name,), ops=tuple(ops[i].name for i in c.chain or ()),
                                 reload_before=ops[c.first_bwd].name))
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
    memory: list = field(default_factory=list)
    """Per op: (its memory variable, the base change at the op, (coefficient, literal) terms of the plan's
    change, and of the recompute temporaries that count at that op only)."""
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
                for name in c.needs_kept:
                    kind = choices.get(name, KEEP).kind
                    back = kind is Kind.OFFLOAD or (kind is Kind.RECOMPUTE and name in self.rec)
                    if not (kind is Kind.KEEP or (back and by_name[name].first_bwd <= c.first_bwd)):
                        return False
        return True

    def memory_values(self, value) -> list[tuple[object, int]] | None:
        """Every memory variable's value under fixed literals (``value`` maps a literal to 0/1), or ``None``
        where the choices exceed the budget at some op: the memory check of a fixed-decision model, without
        a solve."""
        out, previous = [], 0
        for mem, base_change, delta, temps in self.memory:
            previous += base_change + sum(k * value(v) for k, v in delta)
            if previous < 0 or previous + sum(k * value(v) for k, v in temps) > self.budget_units:
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
            else:
                choices[c.name] = KEEP
        return choices


def add_decisions_and_memory(m, problem: Problem, cands: list[Candidate], base_bytes, budget_bytes: int,
                             unit: int = MEMORY_UNIT, *, allow_offload: bool = True) -> DecisionVars:
    """Decision literals (keep / offload at (release, prefetch) / recompute) and the memory constraint at
    every op, by incremental sums in ``unit``-byte units (savings rounded down, usage up: at 1 MiB units a
    plan at 99.9% of the budget could be rejected, at 64 KiB it is not). ``allow_offload=False`` fixes every
    offload literal to 0 (no host link: keep or recompute only)."""
    created: list = []

    def bool_var():
        v = m.NewBoolVar("")
        created.append(v)
        return v

    dv = DecisionVars({}, {}, {}, {}, {}, created, allow_offload=allow_offload)
    by_name = {c.name: c for c in cands}
    for c in cands:
        dv.keep[c.name], dv.off[c.name] = bool_var(), bool_var()
        dv.rel[c.name] = {r: bool_var() for r in c.releases}
        dv.pre[c.name] = {p: bool_var() for p in c.prefetches}
        parts = [dv.keep[c.name], dv.off[c.name]]
        if c.chain is not None:
            dv.rec[c.name] = bool_var()
            parts.append(dv.rec[c.name])
        m.AddExactlyOne(parts)
        if not allow_offload:
            m.Add(dv.off[c.name] == 0)
        m.Add(sum(dv.rel[c.name].values()) == dv.off[c.name])
        m.Add(sum(dv.pre[c.name].values()) == dv.off[c.name])
        m.Add(sum(r * v for r, v in dv.rel[c.name].items()) <= sum(p * v for p, v in dv.pre[c.name].items()))
    for c in cands:
        for name in c.needs_kept if c.name in dv.rec else ():
            # A chain reads candidate t: t must be on the device at the chain, i.e. kept, or back already
            # (recomputed or prefetched at its own first backward read, no later than this one).
            t = by_name[name]
            back = ([dv.off[name]] + ([dv.rec[name]] if name in dv.rec else [])) if t.first_bwd <= c.first_bwd else []
            m.Add(dv.rec[c.name] <= dv.keep[name] + sum(back))

    # Memory as (coefficient, literal) terms per op, kept on ``dv`` so fixed choices can be checked in Python.
    delta: list[list[tuple[int, object]]] = [[] for _ in range(len(problem.ops) + 1)]
    temps: dict[int, list[tuple[int, object]]] = {}
    up = lambda b: -(-b // unit)  # noqa: E731
    for c in cands:
        down = c.size // unit
        for r, v in dv.rel[c.name].items():
            delta[r].append((-down, v))
        for p, v in dv.pre[c.name].items():
            delta[p].append((down, v))
        if c.name in dv.rec:
            x = dv.rec[c.name]
            delta[c.last_fwd + 1].append((-down, x))
            delta[c.first_bwd].append((down, x))
            for storage, start, stop in c.extends:
                size = up(problem.storage(storage).size_bytes)
                delta[start].append((size, x))
                delta[stop].append((-size, x))
            if c.chain_temp_bytes:
                temps.setdefault(c.first_bwd, []).append((up(c.chain_temp_bytes), x))
    base = [up(b) for b in base_bytes]
    cap = max(base) + sum(up(c.size) for c in cands) + 1
    budget_units = budget_bytes // unit
    previous = 0
    for i in range(len(problem.ops)):
        mem = m.NewIntVar(0, cap, "")
        created.append(mem)
        m.Add(mem == previous + base[i] - (base[i - 1] if i else 0) + sum(k * v for k, v in delta[i]))
        m.Add(mem + sum(k * v for k, v in temps.get(i, ())) <= budget_units)
        dv.memory.append((mem, base[i] - (base[i - 1] if i else 0), delta[i], temps.get(i, [])))
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
    against a pathological run (that cap, if ever hit, is the one non-reproducible exit)."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s * DETERMINISTIC_UNITS_PER_S
    solver.parameters.max_time_in_seconds = 4 * time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = seed
    solver.parameters.interleave_batch_size = INTERLEAVE_BATCH
    return solver
