"""Weights out of core: parameters live in host memory and stream through the device; gradients leave at once.

KARMA's answer to models whose weights alone do not fit: each parameter is copied to the device before its
first forward use and dropped after its last, copied again for its backward uses (including the recompute
chains that read it), and each gradient is copied to the host as soon as backward produces it. The copy for
a window is issued when the window before it in execution order starts (one layer ahead), so it hides behind
that layer's compute when the link allows.

``WeightsOutOfCore(inner)`` wraps any activation strategy: the inner strategy plans the activations as if
weights and gradients took no device memory, under the budget less a reserve for the weights in flight; the
streams are then laid around its plan, the whole is simulated, and the reserve grows by what the step still
exceeds until it fits (a few rounds). Activation decisions and weight streams are judged together by the one
simulator.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from karma_fx.costs import Costs
from karma_fx.plan import Decision, GradToHost, Offload, Plan, Recompute, StreamWeight, Window
from karma_fx.problem import Problem
from karma_fx.simulate import Timeline, peak_and_makespan, simulate
from karma_fx.strategies.base import Strategy
from karma_fx.host import HostSpec, host_step_us, this_host
from karma_fx.wire import as_run_with_costs, host_casts, host_upcasts, hosted, hosted_problem

AHEAD = (0.005, 0.01, 0.02, 0.04, 0.08)
"""How far ahead of its first use a window's copy may be issued, as fractions of the step's compute, besides
one layer ahead: Megatron-GPT 1.56B's bf16 weights take 74% of its compute on the H100 preset's link, and
issued one parameter ahead they stalled its forward 72 ms (streams alone: 279 ms; 2-4% of the step ahead:
204 ms, against 190 ms of compute)."""

MAX_GAP_OPS = 16
"""Uses of a parameter further apart than this (in ops) get separate windows: a weight read at both ends of
the forward (a tied embedding) is not held in between."""

GAPS = (MAX_GAP_OPS, 64, 256)
"""The gaps tried (``MAX_GAP_OPS`` and wider): where the link is the bottleneck a weight read again soon is
better kept than fetched twice (a recompute chain reading it, then its backward: Megatron-GPT 1.56B fetched 137
weights three times a step)."""


def weight_streams(problem: Problem, decisions: tuple[Decision, ...] = (), max_gap: int = MAX_GAP_OPS,
                   ahead_us: float | None = None, costs: Costs | None = None) -> tuple[Decision, ...]:
    """Stream every used parameter and send every parameter gradient no op reads to the host, around ``decisions``
    (recompute chains that read a parameter extend its backward window to where they run). A parameter the
    step reads only through a cast to bf16 (autocast's copy) streams as that cast, made on the host
    (``karma_fx.wire``; casts ``decisions`` already move are left as they are); a weight left with no reader
    on the device stays on the host (a stream with no window). A gradient the step widens from a narrower one
    is sent narrow and widened on the host.

    Each window's copy is issued when the layer before it starts or, with ``ahead_us`` and ``costs``, at the
    op that starts ``ahead_us`` of compute before its first use: a link nearly as busy as compute (a large
    model's bf16 weights) needs its copies queued further ahead than one parameter's first use."""
    named = {t for d in decisions for t in (d.tensors if isinstance(d, Recompute) else (d.tensor,))}
    original = problem
    problem = hosted_problem(problem, frozenset(c for c in host_casts(problem) if c not in named),
                             frozenset(g for g in host_upcasts(problem) if g not in named))
    op_index = problem.op_index
    uses: dict[str, set[int]] = {s.name: set(s.users) for s in problem.storages if s.kind == "param" and s.users}
    for d in decisions:
        if isinstance(d, Recompute):
            at = op_index(d.reload_before)
            for name in d.ops:
                for s in problem.ops[op_index(name)].inputs:
                    if s in uses:
                        uses[s].add(at)
    runs: list[tuple[int, int, str]] = []  # (first use, last use, parameter)
    for name, at in uses.items():
        ordered = sorted(at)
        start = prev = ordered[0]
        for u in ordered[1:]:
            crosses = (prev < problem.num_fwd_ops) != (u < problem.num_fwd_ops)
            if u - prev > max_gap or crosses:
                runs.append((start, prev, name))
                start = u
            prev = u
        runs.append((start, prev, name))
    runs.sort()
    windows: dict[str, list[Window]] = {}
    last_free: dict[str, int] = {}
    previous_first = current_first = 0
    starts = costs.op_starts_us() if ahead_us is not None and costs is not None else None
    for first, last, name in runs:
        if first != current_first:  # a new layer's weights: issue them when the previous layer starts
            previous_first, current_first = current_first, first
        if starts is not None:
            # a large weight (a vocabulary's head) needs its own copy time more
            lead = ahead_us + costs.copy_time_us(problem.storage(name).size_bytes, "h2d")
            early = bisect.bisect_left(starts, starts[first] - lead, 0, first + 1)
        else:
            early = min(previous_first, first)
        issue = max(early, last_free.get(name, -1) + 1)
        windows.setdefault(name, []).append(Window(problem.ops[issue].name, problem.ops[first].name,
                                                   problem.ops[last].name))
        last_free[name] = last
    streams: list[Decision] = [StreamWeight(name, tuple(ws)) for name, ws in windows.items()]
    streams += [StreamWeight(s.name, ()) for s, before in zip(problem.storages, original.storages)
                if s.kind == "param" and before.kind == "param" and not s.users and before.users]
    # A gradient the backward reads again stays on the device (a BatchNorm's bias gradient, decomposed as
    # Inductor's graphs have it, is also a term of its input's gradient): a GradToHost sends it as it is made.
    streams += [GradToHost(s.name) for s in problem.storages
                if s.kind == "gradient" and s.is_output and s.producer is not None and not s.users]
    return tuple(streams)


def without_weights(problem: Problem) -> Problem:
    """The same step with parameters and their gradients weighing nothing: what the inner strategy plans."""
    storages = tuple(replace(s, size_bytes=0) if s.kind == "param" or (s.kind == "gradient" and s.is_output)
                     else s for s in problem.storages)
    return replace(problem, storages=storages, _index={}, _op_index={})


class WeightsOutOfCore:
    """``inner``'s activation plan with every weight streamed from the host (see the module docstring)."""

    def __init__(self, inner: Strategy, rounds: int = 4, host: HostSpec | None = None) -> None:
        from karma_fx.strategies.split import SplitKernels

        # kernels are not split under streamed weights: every plan here is judged on the step as written
        self.inner = inner.inner if isinstance(inner, SplitKernels) else inner
        self.rounds = rounds
        self.name = inner.name
        self.host = host
        """The host that updates the weights (default: this one, measured): it bounds the step too."""

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        # The inner strategy sees the step as it runs: bf16 casts of weights made on the host (karma_fx.wire).
        on_host, on_host_costs = hosted(problem, costs)
        light = without_weights(on_host)
        # ... and links with what the weights leave of them: swapping an activation out costs the link time the
        # weights need (Megatron-GPT 1.56B, bf16-mixed at 6 GiB: 247 ms a step planned on the full links, 244
        # on these).
        inner_costs = _derated(problem, costs, on_host_costs)
        reserve = max(0, peak_and_makespan(problem, weight_streams(problem), costs)[0]
                      - peak_and_makespan(light, (), on_host_costs)[0])
        best: tuple[tuple[int, float], Plan] | None = None
        for _ in range(self.rounds):
            inner = self.inner(light, inner_costs, max(1, budget_bytes - reserve))
            decisions, timeline = self._streamed(problem, costs, on_host_costs, tuple(inner.decisions),
                                                 budget_bytes)
            fits = timeline.peak_bytes <= budget_bytes
            key = (0 if fits else 1, timeline.makespan_us if fits else float(timeline.peak_bytes))
            # The inner plan's lower bound covers activation plans of the lighter step only: not this one.
            notes = tuple(n for n in inner.notes if "lower bound" not in n)
            plan = replace(inner, budget_bytes=budget_bytes, decisions=decisions, lower_bound_us=None,
                           notes=notes + ("weights streamed from the host, gradients sent to it",))
            if best is None or key < best[0]:
                best = (key, plan)
            if fits:
                break
            reserve += timeline.peak_bytes - budget_bytes
        assert best is not None
        plan = best[1]
        if best[0][0] == 0 and plan.status == "INFEASIBLE":
            # The inner strategy judged the lighter step at a reserve that proved pessimistic; the whole plan fits.
            plan = replace(plan, status="HEURISTIC", notes=tuple(n for n in plan.notes if "no plan fits" not in n))
        bound = physical_bound(problem, costs, plan.decisions, self.host or this_host())
        return replace(plan, notes=plan.notes + (bound.describe(),))

    @staticmethod
    def _streamed(problem: Problem, costs: Costs, on_host_costs: Costs, inner: tuple[Decision, ...],
                  budget_bytes: int) -> tuple[tuple[Decision, ...], Timeline]:
        """``inner`` with the weight streams laid around it, each window's copy issued one layer ahead or a
        fixed stretch of compute ahead (``AHEAD``, fractions of the step), whichever the simulator finds
        fastest within the budget (the lowest peak if none fits)."""
        total = on_host_costs.compute_time_us
        best: tuple[tuple[int, float], tuple[Decision, ...]] | None = None
        for gap in GAPS:
            for ahead in (None, *(f * total for f in AHEAD)):
                decisions = inner + weight_streams(problem, inner, max_gap=gap, ahead_us=ahead, costs=on_host_costs)
                peak, makespan = peak_and_makespan(problem, decisions, costs)
                key = (0, makespan) if peak <= budget_bytes else (1, float(peak))
                if best is None or key < best[0]:
                    best = (key, decisions)
                if ahead is not None and peak > budget_bytes:
                    break  # further ahead only holds more weights at once
        assert best is not None
        timeline = simulate(problem, best[1], costs, detail=False)
        if best[0][0] == 0:
            return earlier_where_stalled(problem, costs, best[1], timeline, budget_bytes)
        return best[1], timeline


def earlier_where_stalled(problem: Problem, costs: Costs, decisions: tuple[Decision, ...], timeline: Timeline,
                          budget_bytes: int, rounds: int = 8) -> tuple[tuple[Decision, ...], Timeline]:
    """``decisions`` with each copy that compute stalled for issued earlier, by as much compute as it waited,
    round after round while the step gets faster and still fits ``budget_bytes``; halving the shift once when
    a round does not pay. Why: weight windows and activation prefetches share one first-in-first-out link, and
    each was placed on its own; a copy queued behind others lands late, and only the replay sees by how much."""
    starts = costs.op_starts_us()
    scale = 1.0
    for _ in range(rounds):
        waited: dict[int, float] = {}
        for iv in timeline.compute:
            if iv.kind == "stall" and iv.label.startswith("wait "):
                at = problem.op_index(iv.label[5:])
                waited[at] = waited.get(at, 0.0) + (iv.end_us - iv.start_us) * scale
        if not waited:
            break
        moved = tuple(_earlier(problem, d, waited, starts) for d in decisions)
        if moved == decisions:
            break
        candidate = simulate(problem, moved, costs, detail=False)
        if candidate.peak_bytes <= budget_bytes and candidate.makespan_us < timeline.makespan_us - 1e-6:
            decisions, timeline = moved, candidate
        elif scale > 0.3:
            scale /= 2
        else:
            break
    return decisions, timeline


def _earlier(problem: Problem, d: Decision, waited: dict[int, float], starts: list[float]) -> Decision:
    """``d`` with the prefetch of each stay compute waited for (``waited``: op → µs) issued that much earlier,
    never before what must precede it (the swap-out's free, the weight's previous window)."""
    index = problem.op_index

    def shift(prefetch_at: str, reload_before: str, not_before: int) -> str:
        wait = waited.get(index(reload_before))
        at = index(prefetch_at)
        if not wait or at <= not_before:
            return prefetch_at
        to = bisect.bisect_left(starts, starts[at] - wait, 0, at)
        return problem.ops[max(to, not_before)].name

    if isinstance(d, Offload):
        floor = index(d.free_after) + 1
        if d.release_before is not None:
            floor = max(floor, index(d.release_before))
        new = shift(d.prefetch_at, d.reload_before, floor)
        return d if new == d.prefetch_at else replace(d, prefetch_at=new)
    if isinstance(d, StreamWeight):
        windows, previous = [], -1
        for w in d.windows:
            windows.append(replace(w, prefetch_at=shift(w.prefetch_at, w.reload_before, previous + 1)))
            previous = index(w.free_after)
        return d if tuple(windows) == d.windows else replace(d, windows=tuple(windows))
    return d


def _derated(problem: Problem, costs: Costs, on_host_costs: Costs) -> Costs:
    """``on_host_costs`` with each link's bandwidth cut by the share of the phase the activations use it in
    (swap-outs in the forward, prefetches in the backward) that the weight streams keep it busy."""
    timeline = simulate(problem, weight_streams(problem, max_gap=GAPS[-1]), costs, detail=False)
    starts = on_host_costs.op_starts_us()
    split = starts[problem.num_fwd_ops]
    scale = {}
    for link, (a, b) in {"d2h": (0.0, split), "h2d": (split, starts[-1])}.items():
        busy = sum(max(0.0, min(iv.end_us, b) - max(iv.start_us, a)) for iv in getattr(timeline, link))
        scale[link] = 1 - min(0.9, busy / max(b - a, 1e-9))
    return replace(on_host_costs, h2d_bytes_per_us=on_host_costs.h2d_bytes_per_us * scale["h2d"],
                   d2h_bytes_per_us=on_host_costs.d2h_bytes_per_us * scale["d2h"])


@dataclass(frozen=True)
class PhysicalBound:
    """What no plan of a step with streamed weights can beat, resource by resource (µs): the device's compute
    (without the casts the host makes), the weights' bytes over the link into the device (each at least once
    in each phase that reads it), the gradients' bytes out of it, and the host's update of every weight (with
    its casts). The step takes at least the largest."""

    compute_us: float
    link_in_us: float
    link_out_us: float
    host_us: float
    host: HostSpec

    @property
    def bottleneck(self) -> str:
        figures = {"compute": self.compute_us, "the link into the device": self.link_in_us,
                   "the link out of the device": self.link_out_us, "the host's update": self.host_us}
        return max(figures, key=figures.__getitem__)

    @property
    def us(self) -> float:
        return max(self.compute_us, self.link_in_us, self.link_out_us, self.host_us)

    def describe(self) -> str:
        return (f"bound {self.us / 1e3:,.1f} ms, set by {self.bottleneck}: compute {self.compute_us / 1e3:,.1f} ms, "
                f"weights in {self.link_in_us / 1e3:,.1f} ms and gradients out {self.link_out_us / 1e3:,.1f} ms "
                f"over the link, the host's update {self.host_us / 1e3:,.1f} ms "
                f"({self.host.update_params_per_s:.3g} parameters/s on {self.host.threads} threads, {self.host.name})")


def physical_bound(problem: Problem, costs: Costs, decisions: tuple[Decision, ...], host: HostSpec) -> PhysicalBound:
    """``PhysicalBound`` of ``problem`` with the weights and gradients ``decisions`` stream (fp32-equivalent
    parameter counts for the host: bytes / 4)."""
    run, run_costs = as_run_with_costs(problem, decisions, costs)
    into = out = cast = 0
    for d in decisions:
        if isinstance(d, StreamWeight) and d.windows:
            phases = {run.is_backward(run.op_index(w.reload_before)) for w in d.windows}
            into += run.storage(d.tensor).size_bytes * len(phases)
            if problem.storage(d.tensor).kind != "param":
                cast += run.storage(d.tensor).size_bytes // 2
        elif isinstance(d, GradToHost):
            out += run.storage(d.tensor).size_bytes
            if not problem.storage(d.tensor).is_output:
                cast += run.storage(d.tensor).size_bytes // 2
    weights = sum(s.size_bytes for s in problem.storages if s.kind == "param") // 4
    return PhysicalBound(compute_us=run_costs.compute_time_us,
                         link_in_us=into / costs.h2d_bytes_per_us, link_out_us=out / costs.d2h_bytes_per_us,
                         host_us=host_step_us(host, weights, cast), host=host)


class BestOf:
    """The fastest plan that fits among several strategies (the lowest peak if none fits), each judged by the
    simulator; named after the first, with ``FALLBACK:<name>`` as status when another one wins."""

    def __init__(self, strategies: list[Strategy]) -> None:
        self.strategies = strategies
        self.name = strategies[0].name

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        best: tuple[tuple[int, float], Plan] | None = None
        for i, strategy in enumerate(self.strategies):
            plan = strategy(problem, costs, budget_bytes)
            timeline = simulate(problem, plan.decisions, costs)
            fits = timeline.peak_bytes <= budget_bytes
            key = (0 if fits else 1, timeline.makespan_us if fits else float(timeline.peak_bytes))
            if i:
                plan = replace(plan, strategy=self.name, status=f"FALLBACK:{strategy.name}")
            if best is None or key < best[0]:
                best = (key, plan)
        assert best is not None
        return best[1]

