"""The default strategy with kernels split along the batch as one more choice (``karma_fx.split``).

A kernel's scratch exists only while its op runs, so no offload or recompute lowers it: where it is part of
the peak (on a CPU, a small CNN's ``convolution_backward`` holds 2 MiB of scratch beside 3 MiB of tensors, and
that is the step's floor), the inner strategy cannot reach below it. This wrapper plans the step as written
first; only where that plan does not fit, or its peak is at an op whose scratch a split would shrink, it also
plans the step with every such op split into 2, 4 and 8 pieces (fewest first) and keeps the fastest plan that
fits, priced by the same simulator with each split's scratch and time as measured. Fewer pieces are tried first
and the search stops at the first that fits without slowing the step; each op whose split the plan turns out not
to need is then put back whole (``_fewest``). Streamed weights (``WeightsOutOfCore``) plan the step as written.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.plan import Plan
from karma_fx.problem import Problem
from karma_fx.simulate import simulate
from karma_fx.split import MIN_SCRATCH_SHARE, SPLIT_CHUNKS, describe_splits, split_all, split_problem, splittable
from karma_fx.strategies.base import Strategy

GOOD_ENOUGH = 0.01
"""A plan within this fraction of the unplanned step's time is not improved on by splitting."""


class SplitKernels:
    """``inner``, and ``inner`` on the step with its scratch-heavy kernels split, the better plan of them."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, attr: str) -> Any:  # the inner strategy's options, time limit, fallbacks
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        # one time limit for every round: the inner strategy's own deadline nests inside it
        limit_for = getattr(self.inner, "limit_for", None)
        with progress.deadline(limit_for(problem) if limit_for else getattr(self.inner, "time_limit_s", None)):
            return self._plan(problem, costs, budget_bytes)

    def _plan(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        plain = self.inner(problem, costs, budget_bytes)
        if not splittable(problem):
            return plain
        keep = simulate(problem, (), costs, detail=False)
        min_scratch = int(keep.peak_bytes * MIN_SCRATCH_SHARE)  # worth_splitting's threshold, replayed once here
        ops = splittable(problem, min_scratch)
        if not ops:
            return plain
        tl = simulate(problem, plain, costs, detail=False)
        good_enough = keep.makespan_us * (1 + GOOD_ENOUGH)
        at_peak = tl.peak_op.split(" ")[1] if tl.peak_op.startswith("recompute ") else tl.peak_op
        if tl.peak_bytes <= budget_bytes and (tl.makespan_us <= good_enough or at_peak not in {o.name for o in ops}):
            return plain
        best, best_key = plain, _rank(tl.peak_bytes, tl.makespan_us, budget_bytes)
        for chunks in SPLIT_CHUNKS:
            if best_key[0] == 0 and progress.past_deadline():
                break  # a plan fits and the time is up: no new round
            splits = split_all(problem, chunks, min_scratch)
            run_problem, run_costs = split_problem(problem, costs, splits)
            raw = self.inner(run_problem, run_costs, budget_bytes)
            got = simulate(run_problem, raw.decisions, run_costs, detail=False)
            if got.peak_bytes <= budget_bytes:
                splits, got = _fewest(problem, costs, raw.decisions, splits, budget_bytes, got)
            key = _rank(got.peak_bytes, got.makespan_us, budget_bytes)
            if key < best_key:
                # the inner plan's bound and proofs were of the split step, not of every plan of this one
                notes = raw.notes + ((f"kernels split along the batch: {describe_splits(splits)} (their scratch "
                                      "as measured in pieces)",) if splits else ())
                best = replace(raw, splits=splits, status=raw.status.replace("OPTIMAL", "FEASIBLE"),
                               lower_bound_us=None, notes=notes + (
                                   "planned on the step with kernels split; no lower bound is claimed",))
                best_key = key
            if got.peak_bytes <= budget_bytes and (got.makespan_us <= good_enough or progress.past_deadline()):
                break  # more pieces would only cost more, or there is no time left to look
        return best


def worth_splitting(problem: Problem, costs: Costs, chunks: int) -> tuple[tuple[str, int], ...]:
    """Every op whose scratch is at least ``MIN_SCRATCH_SHARE`` of the unplanned peak, in ``chunks`` pieces
    (or its batch): what ``SplitKernels`` tries, and the leanest plan uses at the most pieces."""
    peak = simulate(problem, (), costs, detail=False).peak_bytes
    return split_all(problem, chunks, int(peak * MIN_SCRATCH_SHARE))


def _fewest(problem: Problem, costs: Costs, decisions: tuple, splits: tuple[tuple[str, int], ...],
            budget_bytes: int, got: Any) -> tuple[tuple[tuple[str, int], ...], Any]:
    """``splits`` without each op (smallest scratch first) whose split the plan does not need to fit: every op
    left whole is one kernel call again. Each removal is checked by replaying the same decisions."""
    order = sorted(splits, key=lambda s: problem.storage(f"{s[0]}:scratch").size_bytes)
    kept = list(splits)
    for item in order:
        trial = tuple(s for s in kept if s != item)
        run_problem, run_costs = split_problem(problem, costs, trial)
        tl = simulate(run_problem, decisions, run_costs, detail=False)
        if tl.peak_bytes <= budget_bytes and tl.makespan_us <= got.makespan_us:
            kept, got = list(trial), tl
    return tuple(kept), got


def _rank(peak: int, makespan_us: float, budget_bytes: int) -> tuple[int, float]:
    """Plans that fit first, fastest first; then the lowest peak."""
    return (0, makespan_us) if peak <= budget_bytes else (1, float(peak))
