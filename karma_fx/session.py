"""The runs of a training step's compiled regions, and the plan each run gets.

A ``Session`` is the state one ``torch.compile`` call (or one ``karma_fx.compile`` module) shares across its
regions: the configuration, the budget in bytes (a fraction is resolved once, at the first plan), the regions
with the plans (``Variant``) their runs needed, and the runs of the current and the previous step. As a run
starts, ``Session.run`` picks the plan it runs with: the previous step's when the step repeats a sequence that
fitted, else one that fits the room ``karma_fx.regions`` gives it (planned on first need, or read from the plan
cache), else the leanest plan; a budget that cannot work raises ``InfeasibleBudgetError`` naming one that does.
Dynamo and AOTAutograd stay in ``karma_fx.backend``; this module only accounts and decides.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from karma_fx.budget import Budget, format_bytes
from karma_fx.config import KarmaConfig
from karma_fx.errors import InfeasibleBudgetError, KarmaError
from karma_fx.plan import Plan
from karma_fx.regions import Boundary, Footprint, footprint, room, total_that_works
from karma_fx.strategies import DEFAULT_STRATEGY

log = logging.getLogger("karma_fx.session")


def parameters_and_buffers(model: nn.Module) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """``list(model.parameters()), list(model.buffers())`` in one walk of the module tree. This runs every
    step; ``nn.Module.parameters()`` builds a dotted name for every parameter through nested generators, which
    on a 24-layer model costs about a millisecond per call."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    stack, seen = [model], {id(model)}
    while stack:
        module = stack.pop()
        for p in module._parameters.values():
            if p is not None:
                params.setdefault(id(p), p)
        for b in module._buffers.values():
            if b is not None:
                buffers.setdefault(id(b), b)
        for child in reversed(list(module._modules.values())):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return list(params.values()), list(buffers.values())


@dataclass
class Variant:
    """One plan of a region, compiled: what Dynamo's cached code calls for the runs that use this plan."""

    plan: Plan
    fp: Footprint
    fn: Any = None
    graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None
    grad_params: tuple[int, ...] = ()
    """Primal positions of the parameters whose gradients this variant hands to the gradient pipeline."""


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
    inference_fn: Any = None
    last: Variant | None = None
    offload_weights: bool = False
    boundary: Boundary = field(default_factory=Boundary)

    @property
    def plan(self) -> Plan:
        """The plan of the most recent run."""
        if self.last is None:
            raise KarmaError("this region has not run in training mode yet: nothing was planned")
        return self.last.plan

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
        """The smallest budget known to work for this region alone (its leanest plan's peak)."""
        if self.leanest is not None:
            return self.leanest.fp.peak_bytes
        from karma_fx.strategies.leanest import leanest_peak

        p = self.prepared
        return leanest_peak(p.problem, p.costs, stream_weights=self.offload_weights)


@dataclass
class _Run:
    region: Region
    variant: Variant
    own_bytes: int = 0
    """Of the step's persistent bytes, those this run's own problem counts (its weights, the batch it reads)."""

    def fp(self, variant: "Variant | None" = None) -> Footprint:
        """The footprint of ``variant`` (default: the one this run used) as this run sees the step."""
        return replace((variant or self.variant).fp, own_bytes=self.own_bytes)


class Session:
    """The state one ``torch.compile`` call (or one ``karma_fx.compile`` module) shares across its regions:
    the configuration, the budget in bytes (a fraction is resolved once, at the first plan), the regions and
    the runs of the current and the previous step."""

    def __init__(self, config: KarmaConfig, model: nn.Module | None = None, pipeline: Any = None) -> None:
        self.config = config
        self.budget_bytes: int | None = config.budget.size_bytes
        self.regions: list[Region] = []
        self.pipeline = pipeline
        self._model = weakref.ref(model) if model is not None else None
        self._runs: list[_Run] = []
        self._previous: list[_Run] | None = None
        self._seen: dict[int, int] = {}
        self._inputs: dict[int, int] = {}
        self._weight_storage: dict[int, tuple[int, int]] = {}
        """id of each weight and buffer the front door walked this step -> (storage pointer, bytes)."""
        self._previous_inputs = 0
        self._produced: set[int] = set()
        self._saw_backward = False
        self._step_persistent = 0
        self._previous_persistent = 0
        self._learning = False
        self._own_of_last_choice = 0
        self._previous_fit = False
        self.warned_eager = False
        self._persistent_counted = False
        """Whether ``_step_persistent`` was counted for this step (walking every parameter, buffer and gradient
        of a large model costs a millisecond: once a step, not once a call)."""

    # ---- steps ------------------------------------------------------------------------------------------
    def begin_step(self, tensors: tuple[list[nn.Parameter], list[torch.Tensor]] | None = None) -> None:
        """A new training step starts (the front door calls this, passing the model's parameters and buffers
        it has already walked; the raw backend infers it)."""
        self._step_persistent = self._model_persistent_bytes(tensors)
        if self._runs:
            self._previous = self._runs
            self._previous_persistent = sum(self._seen.values())  # weights and buffers: the same next step
            self._previous_inputs = sum(self._inputs.values())
            self._previous_fit = False
            if self._learning:
                self._learning = False
                self._check_sequence(self._previous)
            else:
                assert self.budget_bytes is not None
                persistent = max(self._step_persistent, self._previous_persistent) + self._previous_inputs
                self._previous_fit = total_that_works(persistent, [r.fp() for r in self._previous]
                                                      ) <= self.budget_bytes
        self._runs, self._seen, self._inputs, self._saw_backward = [], {}, {}, False
        self._produced: set[int] = set()
        self._persistent_counted = True

    def _model_persistent_bytes(self, tensors: tuple[list[nn.Parameter], list[torch.Tensor]] | None = None
                                ) -> int:
        self._weight_storage = {}
        if tensors is None:
            model = self._model() if self._model is not None else None
            if model is None:
                return 0
            tensors = parameters_and_buffers(model)
        seen: dict[int, int] = {}
        # Each weight's storage is also what every region run of the step counts (``_persistent``): kept by
        # the tensor's id, valid for the step (the model holds its weights), so those runs need not ask again.
        known = self._weight_storage
        offloaded = self.config.offload_weights
        for group in tensors:
            for t in group:
                if offloaded and isinstance(t, nn.Parameter):
                    continue
                s = t.untyped_storage()
                pointer, nbytes = s.data_ptr(), s.nbytes()
                seen[pointer] = nbytes
                known[id(t)] = (pointer, nbytes)
                grad = t.grad
                if grad is not None:
                    s = grad.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def _persistent(self, args: list[Any], region: Region) -> tuple[int, int]:
        """Bytes on the device all step long (weights and buffers, and the inputs no earlier run produced: the
        batch the caller holds), and how many of them this run's own problem already counts."""
        storages = []  # (pointer, bytes) of every argument this accounting covers; one pass, run every call
        known = self._weight_storage
        for t, kind in zip(args, region.kinds):
            if not isinstance(t, torch.Tensor) or (kind == "param" and self.config.offload_weights):
                continue
            hit = known.get(id(t)) if kind in ("param", "buffer") else None
            if hit is None:
                s = t.untyped_storage()
                hit = (s.data_ptr(), s.nbytes())
            pointer, nbytes = hit
            storages.append((pointer, nbytes))
            if kind in ("param", "buffer"):
                self._seen[pointer] = nbytes
            elif pointer not in self._produced:  # the batch: this step's, not the last step's size
                self._inputs[pointer] = nbytes
        own = sum(nbytes for pointer, nbytes in storages if pointer in self._seen or pointer in self._inputs)
        return self._weights_bytes() + sum(self._inputs.values()), own

    def _weights_bytes(self) -> int:
        return max(self._step_persistent, sum(self._seen.values()), self._previous_persistent)

    def _later(self, region: Region) -> list[Footprint] | None:
        """Leanest footprints of the runs that followed this one in the previous step, if this step has run
        the same regions so far."""
        prev, k = self._previous, len(self._runs)
        if prev is None or len(prev) <= k or prev[k].region is not region:
            return None
        if any(a.region is not b.region for a, b in zip(self._runs, prev)):
            return None
        later = []
        for r in prev[k + 1:]:
            lean = self._leanest(r.region)
            later.append(r.fp(lean))
        return later

    def _check_sequence(self, runs: list[_Run]) -> None:
        """After a step planned run by run without knowing the runs to come: did it fit, and can it?"""
        persistent = max(self._step_persistent, self._previous_persistent) + self._previous_inputs
        assert self.budget_bytes is not None
        ran = total_that_works(persistent, [r.fp() for r in runs])
        self._previous_fit = ran <= self.budget_bytes
        if self._previous_fit:
            return
        log.warning("karma_fx: the first step ran %d compiled region runs; planned one by one without knowing "
                    "the ones to come, together they may have reached %s against a budget of %s. From this "
                    "step on each run leaves room for the runs known to follow.", len(runs),
                    format_bytes(ran), format_bytes(self.budget_bytes))
        needed = total_that_works(persistent, [r.fp(self._leanest(r.region)) for r in runs])
        if needed > self.budget_bytes:
            raise InfeasibleBudgetError(
                f"the step runs {len(runs)} compiled region(s) (graph breaks; a region runs once per layer it "
                f"stands for), and together they need more than the budget of {format_bytes(self.budget_bytes)}: "
                f"each run keeps its saved tensors on the device until its backward. A total budget of "
                f"{format_bytes(needed)} ({needed} bytes) works (every run with its leanest plan); raise the "
                f"budget or remove the graph breaks", min_budget_bytes=needed, budget_bytes=self.budget_bytes)

    # ---- runs -------------------------------------------------------------------------------------------
    def run(self, region: Region, args: list[Any], compile_variant: Callable[[Region, Plan | None, list], Variant]
            ) -> Any:
        if self._saw_backward:
            self.begin_step()
        if not self._persistent_counted:  # the raw backend's first step: no front door called begin_step
            self._step_persistent = self._model_persistent_bytes()
            self._persistent_counted = True
        if region.prepared is None:
            variant = compile_variant(region, None, args)  # plans inside the partitioner (``decide``)
            if region.prepared is None:  # an inference graph: nothing saved, nothing planned
                region.inference_fn = variant.fn
                return variant.fn(*args)
        elif region.inference_fn is not None:
            return region.inference_fn(*args)
        else:
            variant = self._choose(region, args)
            if variant.fn is None:
                compiled = compile_variant(region, variant.plan, args)
                variant.fn, variant.graphs, variant.grad_params = compiled.fn, compiled.graphs, compiled.grad_params
        region.last = variant
        self._runs.append(_Run(region, variant, self._own_of_last_choice))
        if self.pipeline is not None and variant.grad_params:
            self.pipeline.expect([args[i] for i in variant.grad_params])
        out = variant.fn(*args)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self._produced.add(t.untyped_storage().data_ptr())
        return out

    def ran_training_region(self) -> bool:
        return bool(self._runs)

    def saw_backward(self) -> None:
        self._saw_backward = True

    def decide(self, region: Region, args: list[Any], prepared: Any) -> Variant:
        """The first run of a region: keep what the partitioner found and choose its plan."""
        region.prepared = prepared
        if self.budget_bytes is None:
            persistent, own = self._persistent(args, region)
            whole = persistent - own + prepared.unplanned_peak_bytes
            self.budget_bytes = self.config.budget.resolve(whole)
        return self._choose(region, args)

    def others_bytes(self, region: Region) -> int:
        """Persistent bytes of the step that are not the region's own (weights it does not read, ...)."""
        p = region.prepared
        own = sum(st.size_bytes for st in p.problem.storages if st.producer is None and st.kind != "tangent"
                  and not (st.kind == "param" and self.config.offload_weights))
        return max(0, self._weights_bytes() + sum(self._inputs.values()) - own)

    def _leanest(self, region: Region) -> Variant:
        if region.leanest is None:
            from karma_fx.strategies.leanest import leanest_decisions

            p = region.prepared
            decisions = leanest_decisions(p.problem, p.costs, stream_weights=self.config.offload_weights)
            name = self.config.strategy if isinstance(self.config.strategy, str) else "leanest"
            region.leanest = self._variant(region, Plan(name, 1 << 62, decisions=decisions, status="FALLBACK:leanest",
                                                        notes=("the leanest plan: every saved activation swapped "
                                                               "out and back just in time",)))
            region.variants.append(region.leanest)
        return region.leanest

    def _variant(self, region: Region, raw: Plan) -> Variant:
        p = region.prepared
        plan, timeline = p.judge(raw)
        return Variant(plan=plan, fp=footprint(p.problem, timeline, plan, offload_weights=self.config.offload_weights,
                                                  boundary=region.boundary))

    def _plan(self, region: Region, target: int) -> Variant:
        """Plan the region at ``target`` bytes, or reuse the plan cached for exactly that (``plan_cache``)."""
        from karma_fx.errors import InvalidPlanError
        from karma_fx.plan_cache import PlanCache, problem_key

        p = region.prepared
        cache = key = None
        if self.config.plan_cache is not None:
            cache = PlanCache(self.config.plan_cache)
            key = problem_key(p.problem, self.config.device, _name(self.config.strategy), target,
                              self.config.offload_weights)
            cached = cache.get(key)
            if cached is not None:
                try:
                    return self._variant(region, cached)
                except InvalidPlanError as exc:
                    log.warning("karma_fx: the cached plan does not fit this graph (%s); planning again", exc)
        from karma_fx.progress import planning

        with planning(f"region {region.index} ({len(p.problem.ops)} ops)"):
            planned = p.plan(Budget(size_bytes=target), self.config.strategy, raise_if_infeasible=False,
                             offload_weights=self.config.offload_weights, time_limit_s=self.config.time_limit_s)
        log.info("karma_fx: region %d planned at %s: %s, %s, peak %s", region.index, format_bytes(target),
                 planned.plan.strategy, planned.plan.status, format_bytes(planned.plan.peak_bytes))
        if cache is not None and key is not None:
            cache.put(key, planned.plan)
        return Variant(plan=planned.plan, fp=footprint(p.problem, planned.timeline, planned.plan,
                                                       offload_weights=self.config.offload_weights,
                                                       boundary=region.boundary))

    def _replay(self, region: Region) -> Variant | None:
        """The previous step's variant for this run, when this step repeats that step so far and it fit."""
        prev, k = self._previous, len(self._runs)
        if not self._previous_fit or prev is None or len(prev) <= k or prev[k].region is not region:
            return None
        if any(a.region is not b.region or a.variant is not b.variant for a, b in zip(self._runs, prev)):
            return None
        return prev[k].variant

    def _choose(self, region: Region, args: list[Any]) -> Variant:
        assert self.budget_bytes is not None
        persistent, own = self._persistent(args, region)
        self._own_of_last_choice = own
        replay = self._replay(region)
        if replay is not None:
            return replay
        later = self._later(region)
        space = room(self.budget_bytes, persistent, own, [r.variant.fp.held_bytes for r in self._runs], later)
        if later is None and self._runs:
            self._learning = True
        usable = [v for v in region.variants if space.admits(v.fp)]
        if usable:
            return min(usable, key=lambda v: (v.plan.step_time_us or 0.0, v.fp.peak_bytes))
        target = int(min(space.peak_bytes, space.held_bytes))
        if target > 0:
            variant = self._plan(region, target)
            variant = Variant(plan=variant.plan.replace(budget_bytes=int(space.peak_bytes)), fp=variant.fp)
            if space.admits(variant.fp):
                region.variants.append(variant)
                return variant
        lean = self._leanest(region)
        if space.admits(lean.fp) and self.config.strategy == DEFAULT_STRATEGY:
            return lean  # the default strategy's floor: what every "smallest budget known to work" refers to
        return self._no_room(region, lean, later, persistent, own)

    def _no_room(self, region: Region, lean: Variant, later: list[Footprint] | None,
                 persistent: int, own: int) -> Variant:
        assert self.budget_bytes is not None
        if later is None and self._runs and self.config.strategy == DEFAULT_STRATEGY:
            # The first step of a sequence not seen before: go on with the leanest plan, learn the rest of the
            # step, and check the whole sequence when the next step starts.
            log.warning("karma_fx: run %d of this step (region %d) does not fit in what the earlier runs left of "
                        "the budget; it runs with its leanest plan and the step's sequence is checked before the "
                        "next step", len(self._runs) + 1, region.index)
            return lean
        runs = [*(r.fp(self._leanest(r.region)) for r in self._runs), replace(lean.fp, own_bytes=own),
                *(later or [])]
        needed = total_that_works(max(persistent, self._step_persistent), runs)
        others = self.others_bytes(region)
        unplanned = region.prepared.unplanned_peak_bytes + others
        grads = self._lingering_grad_bytes()
        raise InfeasibleBudgetError(
            f"strategy {_name(self.config.strategy)!r} cannot fit the training step in "
            f"{format_bytes(self.budget_bytes)}"
            + (f" (its {len(runs)} compiled region runs share the budget)" if len(runs) > 1 else "")
            + f": the smallest budget known to work is {format_bytes(needed)} ({needed} bytes: every saved "
              f"activation swapped out and back just in time), which the default strategy {DEFAULT_STRATEGY!r} "
              f"reaches; with nothing moved the step peaks at {format_bytes(unplanned)}"
            + (f". {format_bytes(grads)} of that are gradients left from an earlier step: call "
               f"optimizer.zero_grad(set_to_none=True) before the step, or budget for them" if grads else ""),
            min_budget_bytes=needed, budget_bytes=self.budget_bytes)

    def _lingering_grad_bytes(self) -> int:
        model = self._model() if self._model is not None else None
        if model is None:
            return 0
        return sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)


def _name(strategy: Any) -> str:
    return strategy if isinstance(strategy, str) else getattr(strategy, "name", type(strategy).__name__)


def boundary_of(step: Any, problem: Any) -> Boundary:
    """The storages a region's forward returns and those of its parameters' gradients (joint outputs)."""
    output = next(n for n in step.joint.graph.nodes if n.op == "output")
    storage_of = dict(problem.aliases)
    outs = list(output.args[0])

    def storages(nodes: list) -> frozenset[str]:
        return frozenset(storage_of.get(n.name, n.name) for n in nodes if isinstance(n, fx.Node))

    grads = [outs[step.num_fwd_outputs + i] for i, k in enumerate(step.primal_kinds)
             if k == "param" and step.num_fwd_outputs + i < len(outs)]
    return Boundary(outputs=storages(outs[:step.num_fwd_outputs]), param_grads=storages(grads))
