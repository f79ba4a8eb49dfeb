"""The leanest plans known: the floor quoted when a budget is infeasible, and the exact planner's last resort.

They combine the building blocks of ``base`` with ``torch_budget``'s grouped recomputes, ``greedy``'s plan for
an impossible budget and ``weights``' streams, so they live above all of them rather than inside ``base`` (which
every strategy imports).

Without a host link the floor is the lowest of three plans (four on a graph without a backward, where only
general rematerialization moves anything: ``leanest_remat``), because no fixed recipe is lean on every graph:
rebuilding every saved activation (``leanest_recomputes``) rebuilds a chain's whole prefix before its first
backward reader and keeps it until its last one, so on a plain chain (VGG-16, any layered graph) it peaks at
the unplanned step itself; greedy, asked to fit nothing at all, keeps checkpoints and gets Moccasin's VGG-16
to 0.83 of its peak and random layered graphs of 100-1000 nodes to 0.19-0.46. A floor quoted to users is then always a budget the default strategy meets:
``cpsat`` falls back to this very plan when no heuristic fits.
"""
from __future__ import annotations

from dataclasses import replace

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.plan import Decision, GradToHost, Offload, Plan
from karma_fx.problem import Problem
from karma_fx.split import SPLIT_CHUNKS, Splits, split_problem
from karma_fx.strategies.base import RecomputeBuilder, figures_of, offload_for, reconcile, saved_gaps
from karma_fx.strategies.greedy import Greedy
from karma_fx.strategies.remat import Remat
from karma_fx.strategies.split import worth_splitting
from karma_fx.strategies.torch_budget import decisions_for_saved
from karma_fx.strategies.weights import weight_streams
from karma_fx.wire import host_casts


LEANEST_SWAPS = ("every saved activation swapped out and back just in time (op by op, also every gradient the "
                 "backward holds unread)")
"""How the leanest plan with a host link reaches its floor, in the words every floor message uses."""


def leanest_swaps(problem: Problem) -> tuple[Offload, ...]:
    """The leanest activation plan: every saved activation swapped out synchronously right after its last
    forward read and fetched back just in time."""
    return tuple(offload_for(problem, g, release=True) for g in saved_gaps(problem))


def backward_swaps(problem: Problem) -> tuple[Offload, ...]:
    """Every tensor the backward makes and leaves unread for an op or more swapped out synchronously right after
    it is made and fetched back just in time for its first read. The backward of a language model's chunked
    loss head makes the output projection's weight gradient and holds it until the end of the backward, where
    the tied embedding's gradient is added to it: on real GPT-2 in bf16-mixed those two pieces (147 and 74 MiB)
    were alive at the step's floor; swapped out, the op-by-op step's floor is 2.19 GiB (of 11.42). Gradients the
    step returns stay: they are its results.

    None on the step as Inductor runs it (``Problem.fused_kernels``): Inductor may split a reader's kernel and run
    its second half, which reads the fetched tensor and whatever else that half reads, after the peak (a layer
    norm's backward split around a heavy branch's measured 256 KiB above its plan)."""
    if problem.fused_kernels:
        return ()
    ops, out = problem.ops, []
    for s in problem.storages:
        if s.producer is None or s.producer < problem.num_fwd_ops or s.lives_to_end or not s.users or not s.size_bytes:
            continue
        first = s.users[0]
        if first >= s.producer + 2:
            out.append(Offload(tensor=s.name, offload_after=ops[s.producer].name, free_after=ops[s.producer].name,
                               prefetch_at=ops[first].name, reload_before=ops[first].name,
                               release_before=ops[s.producer + 1].name))
    return tuple(out)


def sent_at_once(problem: Problem, decisions: tuple[Decision, ...]) -> tuple[Decision, ...]:
    """``decisions`` with each gradient sent to the host waited for before the op after the one that makes it,
    as ``leanest_swaps`` waits for each activation's copy: the floor is then what the step holds, not how fast the
    link drains it. Left to land when they may, the gradients queued behind each other and behind the swaps on
    a slow link, and the floor quoted rose with the link's slowness (a streamed 8-layer MLP: 530 KiB at a CPU's
    measured copy speed, 782 KiB with its copies 30 times slower, or on the H100 preset's roofline)."""
    def waited(d: Decision) -> Decision:
        if not isinstance(d, GradToHost) or d.release_before is not None:
            return d
        made = problem.storage(d.tensor).producer
        if made is None or made + 1 >= len(problem.ops):  # the step's last op: the step's end waits for it
            return d
        return replace(d, release_before=problem.ops[made + 1].name)
    return tuple(waited(d) for d in decisions)


def leanest_recomputes(problem: Problem) -> tuple[Decision, ...]:
    """The leanest plan without a host link: every recomputable saved activation dropped after its last
    forward read and rebuilt, grouped by the backward op that first needs it (what is rebuilt for one group
    stays until its last read)."""
    return reconcile(problem, decisions_for_saved(problem, frozenset(), RecomputeBuilder(problem)))


REMAT_PROBES = 8
"""Budgets ``leanest_remat`` tries, halving the interval each time: 1/256 of the peak apart at the end."""


def leanest_remat(problem: Problem, costs: Costs) -> tuple[Decision, ...]:
    """The leanest plan ``remat``'s greedy pass finds, for graphs without a backward where it is the only
    strategy that moves anything: asked for nothing it minimises the bytes over budget summed over the step,
    not the peak, so the budget is bisected between nothing and the unplanned peak instead. A probe that misses
    its budget still reaches a peak of its own: the lowest reached by any probe is the floor."""
    peak = figures_of(problem, costs, ()).peak_bytes
    low, high, best = 0, peak, ()
    for _ in range(REMAT_PROBES):
        mid = (low + high) // 2
        if mid <= low:
            break
        decisions = Remat(exact=False, anywhere=False)(problem, costs, mid).decisions
        reached = figures_of(problem, costs, decisions).peak_bytes
        if reached < high:
            best, high = decisions, reached
        if reached > mid:
            low = mid
    return best


def leanest_decisions(problem: Problem, costs: Costs, *, stream_weights: bool = False) -> tuple[Decision, ...]:
    """The decisions of the leanest plan known: every saved activation swapped out synchronously right after
    its last forward read and fetched back just in time (``leanest_swaps``), or nothing where that peaks
    higher; with ``stream_weights`` also every weight streamed and every gradient sent to the host. Without a
    host link (``costs.allow_offload`` false): the lowest of every recomputable saved activation rebuilt,
    greedy's plan for a budget of nothing, and nothing moved (the module's docstring says why three)."""
    if not costs.allow_offload:
        with progress.no_deadline():  # the floor quoted must be the plan a time-limited cpsat falls back to
            options_ro: list[tuple[Decision, ...]] = [leanest_recomputes(problem),
                                                      Greedy()(problem, costs, 0).decisions, ()]
            if not problem.saved_activations():
                options_ro.append(leanest_remat(problem, costs))
        return min(options_ro, key=lambda d: figures_of(problem, costs, d).peak_bytes)
    swaps = leanest_swaps(problem)
    if stream_weights:  # a weight's bf16 cast is streamed from the host, not swapped out (karma_fx.wire)
        casts = host_casts(problem)
        swaps = tuple(d for d in swaps if getattr(d, "tensor", None) not in casts)
        options: list[tuple[Decision, ...]] = [swaps + sent_at_once(problem, weight_streams(problem, swaps)),
                                               sent_at_once(problem, weight_streams(problem))]
    else:
        options = [swaps, swaps + backward_swaps(problem), ()]
    return min(options, key=lambda d: figures_of(problem, costs, d).peak_bytes)


class LeanestStreamed:
    """The leanest plan with every weight streamed (``leanest_decisions(..., stream_weights=True)``) as a
    strategy: the last of those ``offload_weights`` plans choose between, so that the floor a refusal names is a
    budget the plan door meets too, as ``compile`` does (its session falls back to the same plan). Without it the
    plan door refused a streamed MLP at 686 KiB, its best plan at 781 KiB, naming a floor of 528 KiB."""

    name = "leanest"

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        return Plan(strategy=self.name, budget_bytes=budget_bytes,
                    decisions=leanest_decisions(problem, costs, stream_weights=True), status="FALLBACK:leanest",
                    notes=(f"the leanest plan: {LEANEST_SWAPS}, every weight streamed",))


def leanest_plan_parts(problem: Problem, costs: Costs, *, stream_weights: bool = False
                       ) -> tuple[tuple[Decision, ...], Splits]:
    """The decisions and kernel splits of the leanest plan: ``leanest_decisions`` of the step as written, or
    of the step with every op whose scratch a split shrinks run in the most pieces tried (``karma_fx.split``),
    whichever peaks lower. The default strategy (``SplitKernels`` around ``cpsat``) reaches the same. With
    ``stream_weights`` the step as written only: the weights' strategy plans no splits."""
    plain = leanest_decisions(problem, costs, stream_weights=stream_weights)
    splits = () if stream_weights else worth_splitting(problem, costs, max(SPLIT_CHUNKS))
    if not splits:
        return plain, ()
    run_problem, run_costs = split_problem(problem, costs, splits)
    split = leanest_decisions(run_problem, run_costs, stream_weights=stream_weights)
    if figures_of(run_problem, run_costs, split).peak_bytes < figures_of(problem, costs, plain).peak_bytes:
        return split, splits
    return plain, ()


def leanest_peak(problem: Problem, costs: Costs, *, stream_weights: bool = False) -> int:
    """The peak of the leanest plan (``leanest_plan_parts``): the floor quoted when a budget is infeasible."""
    decisions, splits = leanest_plan_parts(problem, costs, stream_weights=stream_weights)
    run_problem, run_costs = split_problem(problem, costs, splits)
    return figures_of(run_problem, run_costs, decisions).peak_bytes