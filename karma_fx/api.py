"""``karma_fx.plan``: capture → liveness → cost model → strategy → simulate, top to bottom.

``plan_step`` returns every intermediate (the problem, costs, the timeline) for tools that draw or compare;
``plan`` returns just the ``Plan``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from karma_fx.budget import Budget, format_bytes, parse_budget
from karma_fx.costs import Costs
from karma_fx.device import DeviceSpec
from karma_fx.errors import InfeasibleBudgetError, KarmaError
from karma_fx.progress import planning, report
from karma_fx.passes.capture import CapturedStep, capture
from karma_fx.passes.narrowing import narrow_saved
from karma_fx.passes.liveness import build_problem
from karma_fx.plan import Plan
from karma_fx.problem import Problem
from karma_fx.simulate import Timeline, decisions_as_run, simulate
from karma_fx.strategies import DEFAULT_STRATEGY, Strategy, make_strategy
from karma_fx.strategies.leanest import LEANEST_SWAPS, LeanestStreamed, leanest_peak, leanest_plan_parts

WEIGHTS_SOLVER_S = 10.0
"""Seconds the exact solver gets, by default, for each plan of the activations around streamed weights."""


@dataclass
class Planned:
    """A plan with everything it was made from."""

    plan: Plan
    problem: Problem
    costs: Costs
    timeline: Timeline
    step: CapturedStep | None = None
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Prepared:
    """A captured, analysed step, ready to be planned at any budget with any strategy."""

    problem: Problem
    costs: Costs
    keep: Timeline
    step: CapturedStep | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    pricing: Any = None
    """How ``problem`` and ``costs`` were priced (``karma_fx.pricing.Pricing``), where the capture was ours."""
    loss_chunk: int = 0
    """The chunked loss head's tokens per chunk, where the step was traced with it (``karma_fx.loss_ops``)."""
    tokens: int = 0
    """The tokens of that loss head."""
    keep_all_excess: Any = None
    """Under Inductor, what its own partition of the step (min-cut, the step as written) holds above the
    partition planned (``karma_fx.inductor.KeepExcess``); ``None`` where the step as written is the partition
    planned."""
    twins: "list[Prepared]" = field(default_factory=list)
    """The same step traced with its loss head chunked (each at one of ``passes.loss_head.chunk_sizes``), which
    ``plan`` also plans where the default strategy plans (``prepare(loss_chunk=None)``)."""
    _min_peak: int | None = None
    _split_floor: bool | None = None
    _torch_saved: dict[float, frozenset[str]] = field(default_factory=dict)

    @property
    def unplanned_peak_bytes(self) -> int:
        """The step as written: under Inductor its own partition's, where that holds more than the one planned."""
        if not self.keep_all_excess:
            return self.keep.peak_bytes
        from karma_fx.inductor import phase_excess

        memory = [b for _, b in self.keep.memory]
        split = self.keep.forward_items
        fwd, bwd = phase_excess(self.keep_all_excess, self.problem)
        return max(max(memory[:split], default=0) + fwd, max(memory[split:], default=0) + bwd)

    def min_peak_bytes(self, as_written: bool = True) -> int:
        """The lowest peak of the plans known (``karma_fx.strategies.leanest``): every saved activation swapped
        out synchronously right after its last forward read and fetched back just in time; without a host link
        the leanest recompute-only plan. The default strategy fits a budget of this many bytes. Under Inductor,
        the step as written where it peaks lower still (``floor_as_written``), which only the default strategy
        runs (``as_written=False``: a strategy named plans the partition planned)."""
        if self._min_peak is None:
            self._min_peak = leanest_peak(self.problem, self.costs)
        if as_written and self.keep_all_excess is not None:
            return min(self._min_peak, self.unplanned_peak_bytes)
        return self._min_peak

    def floor_as_written(self) -> bool:
        """Whether the lowest peak known is the step as written: Inductor's own partition, recomputing what the
        partition planned saves, may peak below every plan of the latter (a small region whose min-cut
        partition saves nothing)."""
        return self.keep_all_excess is not None and self.min_peak_bytes() == self.unplanned_peak_bytes

    def _floor_splits(self) -> bool:
        """Whether the leanest plan splits kernels along the batch (``karma_fx.split``)."""
        if self._split_floor is None:
            self._split_floor = bool(leanest_plan_parts(self.problem, self.costs)[1])
        return self._split_floor

    def strategy(self, strategy: str | Strategy | None, *, offload_weights: bool = False,
                 time_limit_s: float | None = None) -> Strategy:
        """The strategy to plan with: by name (``torch-budget`` gets PyTorch's saved-set oracle
        for the captured graph, cached per fraction) or as given; wrapped in ``WeightsOutOfCore`` when
        ``offload_weights`` (for ``cpsat``, the best of it and the heuristics each wrapped so, as the weight
        reserve each needs differs)."""
        if strategy is None:
            strategy = DEFAULT_STRATEGY
        if offload_weights:
            from karma_fx.strategies.weights import BestOf, WeightsOutOfCore

            if strategy != "cpsat":
                return WeightsOutOfCore(self.strategy(strategy, time_limit_s=time_limit_s))
            # The solver plans the activations of a step whose link the weights already fill, a few rounds,
            # beside three heuristics that usually match it there: it gets a share of time, not all it wants
            # (Megatron-GPT 1.56B at 6 GiB: uncapped, it took the CLI's strategy time from 36 s to 77 s, for
            # greedy's plan).
            inner = self.strategy(strategy, time_limit_s=time_limit_s or WEIGHTS_SOLVER_S)
            return BestOf([WeightsOutOfCore(inner)] + [WeightsOutOfCore(make_strategy(h))
                                                       for h in ("greedy", "offload", "karma")]
                          + [LeanestStreamed()])
        if not isinstance(strategy, str):
            return strategy
        if strategy != "torch-budget" or self.step is None:
            return make_strategy(strategy, time_limit_s=time_limit_s) if time_limit_s else make_strategy(strategy)
        from karma_fx.passes.torch_partition import saved_storages

        step, problem, cache = self.step, self.problem, self._torch_saved

        def saved_set(fraction: float) -> frozenset[str]:
            if fraction not in cache:
                cache[fraction] = saved_storages(step, problem, fraction)
            return cache[fraction]
        return make_strategy(strategy, saved_set)

    def judge(self, raw: Plan) -> tuple[Plan, Timeline]:
        """A strategy's plan as it is run and reported, with its replay: each swap-out waited for where the
        replay has it landed (``wait_where_copies_land``), each recompute chain joined by the backward loops
        Inductor can fuse with it where the plan still fits (``karma_fx.joins``), and the simulator's verdict
        attached."""
        raw = raw.replace(decisions=decisions_as_run(self.problem, raw, self.costs, raw.budget_bytes))
        timeline = simulate(self.problem, raw, self.costs)
        keep, unplanned = self.keep, self.unplanned_peak_bytes
        # the plan that moves nothing runs as written (under Inductor, Inductor's own partition)
        peak = unplanned if raw.status == "KEEP" and not raw.decisions else timeline.peak_bytes
        plan = raw.replace(model=self.problem.name, device=self.costs.device, peak_bytes=peak,
                           loss_chunk=self.loss_chunk,
                           step_time_us=round(timeline.makespan_us, 3),
                           unlimited_step_time_us=round(keep.makespan_us, 3), unplanned_peak_bytes=unplanned,
                           host_peak_bytes=timeline.host_peak_bytes, schedule=timeline.rows)
        return plan, timeline

    def plan(self, budget: "str | int | float | Budget", strategy: str | Strategy | None = None, *,
             raise_if_infeasible: bool = True, offload_weights: bool = False,
             time_limit_s: float | None = None, as_default: bool = False, as_written: bool = True) -> Planned:
        """Plan at ``budget``; ``offload_weights`` streams the parameters from host memory and sends their
        gradients to it (``karma_fx.strategies.weights``), for steps whose weights do not fit. ``as_default``:
        ``strategy`` stands for the default one (planned without the chunked twins). ``as_written``: where the
        default strategy is asked for and the step as written fits, that is the plan (as ``compile`` runs it);
        a session planning for the room its other runs leave asks for a plan of the partition planned instead."""
        budget_bytes = parse_budget(budget, self.unplanned_peak_bytes)
        if self.twins and strategy in (None, DEFAULT_STRATEGY) and not offload_weights:
            return self._plan_with_twins(budget_bytes, raise_if_infeasible, time_limit_s, as_written)
        chosen = self.strategy(strategy, offload_weights=offload_weights, time_limit_s=time_limit_s)
        t0 = time.perf_counter()
        if as_written and self._as_written_fits(budget_bytes, None if as_default else strategy, offload_weights):
            raw = Plan(DEFAULT_STRATEGY, budget_bytes, status="KEEP", notes=("nothing moved: the step as compiled",))
        else:
            raw = chosen(self.problem, self.costs, budget_bytes)
        solve_s = time.perf_counter() - t0
        plan, timeline = self.judge(raw)
        if raise_if_infeasible and not plan.fits:
            default = strategy in (None, DEFAULT_STRATEGY) or as_default
            floor = (leanest_peak(self.problem, self.costs, stream_weights=True) if offload_weights
                     else self.min_peak_bytes(as_written=default))
            how = (LEANEST_SWAPS
                   + (", convolutions run a piece of the batch at a time"
                      if not offload_weights and self._floor_splits() else "")
                   + ", which strategy='cpsat' reaches"
                   if self.costs.allow_offload else
                   "the leanest recompute-only plan known, rebuilding from checkpoints, which strategy='cpsat' "
                   "reaches")
            if not offload_weights and default and self.floor_as_written():
                how = "nothing moved: the step as written, Inductor's own partition"
            elif not self.problem.saved_activations() and not self.costs.allow_offload:
                how = ("the leanest plan general rematerialization (strategy='remat') finds, which strategy='cpsat' "
                       "reaches" if floor < self.unplanned_peak_bytes else
                       "nothing moved: general rematerialization (strategy='remat') finds no drop that lowers the "
                       "peak of this graph without a backward")
            elif not self.problem.saved_activations():
                how = ("nothing moved: no forward output is read by a backward node, the only tensors plans offload;"
                       " plan it recompute only (allow_offload=False) for general rematerialization")
            raise InfeasibleBudgetError(
                f"strategy {plan.strategy!r} cannot fit {self.problem.name} in {format_bytes(budget_bytes)}: its "
                f"best plan peaks at {format_bytes(plan.peak_bytes)}. The smallest budget known to work is "
                f"{format_bytes(floor)} ({floor} bytes: {how}); the unplanned peak "
                f"is {format_bytes(self.unplanned_peak_bytes)}.",
                min_budget_bytes=floor, budget_bytes=budget_bytes)
        return Planned(plan=plan, problem=self.problem, costs=self.costs, timeline=timeline, step=self.step,
                       seconds={**self.seconds, "strategy": solve_s})

    def _as_written_fits(self, budget_bytes: int, strategy: Any, offload_weights: bool) -> bool:
        """Where the step as written is Inductor's own partition (``keep_all_excess``) and fits: the default
        strategy runs it as it is, as ``compile`` does (a plan of the strategy's that moves nothing would count
        the partition planned, which may hold more or less)."""
        excess = self.keep_all_excess
        return (strategy in (None, DEFAULT_STRATEGY) and not offload_weights and excess is not None
                and self.unplanned_peak_bytes <= budget_bytes)

    def _plan_with_twins(self, budget_bytes: int, raise_if_infeasible: bool, time_limit_s: float | None,
                         as_written: bool = True) -> Planned:
        """The loss head as a choice, as ``karma_fx.session`` makes it: the step as written wherever it fits;
        else this step planned, and each chunked twin with nothing else moved, or planned where that does not
        fit; the fastest that fits, else the leanest (a refusal naming the lowest floor of them)."""
        alone = self.strategy(None, time_limit_s=time_limit_s)  # an object: planned here without the twins
        if self.unplanned_peak_bytes <= budget_bytes:  # as the session: the step as written wherever it fits
            return self.plan(budget_bytes, alone, raise_if_infeasible=raise_if_infeasible, as_default=True,
                             as_written=as_written)
        leanest = min([self] + self.twins, key=lambda p: p.min_peak_bytes())
        options = [] if self.min_peak_bytes() > budget_bytes and leanest is not self else [
            self.plan(budget_bytes, alone, raise_if_infeasible=False)]  # (below its floor: no plan of it fits)
        for twin in self.twins:
            if twin.min_peak_bytes() > budget_bytes and leanest is not twin:  # the leanest is planned anyway
                continue
            bare = twin.plan(budget_bytes, "keep", raise_if_infeasible=False)
            options.append(bare if bare.plan.fits else
                           twin.plan(budget_bytes, raise_if_infeasible=False, time_limit_s=time_limit_s))
        fitting = [p for p in options if p.plan.fits]
        floor = min([self.min_peak_bytes()] + [t.min_peak_bytes() for t in self.twins])
        if fitting:
            best = min(fitting, key=lambda p: p.plan.step_time_us or 0.0)
        elif raise_if_infeasible:
            chunks = " or ".join(str(t.loss_chunk) for t in self.twins)
            how = (f"{LEANEST_SWAPS}, which strategy='cpsat' can reach" if not leanest.floor_as_written() else
                   "nothing moved: the step as written, Inductor's own partition"
                   + (f", the loss head {leanest.loss_chunk} tokens at a time" if leanest.loss_chunk else ""))
            raise InfeasibleBudgetError(
                f"{self.problem.name} does not fit in {format_bytes(budget_bytes)}, its loss head whole or chunked "
                f"({chunks} tokens at a time): the smallest budget known to work is {format_bytes(floor)} "
                f"({floor} bytes: {how}); the unplanned peak is "
                f"{format_bytes(self.unplanned_peak_bytes)}.",
                min_budget_bytes=floor, budget_bytes=budget_bytes)
        else:
            best = min(options, key=lambda p: p.plan.peak_bytes or 0)
        # the step it is measured against is the model's own, not the twin's
        plan = best.plan.replace(unplanned_peak_bytes=self.unplanned_peak_bytes,
                                 unlimited_step_time_us=round(self.keep.makespan_us, 3))
        seconds = {**best.seconds, "strategy": sum(p.seconds.get("strategy", 0.0) for p in options)}
        return replace(best, plan=plan, seconds=seconds)




def _check_call(model: Any, args: Any, kwargs: Any) -> tuple[tuple, dict[str, Any]]:
    """``args`` as a tuple and ``kwargs`` as a dict, or a ``KarmaError`` saying what was passed."""
    from karma_fx.errors import UnsupportedModelError

    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"karma_fx plans nn.Module training steps, got {type(model).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise KarmaError(f"kwargs must be a dict of keyword arguments for the model, got {type(kwargs).__name__}")
    return (args if isinstance(args, tuple) else (args,)), dict(kwargs or {})


def prepare(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None, *,
            device: str | DeviceSpec | None = None, name: str | None = None, costs: str | None = None,
            compiler: str | None = None, loss_chunk: int | None = 0) -> Prepared:
    """Capture the training step and build everything a strategy needs, priced as ``karma_fx.compile`` prices
    it (``karma_fx.pricing``): a model with real weights and no ``device`` preset named is measured on its
    device (its kernels' scratch, and its ops' times unless ``costs="roofline"``); a model on ``meta``, or one
    planned for a named preset, is priced on the preset's roofline (default h100), tensors only.
    ``compiler``: ``"inductor"`` (the default, as ``compile``'s, or ``$KARMA_COMPILER``) prices the step
    Inductor runs, ``"eager"`` the op-by-op step. ``loss_chunk`` as ``compile``'s, but by default ``0`` (the
    step as the model computes it, one capture): ``None`` also captures the step with its loss head chunked
    (``Prepared.twins``), where it has one, for ``Prepared.plan`` to choose as ``compile`` would."""
    from karma_fx.config import resolve_compiler

    compiler = resolve_compiler(compiler)
    if loss_chunk is not None and (isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 0):
        raise KarmaError(f"loss_chunk must be None (the planner decides), 0 or a number of tokens, got {loss_chunk!r}")
    prepared = _prepare(model, args, kwargs, device, name, costs, compiler, loss_chunk or 0)
    if loss_chunk is None:
        from karma_fx.passes.loss_head import chunk_sizes

        twin = _prepare(model, args, kwargs, device, name, costs, compiler, None)
        if twin.loss_chunk:
            twins = [twin] + [_prepare(model, args, kwargs, device, name, costs, compiler, chunk)
                              for chunk in chunk_sizes(twin.loss_chunk, twin.tokens)[1:]]
            prepared.twins = [timed_as(t, prepared) for t in twins]
    return prepared


def timed_as(twin: Prepared, base: Prepared) -> Prepared:
    """``twin`` (the step traced with its loss head chunked) with the ops it shares with ``base`` timed as
    there (``karma_fx.pricing.shared_op_times``), its unplanned step simulated again with them."""
    from karma_fx.pricing import shared_op_times

    costs = shared_op_times(base.problem, base.costs, twin.problem, twin.costs)
    return replace(twin, costs=costs, keep=simulate(twin.problem, (), costs))


def _prepare(model: nn.Module, args: Any, kwargs: Any, device: Any, name: str | None, costs: str | None,
             compiler: str, loss_chunk: int | None) -> Prepared:
    from karma_fx.pricing import as_written, choose, price

    args, kwargs = _check_call(model, args, kwargs)
    params = list(model.parameters())
    real = not any(t.device.type == "meta" for t in params)
    # Measured where this is the machine the step will run on: a real model and no preset named to plan for
    # instead (or costs="measured" asked for anyway); a preset's step is priced on its roofline, tensors only.
    runs_here = real and (device is None or costs == "measured")
    if costs == "measured" and not real:
        raise KarmaError('costs="measured" times the step for real: build the model on a real device, not on meta')
    pricing = choose(costs, device, runs_here, compiler)
    seconds: dict[str, float] = {}
    label = name or type(model).__name__
    with planning(label):
        t0 = time.perf_counter()
        report("capture")
        # A model on meta is only planned, for the device preset (a CUDA GPU): trace attention as it runs there.
        step = capture(model, args, kwargs, gpu_attention=not real and bool(params),
                       inductor=compiler == "inductor", loss_chunk=loss_chunk)
        step.joint = narrow_saved(step.joint, step.num_fwd_outputs)  # as compile's partition does
        t1 = time.perf_counter()
        report("liveness")
        problem = build_problem(step, name=label)
        t2 = time.perf_counter()
        report("costs")
        primals = None
        if runs_here:
            from karma_fx.passes.measure import real_primals

            primals = real_primals(step, model, args, kwargs)
        problem, cost_model, pricing = price(step, problem, pricing, primals)
        keep = simulate(problem, (), cost_model)
        t3 = time.perf_counter()
    seconds.update(capture=t1 - t0, liveness=t2 - t1, costs=t3 - t2)
    return Prepared(problem=problem, costs=cost_model, keep=keep, step=step, seconds=seconds, pricing=pricing,
                    loss_chunk=step.loss_chunk, tokens=step.loss_tokens,
                    keep_all_excess=as_written(step, pricing, primals))


def plan(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None, *, budget: str | int | float,
         device: str | DeviceSpec | None = None, strategy: str | Strategy | None = None,
         offload_weights: bool = False, time_limit_s: float | None = None, costs: str | None = None,
         compiler: str | None = None, loss_chunk: int | None = None) -> Plan:
    """Plan one training step of ``model(*args, **kwargs)`` under ``budget`` (bytes or a fraction).

    The model may live on the ``meta`` device: it is traced on fake tensors and no weights are read. The
    step is the one ``karma_fx.compile`` runs from its second step (every output that requires grad is
    differentiated, except beside a loss the model names, ``out.loss`` or ``out["loss"]``: the loss is, as
    ``loss.backward()`` does, and the outputs beside it are returned detached), so both agree on what fits. ``offload_weights`` streams the weights from host memory (see ``Prepared.plan``);
    ``time_limit_s`` bounds the planning's wall-clock time (the capture excluded). Pricing is ``compile``'s
    (``karma_fx.pricing``): a model with real weights and no ``device`` preset named is measured on its device
    (``costs="roofline"`` keeps the times on the preset's roofline; scratch is measured either way), a model
    on meta is priced on the preset. ``compiler`` (default as ``compile``'s) says which step is planned, and
    ``loss_chunk`` (default as ``compile``'s: the planner decides) whether its loss head is chunked.
    Raises ``InfeasibleBudgetError`` (naming the smallest workable budget) when the strategy cannot fit.
    """
    from karma_fx.config import KarmaConfig

    config = KarmaConfig.make(budget=budget, strategy=strategy, device=device, offload_weights=offload_weights,
                              time_limit_s=time_limit_s, costs=costs, compiler=compiler,
                              loss_chunk=loss_chunk)  # refused before capture
    prepared = prepare(model, args, kwargs, device=device, costs=config.costs, compiler=config.compiler,
                       loss_chunk=config.loss_chunk)
    with planning(prepared.problem.name):
        return prepared.plan(config.budget, config.strategy, offload_weights=config.offload_weights,
                             time_limit_s=config.time_limit_s).plan
