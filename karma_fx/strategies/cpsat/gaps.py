"""General rematerialization as one CP-SAT model over idle gaps (``strategies.remat``'s exact pass).

A choice is a gap ``g = (s, a, b)``: tensor ``s`` is dropped after op ``a`` (its producer or a read) and its
producer re-run just before op ``b`` (its next read), reading its inputs there. An input that the unplanned
step has freed by then is kept alive until that rebuild instead (the simulator extends a tensor's life to its
last reader, rebuilds included): keeping a small input instead of a large output is half of what
rematerialization gains on a layered graph. An input a chosen gap drops across ``b`` cannot be read there, so
those two gaps exclude each other.

Memory is counted at each op and at the rebuilds just before it: the unplanned bytes there, less every chosen
gap open across the op, plus every input kept alive for a rebuild at or after it. Minimised: the recompute
time. One rebuild per gap and single-op rebuilds make it a restriction of Checkmate's model (a plan outside it
may be faster) and the op-level count may miss a rebuild's own transients: the simulator judges the result,
and ``remat`` tightens the budget by what it missed and solves again.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from ortools.sat.python import cp_model

from karma_fx.costs import Costs
from karma_fx.problem import Problem
from karma_fx.strategies.cpsat.model import time_scale



def solve_gaps(problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int], gaps: Sequence,
               *, hint: Sequence[int] = (), time_limit_s: float = 10.0, workers: int = 2, seed: int = 0
               ) -> tuple[str, list[int]] | None:
    """The indices of the gaps to take (``gaps``: ``remat.IdleGap``), with CP-SAT's status, or None when the
    model has no solution in time (or none at all). ``base_bytes``: the unplanned device bytes at each op;
    ``hint``: the indices of a plan to start from."""
    ops = problem.ops
    n = len(ops)
    model = cp_model.CpModel()
    x = [model.NewBoolVar(f"g{k}") for k in range(len(gaps))]
    out_bytes = [sum(problem.storage(o).size_bytes for o in op.outputs) for op in ops]
    last_read = {s.name: max(s.users, default=s.producer if s.producer is not None else -1) for s in problem.storages}
    # resident all step: what lives to the end (weights, outputs); a graph input that does not (a tangent) is
    # freed after its last read, and a rebuild reading it later keeps it alive until then
    always = {s.name for s in problem.storages if s.lives_to_end}

    open_at: dict[int, list[int]] = defaultdict(list)  # op -> gaps open across it
    for k, g in enumerate(gaps):
        for t in range(g.after + 1, g.before):
            open_at[t].append(k)
    by_tensor: dict[str, list[int]] = defaultdict(list)
    for k, g in enumerate(gaps):
        by_tensor[g.tensor].append(k)

    # kept[s][t]: input s alive at the rebuilds before op t (and so at every op before t down to its last read)
    kept: dict[str, dict[int, cp_model.IntVar]] = defaultdict(dict)
    for k, g in enumerate(gaps):
        producer = problem.storage(g.tensor).producer
        for name in ops[producer].inputs:
            if name in always:
                continue
            for j in by_tensor.get(name, ()):  # the input must not be away when this rebuild reads it
                other = gaps[j]
                if other.after < g.before <= other.before:
                    model.AddBoolOr([x[k].Not(), x[j].Not()])
            if last_read[name] >= g.before:
                continue
            ext = kept[name]
            for t in range(last_read[name] + 1, g.before + 1):
                if t not in ext:
                    ext[t] = model.NewBoolVar(f"kept_{name}_{t}")
            model.AddImplication(x[k], ext[g.before])
    for name, ext in kept.items():  # kept at t means kept at every op down to its last read
        for t in sorted(ext):
            if t - 1 in ext:
                model.AddImplication(ext[t], ext[t - 1])
    kept_at: dict[int, list[tuple[str, int, cp_model.IntVar]]] = defaultdict(list)
    for name, ext in kept.items():
        size = problem.storage(name).size_bytes
        for t, var in ext.items():
            kept_at[t].append((name, size, var))

    rebuilt_before = {g.before for g in gaps}
    for t in range(n):
        dropped = [gaps[k].size_bytes * x[k] for k in open_at.get(t, ())]
        # at op t: inputs kept for a rebuild after t (kept at t + 1), beyond their own last read
        held = [size * var for name, size, var in kept_at.get(t + 1, ()) if t > last_read[name]]
        if dropped or held:
            model.Add(base_bytes[t] - sum(dropped) + sum(held) <= budget_bytes)
        if t in rebuilt_before:  # the rebuilds before op t: its output not yet made, inputs kept for them
            held_here = [size * var for _, size, var in kept_at.get(t, ())]
            model.Add(base_bytes[t] - out_bytes[t] - sum(dropped) + sum(held_here) <= budget_bytes)
    scale = time_scale(problem, costs)  # recompute time in integer units, at least 0.1 µs
    work = [int(round(costs.rebuild_us(problem, problem.storage(g.tensor).producer) * scale)) for g in gaps]
    model.Minimize(sum(w * v for w, v in zip(work, x)))
    chosen = set(hint)
    for k, v in enumerate(x):
        model.AddHint(v, 1 if k in chosen else 0)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return solver.StatusName(status), [k for k, v in enumerate(x) if solver.BooleanValue(v)]
