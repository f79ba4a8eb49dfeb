"""A compiled region and the plans (variants) its runs used: what ``karma_fx.backend`` compiles and
``karma_fx.session`` chooses between.

A ``Region`` is one Dynamo graph: its planning problem (``prepared``), where in the user's code it ends when a
graph break ends it, and the ``Variant`` of each plan one of its runs needed, compiled on first use.
``boundary_of`` reads which storages of its problem are its inputs and outputs, by position, so that
``karma_fx.regions`` can tell the tensors it shares with the runs before and after it.
"""
from __future__ import annotations

import functools

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from karma_fx.budget import Budget, format_bytes
from karma_fx.config import KarmaConfig
from karma_fx.errors import KarmaError
from karma_fx.plan import Plan
from karma_fx.regions import Boundary, Footprint, footprint, released_outputs

log = logging.getLogger("karma_fx.session")


@dataclass
class Variant:
    """One plan of a region, compiled: what Dynamo's cached code calls for the runs that use this plan."""

    plan: Plan
    fp: Footprint
    fn: Any = None
    graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None
    grad_params: tuple[int, ...] = ()
    """Primal positions of the parameters whose gradients this variant hands to the gradient pipeline."""
    ran: bool = False
    """Whether it has run: its first run allocates what later runs reuse (the host buffers of its offloads)."""
    inductors_own: bool = False
    """The plan that moves nothing, compiled as Inductor's own step (min-cut partition), its footprint counting
    what that holds above the partition planned (``Prepared.keep_all_excess``)."""


@dataclass(eq=False)
class Region:
    """One compiled region (one Dynamo graph): its planning problem and the variants its runs used."""

    index: int
    gm: fx.GraphModule = field(repr=False)
    kinds: tuple[str, ...]
    names: tuple[str, ...]
    prepared: Any = field(default=None, repr=False)
    variants: list[Variant] = field(default_factory=list)
    leanest: Variant | None = None
    keep: Variant | None = None
    inference_fn: Any = None
    last: Variant | None = None
    offload_weights: bool = False
    boundary: Boundary = field(default_factory=Boundary)
    ends_at: str = ""
    """Where the region stops in the user's code when a graph break ends it (``file:line``, Dynamo's reason)."""
    twins: "list[Region]" = field(default_factory=list, repr=False)
    parent: "Region | None" = field(default=None, repr=False)
    """For a twin: the region as written, whose unplanned step its plans are set against."""
    """The same region traced with its loss head chunked (``karma_fx.passes.loss_head``), one per chunk size,
    planned beside it where the planner may choose (``loss_chunk=None``); their variants join this region's."""
    budget_bytes: int = 0
    """The session's budget in bytes when this region last ran (a fraction grows with the step)."""
    planned_at: list[int] = field(default_factory=list)
    """The targets this region was planned at (a region is not planned twice at about the same target)."""
    detached: tuple[int, ...] = ()
    """Its outputs returned detached (``gm`` is then the graph as written with those outputs detached): no
    backward of earlier steps gave them a gradient (``karma_fx.unused_grads``)."""
    as_written: "fx.GraphModule | None" = field(default=None, repr=False)
    """The graph Dynamo gave, where ``gm`` detaches outputs."""
    as_written_only: bool = False
    """A backward differentiated an output once returned detached: the region stays as written."""
    retrace: bool = False
    """``gm`` changed (outputs detached, or as written again): forget the plans at the region's next run. Until
    then a later run of it is counted by its plans as traced before: never less, once detached; as written again
    the step that follows is a first one (``Session._as_written_again``)."""

    @functools.cached_property
    def weight_positions(self) -> tuple[int, ...]:
        """The positions of its parameter and buffer inputs."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind in ("param", "buffer"))

    @property
    def plan(self) -> Plan:
        """The plan of the most recent run, with the budget in bytes it ran under."""
        if self.last is None:
            raise KarmaError("this region has not run in training mode yet: nothing was planned")
        plan = self.last.plan
        if not self.budget_bytes or plan.budget_bytes == self.budget_bytes:
            return plan
        # The budget is the whole step's; the peaks are this region's own problem's: say so beside them.
        return plan.replace(budget_bytes=self.budget_bytes, notes=plan.notes + (
            "budget: the whole step's; peak and unplanned peak: this region's own (its weights, inputs and what "
            "it makes); the step's is KarmaModule.predicted_peak_bytes",))

    @property
    def graphs(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        assert self.last is not None and self.last.graphs is not None
        return self.last.graphs

    @property
    def held_bytes(self) -> int:
        """What the most recent run kept on the device for its backward, beyond its parameters."""
        assert self.last is not None
        return self.last.fp.held_bytes

    @property
    def min_budget_bytes(self) -> int:
        """The leanest plan's peak of this region alone, as its problem counts it."""
        if self.leanest is not None:
            return self.leanest.fp.peak_bytes
        from karma_fx.strategies.leanest import leanest_peak

        p = self.prepared
        return leanest_peak(p.problem, p.costs, stream_weights=self.offload_weights)

    @property
    def scratch_unmeasured(self) -> bool:
        """Planned under someone's profiler, without the scratch of its kernels (see ``karma_fx.pricing``)."""
        pricing = getattr(self.prepared, "pricing", None)
        return pricing is not None and pricing.memory != "measured"


def boundary_of(step: Any, problem: Any, kinds: tuple[str, ...] = ()) -> Boundary:
    """The storages a region's problem has at its edges: per primal, per forward output the run returns (the
    joint graph's forward outputs start with the new values of the inputs it updates in place, which AOTAutograd
    writes back instead of returning), and its parameters' gradients."""
    output = next(n for n in step.joint.graph.nodes if n.op == "output")
    storage_of = dict(problem.aliases)
    outs = list(output.args[0])
    primals = [n for n in step.joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]

    def storage(node: Any) -> str | None:
        if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            return None
        return storage_of.get(node.name, node.name)

    mutated = sum(1 for k in kinds if k == "buffer")
    grads = [outs[step.num_fwd_outputs + i] for i, k in enumerate(step.primal_kinds)
             if k == "param" and step.num_fwd_outputs + i < len(outs)]
    return Boundary(inputs=tuple(storage(p) for p in primals),
                    outputs=tuple(storage(n) for n in outs[mutated:step.num_fwd_outputs]),
                    param_grads=frozenset(s for s in map(storage, grads) if s is not None))


def source_of(region: Region, plan: Plan) -> Region:
    """The trace ``plan`` was made on: the region's, or a chunked-head twin's (``Plan.loss_chunk``)."""
    if plan.loss_chunk == region.prepared.loss_chunk:
        return region
    return next((t for t in region.twins if t.prepared.loss_chunk == plan.loss_chunk), region)


def _against_the_step_as_written(region: Region, plan: Plan) -> Plan:
    """A twin's plan with the unplanned step and the unlimited step time of the region as written (what the
    step would be without karma), not of its chunked trace."""
    parent = region.parent.prepared if region.parent is not None else None
    if parent is None:
        return plan
    return plan.replace(unplanned_peak_bytes=parent.unplanned_peak_bytes,
                        unlimited_step_time_us=round(parent.keep.makespan_us, 3))


# ---- making variants ----------------------------------------------------------------------------------------
def _strategy_name(config: KarmaConfig, otherwise: str) -> str:
    s = config.strategy
    return s if isinstance(s, str) else getattr(s, "name", otherwise)


def _released(region: Region, plan: Plan) -> Any:
    """``plan`` replayed where the caller lets go of the region's outputs before its backward
    (``regions.released_outputs``), or ``None`` where no output is read by the backward."""
    from karma_fx.simulate import simulate

    p = region.prepared
    problem = released_outputs(p.problem, region.boundary)
    return None if problem is None else simulate(problem, plan, p.costs, detail=False)


def judged(region: Region, raw: Plan, config: KarmaConfig, budget_bytes: int | None) -> Variant:
    """``raw`` replayed on the region's problem (``Prepared.judge``), with its footprint."""
    p = region.prepared
    plan, timeline = p.judge(raw)
    plan = _against_the_step_as_written(region, plan)
    if not plan.budget_bytes:  # a plan made for no budget in particular: the one in force
        plan = plan.replace(budget_bytes=budget_bytes or plan.peak_bytes or 0)
    return Variant(plan=plan, fp=footprint(p.problem, timeline, plan, offload_weights=config.offload_weights,
                                           boundary=region.boundary, released=_released(region, plan)))


def keep_variant(region: Region, config: KarmaConfig, budget_bytes: int | None) -> Variant:
    """The plan that moves nothing: under Inductor, Inductor's own step, with what its partition holds above
    the one planned added to the footprint (the unplanned step a fraction is of is then ``torch.compile``'s)."""
    variant = judged(region, Plan(_strategy_name(config, "keep"), 0, status="KEEP",
                                  notes=("nothing moved: the step as compiled",)), config, budget_bytes)
    excess = region.prepared.keep_all_excess
    if excess is None:
        return variant
    # Inputs and outputs min-cut saves are held to the backward, whether or not the partition planned saves
    # them (min-cut may save a region's input, which is free to it, where the default partition saves what it
    # made of it); the step's outputs start after the buffers it updates (``boundary_of``)
    from karma_fx.inductor import phase_excess

    mutated = sum(1 for k in region.kinds if k == "buffer")
    fwd, bwd = phase_excess(excess, region.prepared.problem)
    released = None  # the caller's outputs let go before the backward: where Inductor's partition saves them
    if excess.as_written_released or excess.planned_released:
        released = min(variant.fp.bwd_peak_bytes + bwd,
                       variant.fp.bwd_peak_of(True) + phase_excess(excess, region.prepared.problem, released=True)[1])
    fp = replace(variant.fp, fwd_peak_bytes=variant.fp.fwd_peak_bytes + fwd,
                 bwd_peak_bytes=variant.fp.bwd_peak_bytes + bwd,
                 bwd_peak_released_bytes=released,
                 internal_held_bytes=max(0, variant.fp.internal_held_bytes + excess.saved),
                 inputs=tuple((b, saved or ("input", i) in excess.saved_edges)
                              for i, (b, saved) in enumerate(variant.fp.inputs)),
                 outputs=tuple((b, saved or (b > 0 and ("output", mutated + j) in excess.saved_edges))
                               for j, (b, saved) in enumerate(variant.fp.outputs)))
    return Variant(plan=variant.plan, fp=fp, inductors_own=True)  # its peak counts the excess (``judge``)


def leanest_variant(region: Region, config: KarmaConfig, budget_bytes: int | None) -> Variant:
    """The leanest plan known (``karma_fx.strategies.leanest``): the floor every refusal names."""
    from karma_fx.strategies.leanest import LEANEST_SWAPS, leanest_plan_parts

    p = region.prepared
    decisions, splits = leanest_plan_parts(p.problem, p.costs, stream_weights=config.offload_weights)
    return judged(region, Plan(_strategy_name(config, "leanest"), 0, decisions=decisions, splits=splits,
                               status="FALLBACK:leanest",
                               notes=(f"the leanest plan: {LEANEST_SWAPS}"
                                      + (", convolutions run a piece of the batch at a time" if splits else ""),)),
                  config, budget_bytes)


def planned_variant(region: Region, config: KarmaConfig, target: int, budget_bytes: int | None) -> Variant:
    """The region planned at ``target`` bytes by the configured strategy, or the plan cached for exactly that
    (``plan_cache``)."""
    from karma_fx.errors import InvalidPlanError
    from karma_fx.plan_cache import PlanCache, problem_key
    from karma_fx.progress import planning

    p = region.prepared
    cache = key = None
    if config.plan_cache is not None:
        cache = PlanCache(config.plan_cache)
        key = problem_key(p.problem, config.device, _strategy_name(config, type(config.strategy).__name__),
                          target, config.offload_weights)
        cached = cache.get(key)
        if cached is not None:
            try:
                return judged(region, cached, config, budget_bytes)
            except InvalidPlanError as exc:
                log.warning("karma_fx: the cached plan does not fit this graph (%s); planning again", exc)
    with planning(f"region {region.index} ({len(p.problem.ops)} ops)"):
        # a plan of the partition planned: the step as written is the keep variant's (``keep_variant``)
        planned = p.plan(Budget(size_bytes=target), config.strategy, raise_if_infeasible=False,
                         offload_weights=config.offload_weights, time_limit_s=config.time_limit_s, as_written=False)
    log.info("karma_fx: region %d planned at %s: %s, %s, peak %s", region.index, format_bytes(target),
             planned.plan.strategy, planned.plan.status, format_bytes(planned.plan.peak_bytes))
    if cache is not None and key is not None:
        if not any("time limit" in note for note in planned.plan.notes):  # a plan cut short is not the answer
            cache.put(key, planned.plan)
    plan = _against_the_step_as_written(region, planned.plan.replace(budget_bytes=budget_bytes or target))
    return Variant(plan=plan, fp=footprint(p.problem, planned.timeline, plan, offload_weights=config.offload_weights,
                                           boundary=region.boundary, released=_released(region, plan)))
