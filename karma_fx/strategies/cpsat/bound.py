"""A proven lower bound on the step time of any activation plan at a budget: one MIP (SCIP) or LP (GLOP).

Why a separate model: the CP-SAT models only choose among the options they are given (a few release and
prefetch points, one recompute chain per tensor or per segment), so their bound holds inside that option
space only; a heuristic outside it (a recompute chain shared by tensors of no one segment, say) can beat it.
This LP is a relaxation of *every* plan the runtime can execute, so no plan, ours or a baseline's, can be
faster than it says.

The relaxation, for every saved activation ``s`` (all of them, however small):

* ``y_s`` in [0, 1]: recomputed. Recomputing ``s`` runs its producer again at least once, so it costs at least
  the producer's rebuild price (``Costs.rebuild_us``: its time, or the share of it a chain the backward's loops
  join costs, which is never more than the simulator charges), shared equally among the saved outputs of a
  multi-output op;
* ``x_s,i`` in [0, 1]: away on the host while op ``i`` runs (only inside ``s``'s gap, between its last forward
  read and its first backward read), at most ``x_s``, with ``x_s + y_s <= 1``;
* memory at every checked op ``i``: the unplanned bytes minus the sizes away or recomputed ``<= budget``;
* time: ``T(k) = compute before k + S(k)`` with ``S`` non-decreasing (stalls and recomputes so far), and
  the step takes at least ``T(end)``; every recompute is in ``S(end)``;
* each copy stream is a capacity: whatever is away at op ``i`` and was produced at or after op ``a`` was
  copied out between ``T(a)`` and ``T(i)``; whatever is away at ``i`` and is read again by op ``q`` came back
  between ``T(i)`` and ``T(q)``; and all copies out (in) take at most the step time.

Why it is a lower bound: map any executable plan to a solution of the same cost or less. ``x_s,i`` = 1
where ``s`` is on the host at ``i`` (its copies cost at least one copy each way, however many trips it makes),
``y_s`` = 1 where it is dropped and rebuilt; the memory rows then hold (the relaxation claims a recomputed
tensor's bytes over its whole gap, at least what the plan frees), every copy really runs inside the windows
its row names, and the stalls, recomputes and copy-op calls (``Costs.copy_issue_us``, two a swapped tensor
at least) the plan runs are at least ``S(end)``. Checking memory and time
at a subset of ops only drops constraints, so the bound stays valid; the subset is what keeps the LP small on
graphs of tens of thousands of ops. On small graphs (``FULL_RESOLUTION_VARIABLES``) every op is checked too,
as a second LP, and the larger of the two bounds is returned.

What it does not charge (looser, still valid): each op's re-run is counted once however many tensors,
gaps or chains need it; a copy's fixed latency is paid fractionally by the LP; copies of a hosted temporary
count only against the stream totals. One assumption the mapping needs: a temporary kept alive for a
rebuild is charged until the first backward read that needs it, so a plan that rebuilds a tensor early (in
its gap, before the last checked op) from a temporary it kept alive is not mapped exactly; such a plan keeps
both the temporary and the rebuilt tensor and is dominated on these graphs, and the tests of the bound
(every strategy's plans, an enumerated plan family on random steps) hold. Plans that stream weights move other bytes and
are not covered, nor are plans that swap out tensors the backward makes (the leanest plan may:
``leanest.backward_swaps``); the planner claims no bound for those. Without a host link
(``costs.allow_offload`` false) every ``x`` and every temporary's "sent to
the host" share is fixed to 0: the bound is then one on recompute-only plans, tighter than the general one
and still proven (it relaxes only what a recompute-only plan can do).
"""
from __future__ import annotations

import bisect
from typing import Sequence

from karma_fx.costs import Costs
from karma_fx.problem import Problem
from karma_fx.strategies.base import _alive_at, saved_gaps
from karma_fx.strategies.cpsat.capacity import spread_evenly

MAX_AWAY_VARIABLES = 60_000
FULL_RESOLUTION_VARIABLES = 10_000
"""Up to this many (saved tensor, over-budget op) pairs every over-budget op is checked and every op is a time
point: the sampled checks lose most of the bound on small graphs (resnet1001 tiny @0.5: 483.3 µs at 48
points, 489.1 at all of them, 116 over-budget ops x 77 saved tensors, 3.7 s)."""
ROOT_CUT_ROUNDS = 1
"""SCIP's rounds of cutting planes at the root. Its default (unlimited until they stall) spent 60 of 62 s on
wrn28_10 tiny (71 ops, 920 binaries) for a root bound the node search reaches anyway: 1 round, 1.6 s, the
same bound. The limit is on rounds, not time, so the bound stays the same on every machine."""
_EXTRA = 1e-6  # GLOP's tolerances: the bound is taken a hair below the LP optimum


def lower_bound_us(problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int], *,
                   memory_points: int = 48, time_points: int = 48, max_integer_vars: int = 2_000,
                   mip_nodes: int = 100) -> float | None:
    """The bound on the step time (µs) of any activation plan that peaks within ``budget_bytes``, given the
    unplanned step's device bytes at every op (``base_bytes``); ``None`` when no such plan exists at all (the
    budget is below what removing every saved activation could reach).

    Whether a tensor is away is really 0 or 1; a fraction of a tensor freeing a fraction of the bytes makes
    the plain LP weak where one tensor decides (a 4-byte overshoot "solved" by 0.4% of a 1000-byte copy). Up
    to ``max_integer_vars`` those choices are integral and SCIP's best bound after ``mip_nodes`` nodes is
    taken (a node limit, not a time limit, so the bound is the same on every machine); above, the LP."""
    n = len(problem.ops)
    prefix = costs.op_starts_us()
    over = [i for i in range(n) if base_bytes[i] > budget_bytes]
    if not over:
        return prefix[-1]
    gaps = [g for g in saved_gaps(problem) if g.last_fwd_use + 1 < g.first_bwd_use]
    sampled = _solve(problem, costs, budget_bytes, base_bytes, over, gaps, memory_points, time_points,
                     max_integer_vars, mip_nodes)
    if sampled is None or len(over) * len(gaps) > FULL_RESOLUTION_VARIABLES:
        return sampled
    # Small graph: the same relaxation checked at every op as well (an LP at that size). Each is a valid
    # bound, so the larger one is; the sampled one wins where its integral copies matter more than the
    # checks it skips (wrn28_10 tiny @0.7), the full one elsewhere (resnet1001 tiny @0.5).
    full = _solve(problem, costs, budget_bytes, base_bytes, over, gaps, n + 1, n + 1, 0, mip_nodes)
    return sampled if full is None else max(sampled, full)


def _solve(problem: Problem, costs: Costs, budget_bytes: int, base_bytes: Sequence[int], over: list[int],
           gaps: list, memory_points: int, time_points: int, max_integer_vars: int, mip_nodes: int) -> float | None:
    """The relaxation checked at ``memory_points`` of the over-budget ops and ``time_points`` time points,
    integral up to ``max_integer_vars`` (see ``lower_bound_us``)."""
    from ortools.linear_solver import pywraplp

    n = len(problem.ops)
    prefix = costs.op_starts_us()
    # Fewer checked ops on big graphs: a tensor costs a variable per checked op inside its gap (resnet1001:
    # 2,000+ saved activations, 78 s at 48 points), and checking fewer ops only loosens the bound.
    memory_points = max(12, min(memory_points, MAX_AWAY_VARIABLES // max(1, len(gaps))))
    worst = sorted(over, key=lambda i: -base_bytes[i])[: memory_points // 2]
    checked = sorted(set(worst) | set(spread_evenly(over, memory_points - len(worst))))
    events = [g.storage.producer + 1 for g in gaps] + [g.first_bwd_use for g in gaps]
    sync = sorted(set(checked) | set(spread_evenly(sorted(set(events)), time_points)) | {0, n})

    integral = sum(1 for g in gaps for i in checked if g.last_fwd_use < i < g.first_bwd_use) <= max_integer_vars
    lp = pywraplp.Solver.CreateSolver("SCIP") if integral else None
    if lp is None:
        integral, lp = False, pywraplp.Solver.CreateSolver("GLOP")
    else:
        # SCIP would take Ctrl-C for itself (stopping the solve, planning on): it is the user's, see
        # ``model.deterministic_solver``
        lp.SetSolverSpecificParametersAsString(f"limits/nodes = {mip_nodes}\n"
                                               f"separating/maxroundsroot = {ROOT_CUT_ROUNDS}\n"
                                               "misc/catchctrlc = FALSE\n")
        lp.SetTimeLimit(120_000)  # a guard only: the node limit ends the search
    inf = lp.infinity()
    var01 = (lambda: lp.IntVar(0, 1, "")) if integral else (lambda: lp.NumVar(0, 1, ""))
    stall = {k: lp.NumVar(0, inf, "") for k in sync}
    for a, b in zip(sync, sync[1:]):
        lp.Add(stall[a] <= stall[b])
    lp.Add(stall[0] == 0)
    end = stall[n]

    rerun: dict[int, object] = {}  # op -> r_o: the op runs again (its time counted once, for all its outputs)

    def rerun_of(op: int):
        if op not in rerun:
            rerun[op] = var01()
        return rerun[op]

    away: dict[int, list[tuple]] = {i: [] for i in checked}  # i -> [(gap, x_s,i)]
    relief: dict[int, list] = {i: [] for i in checked}  # i -> (variable, bytes it frees there)
    copies_out, copies_in = [], []
    swapped = []  # x_s of every tensor: each swap issues two copy ops, ``Costs.copy_issue_us`` of compute each
    saved = {g.storage.name for g in gaps}
    temps: dict[str, object] = {}  # dead forward temporary -> its "rebuilt" variable
    for g in sorted(gaps, key=lambda g: (g.first_bwd_use, g.storage.name)):
        size = g.storage.size_bytes
        x = var01()
        if not costs.allow_offload:
            lp.Add(x == 0)
        copies_out.append(costs.copy_time_us(size, "d2h") * x)
        copies_in.append(costs.copy_time_us(size, "h2d") * x)
        swapped.append(x)
        inside = [i for i in checked if g.last_fwd_use < i < g.first_bwd_use]
        if problem.ops[g.storage.producer].recomputable:
            y = var01()
            lp.Add(x + y <= 1)
            lp.Add(y <= rerun_of(g.storage.producer))
            _needs_inputs(problem, costs, lp, var01, g.storage.producer, y, g.first_bwd_use, saved, temps, rerun_of,
                          checked, relief, copies_out, copies_in, depth=8)
        else:
            y = None
        for i in inside:
            xi = var01()
            _row(lp, -inf, 0.0, ((xi, 1), (x, -1)))  # xi <= x
            away[i].append((g, xi))
            relief[i].append((xi, size))
            if y is not None:
                relief[i].append((y, size))
    for i in checked:
        _row(lp, base_bytes[i] - budget_bytes, inf, relief[i])
    if rerun or costs.copy_issue_us:  # compute the plan adds: re-runs, and the copy ops of its swaps
        lp.Add(end >= sum(costs.rebuild_us(problem, o) * r for o, r in rerun.items())
               + 2 * costs.copy_issue_us * sum(swapped))
    lp.Add(sum(copies_out) <= prefix[n] + end)
    lp.Add(sum(copies_in) <= prefix[n] + end)

    previous = dict(zip(sync[1:], sync))

    # Each stream's capacity as running sums, so that every copy enters once per checked op (the plain
    # double loop had checked x sync x tensors terms: 145 s to build on resnet1001). Stalls happen before an op
    # starts, and a copy issued at a boundary can run during that stall: the window (a, i) of copies out opens
    # at the end of the op before a (the stall so far excludes the one at a) and closes at the start of i
    # (after i's stall): prefix[i] - prefix[a] + stall[i] - stall[previous[a]].
    for i in checked:
        before = [k for k in sync if k <= i]  # windows (a, i): what was produced at or after a
        by_start: dict[int, list] = {}
        for g, xi in away[i]:
            a = before[bisect.bisect_right(before, g.storage.producer + 1) - 1]
            by_start.setdefault(a, []).append((xi, costs.copy_time_us(g.storage.size_bytes, "d2h")))
        running = None
        for a in reversed(before):
            running = _accumulate(lp, running, by_start.get(a, ()))
            if running is not None:  # running <= the window (a, i)
                opened = ((stall[previous[a]], 1),) if a in previous else ()
                _row(lp, -inf, prefix[i] - prefix[a], ((running, 1), (stall[i], -1)) + opened)
        after = [k for k in sync if k > i]  # windows (i + 1, q): what is read again by q
        by_end: dict[int, list] = {}
        for g, xi in away[i]:
            q = after[min(bisect.bisect_left(after, g.first_bwd_use), len(after) - 1)]
            by_end.setdefault(q, []).append((xi, costs.copy_time_us(g.storage.size_bytes, "h2d")))
        running = None
        for q in after:  # a prefetch issued at op p > i: its copy starts after op i ends
            running = _accumulate(lp, running, by_end.get(q, ()))
            if running is not None:  # running <= prefix[q] - prefix[i + 1] + stall[q] - stall[i]
                _row(lp, -inf, prefix[q] - prefix[i + 1], ((running, 1), (stall[q], -1), (stall[i], 1)))
    lp.Minimize(end)
    status = lp.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return None
    if integral and status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        value = lp.Objective().BestBound()
    elif status == pywraplp.Solver.OPTIMAL:
        value = lp.Objective().Value()
    else:
        return prefix[-1]  # no certificate beyond the compute itself
    return prefix[-1] + max(0.0, value * (1 - _EXTRA) - _EXTRA)


def _accumulate(lp, running, terms):
    """``running`` plus ``terms`` ((variable, coefficient) pairs) as one new LP variable (or ``running`` itself
    when there is nothing new)."""
    if not terms:
        return running
    total = lp.NumVar(0, lp.infinity(), "")
    _row(lp, 0.0, 0.0, ((total, 1), *(((running, -1),) if running is not None else ()), *((v, -c) for v, c in terms)))
    return total


def _row(lp, lower: float, upper: float, terms) -> None:
    """``lower <= sum(coefficient * variable) <= upper`` over ``terms`` ((variable, coefficient) pairs, a
    variable named twice counted twice). Made row by row: OR-Tools' expression objects cost ~20x more per
    coefficient, which was 4 s of the 11 s bound of a 48-layer GPT (56,000 rows)."""
    coefficients: dict = {}
    for var, c in terms:
        coefficients[var] = coefficients.get(var, 0.0) + c
    row = lp.Constraint(lower, upper)
    for var, c in coefficients.items():
        row.SetCoefficient(var, c)


def _needs_inputs(problem: Problem, costs: Costs, lp, var01, op: int, wanted, at: int, saved: set[str],
                  temps: dict, rerun_of, checked: list[int], relief: dict, copies_out: list, copies_in: list,
                  depth: int) -> None:
    """Re-running ``op`` before op ``at`` (``wanted`` > 0) needs each of its inputs that the unplanned step has
    freed by then: rebuilt (its producer re-runs, recursively), kept alive past its last read (its bytes count
    until ``at`` wherever memory is checked), or sent to the host and back (its copies count on the streams).
    Saved activations, weights and inputs are taken as there (kept, fetched or rebuilt: paid for elsewhere).
    Temporaries are visited in order of first need, so ``at`` is the earliest backward read that needs one."""
    if depth == 0:
        return
    for name in problem.ops[op].inputs:
        st = problem.storage(name)
        if name in saved or st.producer is None or _alive_at(st, at):
            continue
        if name not in temps:
            rebuilt, alive, hosted = var01(), var01(), var01()
            if not costs.allow_offload:
                lp.Add(hosted == 0)
            temps[name] = rebuilt + alive + hosted
            last = max(st.users, default=st.producer)
            for i in checked:
                if last < i < at:
                    relief[i].append((alive, -st.size_bytes))
            copies_out.append(costs.copy_time_us(st.size_bytes, "d2h") * hosted)
            copies_in.append(costs.copy_time_us(st.size_bytes, "h2d") * hosted)
            if problem.ops[st.producer].recomputable:
                lp.Add(rebuilt <= rerun_of(st.producer))
                _needs_inputs(problem, costs, lp, var01, st.producer, rebuilt, at, saved, temps, rerun_of, checked,
                              relief, copies_out, copies_in, depth - 1)
            else:
                lp.Add(rebuilt == 0)
        lp.Add(wanted <= temps[name])
