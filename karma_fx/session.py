"""The runs of a training step's compiled regions, and the plan each run gets.

A ``Session`` is the state one ``torch.compile`` call (or one ``karma_fx.compile`` module) shares across its
regions: the configuration, the budget in bytes, the regions with the plans (``Variant``) their runs needed,
and the runs of the current and the previous step. As a run starts, ``Session.run`` picks its plan: the
previous step's when the step repeats a sequence that fitted, else the fastest plan of the region under which
the whole step still fits (``karma_fx.regions.Step``: the runs so far as they ran, this one, and the leanest
plans of the runs known to follow), planned on first need (or read from the plan cache), else the leanest
plan; a budget that cannot work raises ``InfeasibleBudgetError`` naming the total that does (the step with
every run at its leanest plan: the same arithmetic, so the total is tight) and the graph breaks that pin
tensors.

The step the budget is for is the step as training runs it: the weights and buffers, the gradients held from
an earlier micro-batch (accumulation), the batch, and what the code between the compiled regions allocates
(the loss head after the last forward, measured once per sequence of runs: ``karma_fx.measure_run.GapMeter``).
A fraction is a fraction of that step unplanned, and it grows with it: the budget in bytes is the fraction of
the largest unplanned step seen (a larger batch, gradients now held), never less, so ``budget=1.0`` always
fits what runs. The step that measured the loss head is also compared, whole, with the step its plans
predicted: where it broke the budget, the difference is kept as a margin and the plans are chosen again
(``karma_fx.margin``); where it moved nothing, it is the unplanned step a fraction is of. Dynamo and
AOTAutograd stay in ``karma_fx.backend``; this module only accounts and decides.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from karma_fx.budget import format_bytes
from karma_fx.caller_state import OptimizerWatch
from karma_fx.config import KarmaConfig
from karma_fx import fsdp_held
from karma_fx.errors import KarmaError
from karma_fx.margin import Margins
from karma_fx.plan import Plan
from karma_fx.between import Between
from karma_fx.refusal import refusal, total_that_works
from karma_fx.regions import Footprint, Run, Step
from karma_fx.run_choice import Candidate, choose_plan
from karma_fx.strategies import DEFAULT_STRATEGY
from karma_fx.runtime import host_pool
from karma_fx.unused_grads import OutputWatch
from karma_fx.variants import Region, Variant, keep_variant, leanest_variant, planned_variant

log = logging.getLogger("karma_fx.session")
RETRIES = 3
"""Plans made at a lower target when the first one fits its run but leaves too little for the runs after."""


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
class _Call:
    """One run of this step: its region, the variant it ran, and how the step sees it."""

    region: Region
    variant: Variant
    view: Run


class Session:
    """The state one ``torch.compile`` call (or one ``karma_fx.compile`` module) shares across its regions."""

    def __init__(self, config: KarmaConfig, model: nn.Module | None = None, pipeline: Any = None) -> None:
        self.config = config
        self.budget_bytes: int | None = config.budget.size_bytes
        self.regions: list[Region] = []
        self.pipeline = pipeline
        self.warned_eager = False
        self.compiles = 0
        """How many times a region of this session compiled: a front door caches its walk of the model until the
        next one."""
        self._model = weakref.ref(model) if model is not None else None
        self._calls: list[_Call] = []
        self._previous: list[_Call] | None = None
        self._previous_fit = False
        self._made: dict[int, tuple[Any, int, Any]] = {}
        """Storage (``storage_of``) -> (identity, bytes, a weak reference to the storage) of what this step's runs
        returned (a storage object's address is taken again as soon as it is freed, by any size of tensor)."""
        self._weights: dict[int, int] = {}
        """Storage (``storage_of``) -> bytes of the weights, buffers and gradients held, this step and before."""
        self._storage_of: dict[int, tuple[Any, int, int]] = {}
        """id of a weight -> (a weak reference to it, its storage, bytes)."""
        self._grad_storage: dict[int, tuple[Any, int, int, int]] = {}
        """id of a held gradient -> (a weak reference to it, its storage, bytes, its data pointer)."""
        self._region_weights_cache: dict[tuple, _RegionWeights] = {}
        self._params_added = 0
        self._seen_weights_cache: tuple[tuple[int, int], tuple[list[Any], list[Any]]] | None = None
        self._params: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._batch: dict[int, int] = {}
        self._previous_batch = 0
        self._begin_weights: dict[int, int] | None = None
        self._begin_weight_bytes = 0
        self._not_yet = 0
        """Bytes counted all step that the step did not hold at its start (``_begin_weights`` has them, and
        ``_begin_weight_bytes`` not): FSDP2's gathered parameters of units not counted in their runs."""
        """The weight storages (and their bytes) the step held when it began; its runs may read others (FSDP2's
        unsharded parameters, gathered for each unit's run into the same storages step after step)."""
        self._expected_growth = 0
        """The bytes of those the last step that chose its plans read besides (not held at this step's start):
        counted from the step's first run on (``_persistent_bytes``)."""
        self._viewed = False
        """Whether a run of this step chose its plan (a replayed step reads no weights)."""
        self._held_grads: set[int] = set()
        """ids of the parameters that held a gradient when the step began (read once a step, in ``begin_step``)."""
        self.measured_ops: dict = {}
        """What the step's ops cost as measured here, by what each computes (``karma_fx.pricing.price``'s
        ``known``): a region traced again is priced from it without running its step again."""
        self._last_reading: tuple[tuple, int] | None = None
        """The last steady step measured: (its sequence of runs, their variants, what it held; its peak)."""
        self._saw_backward = False
        self._started = False
        self._graphs: list[Any] = []
        """Per run of this step, a weak reference to the autograd graph its outputs hang on (``None``: none
        of them needs a gradient): a graph gone with no backward is a step given up (``step_over``)."""
        self._given_up = [False]
        """Set by those references' callbacks when a graph of this step is gone (a new cell each step)."""
        self._announced: list[list[int]] = []
        """The ids of the parameters each run of this step announced to the gradient pipeline
        (``GradientPipeline.expect``): taken back if the step is given up, whose backward will never report them."""
        self._between = Between()
        self._margins = Margins()
        self._outputs = OutputWatch()
        """What the backwards gave each output of a region: those never differentiated are detached."""
        self.twin_maker: Callable[[Region, list[Any]], list[Region]] | None = None
        """Traces a region with its loss head chunked (set by ``karma_fx.backend.KarmaBackend``)."""
        self._fresh_runs = 0
        """Runs of a variant that had not run before (compiled anew or not): such a step is not steady."""
        self._fresh_at_start = (0, 0)
        self._unplanned_bytes = 0
        self._firm_unplanned = 0
        self._guessed_unplanned = 0
        self._this_unplanned = (0, 0)
        """(runs, bytes): the unplanned peak of the step running as its last choice counted it, with that many
        runs. It counts toward ``_firm_unplanned`` or ``_guessed_unplanned`` once the step's backward begins, for
        the runs that ran: a step given up (an evaluation with gradients on, ``step_over``) is no step a fraction
        is of, nor are the runs a step was expected to have and did not."""
        self._device_baseline = 0
        self._optimizers = OptimizerWatch(self._params)
        self._caller_state = 0
        """The state of the caller's optimizers on the weights' device when the step began
        (``karma_fx.caller_state``): on a GPU ``_device_baseline`` has it too; a CPU keeps no other count."""
        self._pending_view: Run | None = None
        self._previous_peak_cache: tuple[Any, int] | None = None
        self._weights_key: Any = None
        self._weights_base: dict[int, int] = {}
        self._fsdp_held: tuple[int, int] | None = None
        self._gathered = fsdp_held.Gathered()
        """What FSDP2 gathers (``fsdp_held.Gathered``): read again at each step's start and as a region first
        reads its weights."""
        self._per_run: set[int] = set()
        self._fsdp_mine: tuple[Any, frozenset[int]] | None = None
        self._fsdp_read: set[int] = set()
        """ids of the FSDP2 units whose gathered parameters the raw backend's runs read (``_own_fsdp_units``)."""
        """ids of FSDP2's unsharded parameters counted in the runs that read them, not all step: a unit's that
        frees them after its forward, where one run reads them all."""

    # ---- steps ------------------------------------------------------------------------------------------
    def begin_step(self, tensors: tuple[list[nn.Parameter], list[torch.Tensor]] | None = None,
                   outside: bool = False, first_run: list[Any] | None = None) -> None:
        """A new training step starts: the front door calls this with the model's parameters and buffers it
        has already walked, ``outside`` any compiled region (where the step can be measured: ``GapMeter``); the
        raw backend when a run follows a backward, with that run's inputs (``first_run``)."""
        self._between.finish()
        measure = self._measure_step(outside)
        if self._calls and self._saw_backward:
            self._detach_unused()
            self._previous = self._calls
            if self._batch:  # a replayed step reads no batch: the same shapes as the one it replays
                self._previous_batch = sum(self._batch.values())
        elif self._calls:  # a step given up (``step_over``): not the step the next one repeats, nor what a
            self._take_back_announced()  # fraction is of
            if self.config.budget.fraction is not None and (self._firm_unplanned or self._guessed_unplanned):
                self._unplanned_bytes = self._firm_unplanned or self._guessed_unplanned
                self.budget_bytes = self.config.budget.resolve(self._unplanned_bytes)
        begun = self._begin_weights or {}  # what the step held when it began, and what its runs read besides:
        grown = {p: b for p, b in self._weights.items() if b > begun.get(p, 0)} if self._viewed else None
        self._viewed = False
        self._calls, self._made, self._batch = [], {}, {}
        self._graphs, self._given_up, self._this_unplanned, self._announced = [], [False], (0, 0), []
        self._saw_backward = False
        self._started = True
        if tensors is None:
            model = self._model() if self._model is not None else None
            # without the model (the raw backend): the weights earlier steps' runs read, whose gradients may be
            # held now
            tensors = parameters_and_buffers(model) if model is not None else self._seen_weights()
        units = self._own_fsdp_units() if fsdp_held.registered() else []  # (FSDP2 or another composable API)
        if units:
            self._gathered = fsdp_held.gathered(units)  # (gradient sync switched off or on since)
            stale = self._per_run - self._gathered.per_run
            if stale:  # a unit keeps its parameters after its forward now (``set_reshard_after_forward(False)``)
                self._per_run -= stale
                self._region_weights_cache.clear()
                self._weights_key = None
        self._weights = dict(self._weights_of(tensors))
        held_before, held = self._held_grads, set()
        self._held_grads = held
        weights, grad_storage = self._weights, self._grad_storage
        for p in tensors[0]:  # their gradients, held from an earlier micro-batch or not
            grad = p.grad
            if grad is not None:
                held.add(id(p))
                # an accumulated gradient is the same tensor from step to step: its storage read once
                # (its data pointer checked: ``grad.data = ...``, as ``Module._apply`` does, keeps the object)
                known = grad_storage.get(id(grad))
                if known is None or known[0]() is not grad or known[3] != grad.data_ptr():
                    known = grad_storage[id(grad)] = (weakref.ref(grad), *storage_of(grad), grad.data_ptr())
                weights[known[1]] = known[2]
        not_yet = 0  # weights counted from the step's start that it does not hold yet (FSDP2 gathers them)
        if units:
            held_now, unsharded = fsdp_held.held_now(units)  # read afresh: what they hold changes step to step
            for t in held_now:  # its shards (the raw backend sees only the unsharded parameters), its gradients
                key, nbytes = storage_of(t)
                if nbytes:
                    weights[key] = nbytes
            per_run, reading = self._per_run, {id(a) for a in first_run or ()}
            for t in unsharded:  # gathered now, or (a unit not counted in its runs: the root's, one whose runs
                key, nbytes = storage_of(t)  # are eager code) gathered at some time in the step: all step
                if id(t) not in per_run:  # (the raw backend's walk read them at the size they had when first read)
                    full = max(nbytes, t.numel() * t.element_size(), weights.get(key, 0))
                    not_yet += full - nbytes
                    weights[key] = full
                elif nbytes and id(t) not in reading:  # (the run the step begins in counts its own)
                    weights[key] = nbytes
        if grown is not None:  # (what this step holds from its start needs no counting ahead)
            self._expected_growth = sum(max(0, b - weights.get(p, 0)) for p, b in grown.items())
        # (copied only when a run reads weights, in ``_view``: a replayed step reads none, and copying every
        # weight's entry each step was a tenth of the host work of a call on 300 weights)
        self._begin_weights, self._begin_weight_bytes = None, sum(weights.values()) - not_yet
        self._not_yet = not_yet
        if len(grad_storage) > 2 * len(held) + 64:  # forget gradients gone (set to None, replaced)
            self._grad_storage = {k: v for k, v in grad_storage.items() if v[0]() is not None}
        self._device_baseline = _allocated_on(tensors[0])
        first = next(iter(tensors[0]), None)
        # (on a GPU the allocator's count has it: ``_device_baseline``)
        self._caller_state = self._optimizers.bytes_on(first.device.type) \
            if first is not None and first.device.type != "cuda" else 0
        # A step that holds other gradients than the last (the first micro-batch of an accumulation, or the
        # step after one that left its gradients) chooses its plans again rather than repeat the last step's:
        # those fitted a step holding more, or fit this one only with less room
        self._previous_fit = not self._between.remeasured and self._previous is not None and \
            held == held_before and self.budget_bytes is not None and self._previous_peak() <= self.budget_bytes
        self._between.remeasured = False
        self._fresh_at_start = (self._fresh_runs, host_pool.misses)
        if measure and self._may_measure_gaps():
            self._between.start(self._signature, self._climbed, gaps=outside)

    def _measure_step(self, outside: bool) -> bool:
        """Whether to measure the step beginning (after a first step, whose sequence of runs is then known):
        the front door until the code between its runs is known; either door until a step that compiled
        nothing was measured whole, and again where a margin was learnt (``karma_fx.margin``). The raw backend
        measures only the climb (``Between``)."""
        if not self._calls:
            return False
        signature = self._signature()
        if outside and self._between.unknown(signature):
            return True
        return self._margins.wanted(signature)

    def _climbed(self, climb: int) -> None:
        """A measured step climbed ``climb`` bytes above what it began with: where that broke the budget, keep
        what it peaked above its plans as a margin for every plan chosen from now (``karma_fx.margin``)."""
        calls = self._calls
        if not calls or self.config.strategy != DEFAULT_STRATEGY:  # a strategy asked for by name plans as asked
            return
        signature = self._signature(calls)
        if (self._fresh_runs, host_pool.misses) != self._fresh_at_start:
            # a plan ran for the first time, or the host pool grew (on a CPU it shares the allocator): not a
            # steady step; measure a later one (``Margins.wanted``, ``Margins.unsteady``)
            self._margins.unsteady(signature)
            return
        base = self._held_at_start()
        measured = base + climb
        reading = (signature, tuple(id(c.variant) for c in calls), base)
        last, self._last_reading = self._last_reading, (reading, measured)
        if last is None or last[0] != reading:
            # one reading is not yet the steady step: code around the runs may allocate once what later steps
            # reuse (DistributedDataParallel rebuilds its gradient buckets at the second step: 8 MiB more in
            # that step's climb on a 4-block model), or a step may meet a transient allocation (a GPT on
            # this CPU read 528 KiB above its plan one step in three). Learn from the lower of two in a row.
            self._margins.unsteady(signature)
            return
        measured = min(measured, last[1])
        self._margins.steady.add(signature)
        if self.config.budget.fraction is not None and all(c.variant is c.region.keep for c in calls):
            # nothing moved: this is the unplanned step a fraction is of, measured (where the compiled kernels
            # peak above their model, ``budget=1.0`` must still be the step as it runs)
            if measured > self._firm_unplanned:
                self._firm_unplanned = measured
                self._between.remeasured = True
            return
        planned = self._sequence_peak([c.view for c in calls], calls, margin=False)
        if self._margins.learn(signature, measured, planned, self.budget_bytes):
            assert self.budget_bytes is not None
            self._between.remeasured = True  # choose the plans again at the next step
            log.warning("karma_fx: a step peaked at %s, over the budget of %s and %s above its plans (a model "
                        "of the compiled kernels that falls short); its plans are chosen again with that margin",
                        format_bytes(measured), format_bytes(self.budget_bytes),
                        format_bytes(measured - planned))

    def step_failed(self, in_backward: bool = False) -> None:
        """The step's forward raised (a budget refused, a model that does not trace): stop measuring it. A
        profiler session left open past the step (``GapMeter``) crashed the process at exit, after the caller
        had caught the error (2026-12-02, torch 2.13: a refused budget caught, then a segmentation fault).
        ``in_backward``: it is its backward that fails, from inside the autograd engine, which restores the
        thread's profiler state as the backward ends: stopped here, the session would come back on with nobody
        to stop it; the meter stops where ``torch.autograd.backward`` returns, as after any backward."""
        if not in_backward:
            self._between.finish()
        self._take_back_announced()
        self._calls, self._graphs, self._started = [], [], False  # given up: the next run begins a step

    def _take_back_announced(self) -> None:
        """A step given up: the gradient pipeline stops waiting for the gradients its runs announced (it kept
        every later backward's as partial sums, and the weights never updated)."""
        if self.pipeline is not None:
            for ids in self._announced:
                self.pipeline.unexpect(ids)
        self._announced = []

    def _weights_of(self, tensors: tuple[list[Any], list[Any]]) -> dict[int, int]:
        """Storage -> bytes of these weights and buffers: read again only when the lists are not the ones read
        last (a front door hands the same lists until the model compiles again) or a region compiled since."""
        key = (id(tensors[0]), id(tensors[1]), len(tensors[0]), len(tensors[1]), self.compiles)
        if self._weights_key != key:
            self._weights = {}
            for group in tensors:
                for t in group:
                    self._add_weight(t, grads=False)
            self._weights_key, self._weights_base = key, dict(self._weights)
        return self._weights_base

    def _add_weight(self, t: torch.Tensor, grads: bool = True) -> None:
        if self.config.offload_weights and isinstance(t, nn.Parameter):
            return
        # A weight keeps its storage from step to step: read it once (every step walks every weight, and two
        # storage lookups a weight were a tenth of a millisecond a step on a 56-weight model).
        if id(t) not in self._per_run:  # (those FSDP2 frees after its unit's forward: not held all step)
            known = self._storage_of.get(id(t))
            if known is None or known[0]() is not t:
                known = self._storage_of[id(t)] = (weakref.ref(t), *storage_of(t))
            self._weights[known[1]] = known[2]
        if isinstance(t, nn.Parameter):
            if self._params.get(id(t)) is not t:
                self._params[id(t)] = t
                self._params_added += 1
            grad = t.grad if grads else None
            if grad is not None:
                pointer, nbytes = storage_of(grad)
                self._weights[pointer] = nbytes

    def _seen_weights(self) -> tuple[list[Any], list[Any]]:
        """The parameters earlier runs read (the raw backend knows no model), as the same lists until one is
        added or dies, so that ``_weights_of`` reads them again only then."""
        key = (self._params_added, len(self._params))
        if self._seen_weights_cache is None or self._seen_weights_cache[0] != key:
            self._seen_weights_cache = (key, (list(self._params.values()), []))
        return self._seen_weights_cache[1]

    def _previous_peak(self) -> int:
        """The previous step's peak if this one repeats it, as the ledger counts it now (cached while what it
        depends on stays: the same runs and variants, the same persistent bytes)."""
        assert self._previous is not None
        key = (tuple(id(c.variant) for c in self._previous), tuple(id(c.view) for c in self._previous),
               self._persistent_bytes(),
               self._margins.of(self._signature(self._previous)))
        if self._previous_peak_cache is None or self._previous_peak_cache[0] != key:
            peak = self._sequence_peak([c.view for c in self._previous], self._previous)
            self._previous_peak_cache = (key, peak)
        return self._previous_peak_cache[1]

    def _persistent_bytes(self) -> int:
        """Weights, buffers, gradients held and the batch (at least the previous step's: later runs may read
        more of it, and a replayed step does not count it again); the weight storages the last step's runs read
        besides what it held when it began, from this step's first run on (counted only as each run read them,
        a step held more at its last run than its first runs' plans had left room for: an FSDP2 root's
        parameters, gathered at its first run and kept to its backward); for FSDP2, its collective buffers
        whose release its collectives decide and one unit gathered ahead of its run (``karma_fx.fsdp_held``: a
        unit's own gathered parameters are in the footprints of its runs); on a GPU at least what its allocator
        held when the step began (what the caller holds besides: labels, optimizer state, other models)."""
        held = sum(self._weights.values())
        grown = max(held - self._begin_weight_bytes - self._not_yet, self._expected_growth) + self._not_yet
        return self._held_at_start() + grown + self._fsdp_in_flight() + self._gathered.ahead_bytes

    def _held_at_start(self) -> int:
        """What the step held when it began (weights, gradients held, the batch): what a measured climb is
        above."""
        seen = self._begin_weight_bytes + max(sum(self._batch.values()), self._previous_batch) + self._caller_state
        return max(seen, self._device_baseline)

    # ---- runs -------------------------------------------------------------------------------------------
    def step_over(self) -> bool:
        """Whether the next run begins a new training step: none has run yet, a backward began since the last
        run, or the autograd graph of a run of this step is gone with no backward (its outputs and what was
        computed from them dropped: an evaluation with gradients on). Otherwise runs are one step, whichever
        door they come through: what each saves is held until the backward (a model called on two views of a
        batch, or on pieces of it, before one ``loss.backward()``), so they share the budget."""
        return self._saw_backward or not self._started or self._given_up[0]

    def run(self, region: Region, args: list[Any], compile_variant: Callable[[Region, Plan | None, list], Variant]
            ) -> Any:
        if torch.is_grad_enabled() and self.step_over():  # (an inference call is no step)
            self.begin_step(first_run=args)
        self._between.run_starts(len(self._calls))
        if region.prepared is not None and region.scratch_unmeasured and not _profiling():
            self._forget(region)  # planned under a profiler: measure its scratch and plan it again now
        if region.retrace:  # its graph changed (``_detach_unused``): traced and planned again now
            region.retrace = False
            self._forget(region)
        if region.inference_fn is not None:  # an inference graph (nothing saved), compiled at its first run
            return region.inference_fn(*args)
        if region.prepared is None:
            self._compiled_anew()
            if self._may_chunk_head(region):
                assert self.twin_maker is not None
                region.twins = self.twin_maker(region, args)
            variant = compile_variant(region, None, args)  # plans inside the partitioner (``decide``)
            if region.prepared is None:  # an inference graph: nothing saved, nothing planned
                region.inference_fn = variant.fn
                return variant.fn(*args)
        else:
            variant = self._choose(region, args)
        if variant.fn is None:
            self._compiled_anew()
            compiled = compile_variant(region, variant.plan, args)
            variant.fn, variant.graphs, variant.grad_params = compiled.fn, compiled.graphs, compiled.grad_params
        region.last = variant
        if not variant.ran:
            variant.ran = True
            self._fresh_runs += 1
        region.budget_bytes = self.budget_bytes or 0
        view = self._pending_view
        assert view is not None
        self._calls.append(_Call(region, variant, view if view.fp is variant.fp else view.with_fp(variant.fp)))
        if self.pipeline is not None and variant.grad_params:
            announced = [args[i] for i in variant.grad_params]
            self.pipeline.expect(announced, args)
            self._announced.append([id(p) for p in announced])  # (ids: the session holds no parameter)
        k = len(self._calls) - 1
        out = variant.fn(*args)
        self._graphs.append(_graph_of(out, self._given_up))
        # (no hooks under a gradient pipeline: nothing is detached there, ``_detach_unused``)
        out = self._outputs.returned(region, out, lambda: self._as_written_again(region),
                                     watch=self.pipeline is None)
        self._between.run_returned(k, out)
        for o, t in enumerate(out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor):
                pointer, nbytes = storage_of(t)
                known = self._made.get(pointer)
                if known is None or _gone(known[2]):
                    self._made[pointer] = (("out", k, o), nbytes, _weak_storage(t))
        return out

    def _compiled_anew(self) -> None:
        """A region compiles (Dynamo saw a changed module, parameter, device or shape, or a plan is new): what
        was cached of the weights may be stale."""
        self.compiles += 1
        self._storage_of.clear()
        self._grad_storage.clear()

    def ran_training_region(self) -> bool:
        return bool(self._calls)

    def saw_backward(self) -> None:
        """A backward of this step's runs begins: the code after the last forward (the loss head) ends here.
        Its measurement ends with a mark, read when the next step begins (``GapMeter``)."""
        if not self._saw_backward:
            self._between.backward_began(self._signature())
            runs, whole = self._this_unplanned
            if runs:
                if runs != len(self._calls):  # counted with runs that did not come (a step before had more)
                    whole = self._sequence_peak([c.view.with_fp(self._keep(c.region).fp) for c in self._calls],
                                                self._calls, margin=False)
                    self._between.remeasured = True  # and its budget with them: the next step chooses again
                if not self._between.unknown(self._signature()):
                    self._firm_unplanned = max(self._firm_unplanned, whole)
                self._guessed_unplanned = max(self._guessed_unplanned, whole)
        self._saw_backward = True

    def decide(self, region: Region, args: list[Any], prepared: Any) -> Variant:
        """The first run of a region: keep what the partitioner found and choose its plan."""
        region.prepared = prepared
        return self._choose(region, args)

    def _may_chunk_head(self, region: Region) -> bool:
        """Whether to trace ``region`` a second time with its loss head chunked, for the planner to choose: where
        it may choose (``loss_chunk=None``, the default strategy) and the region computes a cross-entropy."""
        if self.config.loss_chunk is not None or self.config.strategy != DEFAULT_STRATEGY or self.twin_maker is None:
            return False
        losses = (torch.nn.functional.cross_entropy, torch._C._nn.cross_entropy_loss)
        return any(n.op == "call_function" and n.target in losses for n in region.gm.graph.nodes)

    def _detach_unused(self) -> None:
        """After a step's backward: trace again, with those outputs detached, each region that returned an output
        no backward has differentiated (``karma_fx.unused_grads``). The next step chooses its plans anew, and the
        unplanned step a fraction is of is that step's, learnt again. Not with a gradient pipeline (``optimizer=``,
        ``data_parallel=``): it hands gradients over and updates during the backward, so a step whose guard
        raised could not be taken back."""
        from karma_fx.passes.unused_outputs import detach_outputs

        if self.pipeline is not None:
            return
        for region in {id(c.region): c.region for c in self._calls}.values():
            positions = () if region.detached or region.as_written_only else self._outputs.unused(region.index)
            if positions:
                region.as_written = region.gm
                region.gm = detach_outputs(region.gm, positions)
                region.detached, region.retrace = positions, True
                self._between.remeasured = True
                self._firm_unplanned = self._guessed_unplanned = 0
                log.info("karma_fx: region %d returns output(s) %s detached: no backward differentiated them",
                         region.index, list(positions))

    def _as_written_again(self, region: Region) -> str:
        """A backward differentiated an output ``region`` returns detached: the step fails (the guard raises),
        and the region is traced as written from its next run on. Returns what the error names."""
        where = f"output {list(region.detached)} of compiled region {region.index}"
        assert region.as_written is not None  # (a guard exists only where outputs were detached)
        region.gm, region.as_written = region.as_written, None
        region.detached, region.as_written_only, region.retrace = (), True, True
        self._between.remeasured = True
        # the step run again is a first one: no earlier run counts this region by its detached plans, leaner than
        # what it traces now (a budget that fits was refused)
        self._previous = None
        self.step_failed(in_backward=True)
        return where

    def _forget(self, region: Region) -> None:
        region.prepared, region.variants, region.leanest, region.keep = None, [], None, None
        region.twins = []
        region.planned_at = []

    # ---- the code between runs --------------------------------------------------------------------------
    def _signature(self, calls: list[_Call] | None = None) -> tuple[int, ...]:
        return tuple(c.region.index for c in (self._calls if calls is None else calls))

    def _may_measure_gaps(self) -> bool:
        """Only where no thread of ours runs beside the step (the gradient pipeline, threaded copies) and not
        on a GPU (see ``Between.start``)."""
        from karma_fx.runtime import cpu_copies_are_synchronous

        return (self.pipeline is None and cpu_copies_are_synchronous()
                and not any(t.is_cuda for t in self._params.values()))

    def _gap_list(self, views: list[Run], signature: tuple[int, ...]) -> list[int]:
        return self._between.gap_list(views, signature)

    # ---- accounting -------------------------------------------------------------------------------------
    def _view(self, region: Region, fp: Footprint, args: list[Any]) -> Run:
        """How the step sees this run of ``region`` with a plan of footprint ``fp`` (its inputs from ``args``)."""
        k = len(self._calls)
        if self._begin_weights is None:  # what the step held when it began, before its runs read weights
            self._begin_weights = dict(self._weights)
        weights, first = self._region_weights(region, args)  # ``first``: its trainable parameters, if read now
        self._viewed = True
        self._weights.update(weights.own)
        own = dict(weights.own)
        new_grads, grad_ids, grad_sizes = 0, frozenset(), None
        if not self.config.offload_weights:
            # The gradients its backward leaves, by parameter (``Run.grad_ids``): a parameter several runs of the
            # step read gets it from the backward of the last of them, which runs first (``regions._phases``).
            if first is not None:  # parameters ``begin_step`` may not have seen: read their gradients
                grad_ids = frozenset(id(p) for p in first if p.grad is None)
            else:
                held = self._held_grads
                grad_ids = weights.trainable_ids - held if held else weights.trainable_ids
            if grad_ids:
                shards = self._gathered.shard_bytes  # (FSDP2 reduce-scatters a unit's gradients: its shards stay)
                if shards:
                    grad_sizes = {i: shards.get(i, weights.bytes_of[i]) for i in grad_ids}
                    new_grads = sum(grad_sizes.values())
                else:
                    grad_sizes = weights.bytes_of
                    new_grads = weights.trainable_bytes if len(grad_ids) == len(weights.trainable_ids) else \
                        sum(grad_sizes[i] for i in grad_ids)
        reads, positions = [], []
        inputs = fp.inputs
        for i in weights.others:
            t = args[i]
            pointer, nbytes = storage_of(t)
            made = self._made.get(pointer)
            if made is not None and _gone(made[2]):  # an output gone, its storage object's address taken again
                made = None
            if made is None:  # the batch, or what eager code made from it: held by the caller
                if pointer not in self._weights:  # (a buffer Dynamo passes as an input is a weight, counted)
                    self._batch[pointer] = nbytes
                own[pointer] = nbytes
                continue
            saved = inputs[i][1] if i < len(inputs) else True
            reads.append((made[0], made[1], saved))
            positions.append(i)
        makes = tuple((("out", k, o), b, saved) for o, (b, saved) in enumerate(fp.outputs))
        kept = self._between.caller_keeps(self._signature() + (region.index,))
        return Run(fp=fp, own_bytes=sum(own.values()), reads=tuple(reads), makes=makes, new_grad_bytes=new_grads,
                   grad_ids=grad_ids, grad_sizes=grad_sizes,
                   region=region.index, caller_keeps=kept, read_positions=tuple(positions))

    def _region_weights(self, region: Region, args: list[Any]) -> tuple["_RegionWeights", list | None]:
        """The weights ``region`` reads (its parameter and buffer inputs), read off ``args`` once per compile and
        set of weight objects (one region may run for several layers, each with its own): each weight walked
        every run was most of the host work of a call (1.2 ms a run on 300 weights). Also its trainable
        parameters where they were read just now (``None`` otherwise). Only ids and sizes are kept: a session
        must not keep a deleted model's parameters alive."""
        positions = region.weight_positions
        key = (region.index, self.compiles, tuple(map(id, (args[i] for i in positions))))
        cached = self._region_weights_cache.get(key)
        if cached is not None:
            return cached, None
        if len(self._region_weights_cache) > 4 * len(self.regions) + 64:
            self._region_weights_cache.clear()  # stale compiles' entries
        if fsdp_held.registered():  # this unit's parameters are gathered now: which FSDP2 frees after its run
            before = set(self._fsdp_read)
            units = self._own_fsdp_units(args)
            self._gathered = gathered = fsdp_held.gathered(units)
            found = [u for u in units if id(u) not in before] if self._model is None else []
            if found:  # (the raw backend's first step: the units it did not know when the step began)
                for t in fsdp_held.held_now(found)[0]:
                    key, nbytes = storage_of(t)
                    self._weights[key] = max(nbytes, self._weights.get(key, 0))
            read = {id(args[i]) for i in positions}
            self._per_run.update(i for i in read & gathered.per_run if gathered.unit_of[i] <= read)
        own: dict[int, int] = {}
        trainable, others = [], []
        for i, (t, kind) in enumerate(zip(args, region.kinds)):
            if not isinstance(t, torch.Tensor):
                continue
            if kind not in ("param", "buffer"):
                others.append(i)
                continue
            if kind == "param" and self.config.offload_weights:
                continue
            self._add_weight(t)  # and a gradient it holds now (on later runs, ``begin_step`` counts those)
            if id(t) not in self._per_run:  # (a weight FSDP2 gathers for this run only: in its footprint)
                pointer, nbytes = storage_of(t)
                own[pointer] = nbytes
            if kind == "param" and t.requires_grad:
                trainable.append(t)
        bytes_of = {id(p): p.numel() * p.element_size() for p in trainable}
        weights = _RegionWeights(own=own, trainable_ids=frozenset(bytes_of),
                                 trainable_bytes=sum(bytes_of.values()), bytes_of=bytes_of, others=tuple(others))
        self._region_weights_cache[key] = weights
        return weights, trainable

    def _later(self, region: Region) -> list[_Call] | None:
        """The runs that followed this one in the previous step, if this step has run the same regions so far."""
        prev, k = self._previous, len(self._calls)
        if prev is None or len(prev) <= k or prev[k].region is not region:
            return None
        if any(a.region is not b.region for a, b in zip(self._calls, prev)):
            return None
        return prev[k + 1:]

    def _sequence_peak(self, views: list[Run], calls: list[_Call], margin: bool = True) -> int:
        """The step's peak with ``views`` for its runs; with the margin its measured steps showed above their
        plans (``karma_fx.margin``) unless ``margin`` is off (the unplanned step a fraction is of)."""
        signature = tuple(c.region.index for c in calls)
        return Step(self._base_bytes(signature, margin), tuple(views),
                    tuple(self._gap_list(views, signature))).peak_bytes

    def _base_bytes(self, signature: tuple[int, ...], margin: bool = True) -> int:
        """What the step holds all through: the persistent bytes, and the margin of ``signature``."""
        return self._persistent_bytes() + (self._margins.of(signature) if margin else 0)

    def _own_fsdp_units(self, reading: list[Any] | None = None) -> list[nn.Module]:
        """The FSDP2 units of this session's model (others may live in the process: a reference model, another
        compiled one): under the front door those among its modules; under the raw backend, which knows no
        model, those whose gathered parameters its runs read (``reading``: a run's inputs, read now)."""
        units = fsdp_held.fsdp_units()
        if not units:
            return []
        model = self._model() if self._model is not None else None
        if model is not None:
            key = (id(model), fsdp_held.registered())
            if self._fsdp_mine is None or self._fsdp_mine[0] != key:
                modules = {id(m) for m in model.modules()}
                self._fsdp_mine = (key, frozenset(id(u) for u in units if id(u) in modules))
            return [u for u in units if id(u) in self._fsdp_mine[1]]
        known = self._fsdp_read
        if not reading:
            return [u for u in units if id(u) in known]
        read = {id(t) for t in reading}
        before = len(known)
        for unit in units:
            if id(unit) not in known and any(id(p) in read for p in fsdp_held.gathered_parameters(unit)):
                known.add(id(unit))
        if len(known) != before:  # and the units around them (the root: its parameters may run as eager code)
            known.update(id(u) for u in units if any(id(m) in known for m in u.modules()))
        return [u for u in units if id(u) in known]

    def _fsdp_in_flight(self) -> int:
        """``fsdp_held.in_flight_bytes``, read again only when the modules composable APIs registered change."""
        key = fsdp_held.registered()
        if self._fsdp_held is None or self._fsdp_held[0] != key:
            self._fsdp_held = (key, fsdp_held.in_flight_bytes())
        return self._fsdp_held[1]

    def _replay(self, region: Region) -> Variant | None:
        """The previous step's variant for this run, when this step repeats that step so far and it fit."""
        prev, k = self._previous, len(self._calls)
        if not self._previous_fit or prev is None or len(prev) <= k or prev[k].region is not region:
            return None
        if any(a.region is not b.region or a.variant is not b.variant for a, b in zip(self._calls, prev)):
            return None
        return prev[k].variant

    def _choose(self, region: Region, args: list[Any]) -> Variant:
        replay = self._replay(region)
        if replay is not None:
            assert self._previous is not None
            self._pending_view = self._previous[len(self._calls)].view
            return replay
        keep = self._keep(region)
        self._pending_view = self._view(region, keep.fp, args)
        later = self._later(region)
        if later is None and self._calls:
            self._previous_fit = False
        calls = list(self._calls)
        signature_calls = calls + [_Call(region, keep, self._pending_view)] + (later or [])

        def sequence(fp: Footprint, lean_later: bool = True) -> list[Run]:
            rest = [c.view.with_fp((self._leanest(c.region) if lean_later else self._keep(c.region)).fp)
                    for c in later or []]
            return [c.view for c in calls] + [self._pending_view.with_fp(fp)] + rest

        def peak(fp: Footprint) -> int:
            # the later runs at their leanest plans, or all as written where that peaks lower: a region's step
            # as written may hold more in its forward than its leanest plan and less in its backward (a min-cut
            # partition saving a 512 KiB input to recompute what the planned partition saves), and which one
            # leaves this run more room depends on where the step peaks
            lean = self._sequence_peak(sequence(fp), signature_calls)
            if not later or self.config.strategy != DEFAULT_STRATEGY:
                return lean
            return min(lean, self._sequence_peak(sequence(fp, lean_later=False), signature_calls))

        self._resolve_budget([c.view.with_fp(self._keep(c.region).fp) for c in calls]
                             + sequence(keep.fp, lean_later=False)[len(calls):], signature_calls)
        budget = self.budget_bytes
        assert budget is not None
        ran = self._previous[len(calls)].variant if later is not None and self._previous else None
        candidates = [Candidate(key=i, step_time_us=v.plan.step_time_us or 0.0, own_peak_bytes=v.fp.peak_bytes,
                                step_peak_bytes=peak(v.fp), leanest=v is region.leanest, ran_last_step=v is ran,
                                ran_before=v.ran, keep=v is keep)
                      for i, v in enumerate(region.variants)]
        variants = list(region.variants)
        lean = self._leanest(region)
        target = self._target(region, keep, sequence, signature_calls, budget)
        choice = choose_plan(candidates, budget, target, region.planned_at)
        if choice.use is not None:
            return variants[choice.use]
        region.planned_at.append(target)
        for _ in range(RETRIES):
            if target <= 0 or target < lean.fp.peak_bytes:
                break
            variant = self._plan(region, target)
            over = peak(variant.fp) - budget
            if over <= 0:
                region.variants.append(variant)
                return variant
            target -= over
        if peak(lean.fp) <= budget and self.config.strategy == DEFAULT_STRATEGY:
            return lean  # the default strategy's floor: what every "smallest budget known to work" refers to
        return self._no_room(region, later, signature_calls)

    def _target(self, region: Region, keep: Variant, sequence: Callable, calls: list[_Call], budget: int) -> int:
        """The peak this run's plan may have, as its own problem counts it: the budget less what the step holds
        besides it in its forward and in its backward, whichever is more."""
        empty = replace(keep.fp, fwd_peak_bytes=0, bwd_peak_bytes=0, internal_held_bytes=0,
                        bwd_peak_released_bytes=None)
        views = sequence(empty)
        signature = tuple(c.region.index for c in calls)
        step = Step(self._base_bytes(signature), tuple(views),
                    tuple(self._gap_list(views, signature)))
        k = len(self._calls)
        around = [p.device_bytes for p in step.phases if p.run == k and p.stage in ("forward", "backward")]
        return budget - max(around, default=0)

    def _resolve_budget(self, unplanned: list[Run], calls: list[_Call]) -> None:
        """A fraction of the step unplanned: of the largest one so far that reached its backward (a larger batch,
        gradients now held), or of this one where it is larger still. A step whose code between the runs is not
        measured yet counts a guess for it (``LOSS_HEAD_GUESS``), which the measurement then replaces, so the
        budget in bytes may come down once, never below the largest step measured."""
        whole = self._sequence_peak(unplanned, calls, margin=False)
        self._this_unplanned = (len(unplanned), whole)
        self._unplanned_bytes = max(self._firm_unplanned or self._guessed_unplanned, whole)
        if self.config.budget.fraction is None:
            return
        resolved = self.config.budget.resolve(self._unplanned_bytes)
        if resolved != self.budget_bytes:
            if self.budget_bytes is not None:
                log.info("karma_fx: budget %s is now %s (the step is %s unplanned)", self.config.budget,
                         format_bytes(resolved), format_bytes(self._unplanned_bytes))
            self.budget_bytes = resolved

    def _no_room(self, region: Region, later: list[_Call] | None, calls: list[_Call]) -> Variant:
        assert self.budget_bytes is not None
        lean = self._leanest(region)
        learning = later is None and (bool(self._calls) or self.config.budget.fraction is not None)
        if learning and self.config.strategy == DEFAULT_STRATEGY:
            # The first step of a sequence not seen before: go on with the leanest plan, learn the rest of the
            # step, and check the whole sequence when the next step starts. (A fraction is of the whole step,
            # which the first run cannot know: more runs may follow.)
            log.warning("karma_fx: run %d of this step (region %d) does not fit in what the earlier runs left of "
                        "the budget; it runs with its leanest plan and the step's sequence is checked before the "
                        "next step", len(self._calls) + 1, region.index)
            return lean
        regions = [c.region for c in calls]
        signature = tuple(r.index for r in regions)
        base = self._base_bytes(signature)
        floors = []
        for pick in self._floor_picks():
            views = ([c.view.with_fp(pick(c.region).fp) for c in self._calls]
                     + [self._pending_view.with_fp(pick(region).fp)]
                     + [c.view.with_fp(pick(c.region).fp) for c in later or []])
            gaps = self._gap_list(views, signature)
            floors.append((total_that_works(base, views, gaps), views, gaps, pick))
        _, views, gaps, pick = min(floors, key=lambda f: f[0])
        raise refusal(strategy=_name(self.config.strategy), budget_bytes=self.budget_bytes, views=views,
                      regions=regions, base=base, gaps=gaps, leanest=pick, unplanned=self._unplanned_bytes,
                      held_grad_bytes=self._held_grad_bytes(), partial=later is None and not self._calls,
                      as_written=all(pick(r) is r.keep for r in regions))

    def _floor_picks(self) -> list[Callable[[Region], Variant]]:
        """The plans a step's floor is taken over, each for every run: the leanest, and under the default strategy
        also the plan that moves nothing, which it runs wherever that fits. Under Inductor the step as written
        (its own partition) may peak below every plan that swaps (a cat of sixteen pieces: 24.25 MiB as written,
        32.28 with every saved activation swapped), and a refusal named the higher as the smallest that works."""
        if self.config.strategy != DEFAULT_STRATEGY:
            return [self._leanest]
        return [self._leanest, self._keep]

    def _held_grad_bytes(self) -> int:
        return sum(storage_of(p.grad)[1] for p in list(self._params.values()) if p.grad is not None)

    # ---- the step's figures -------------------------------------------------------------------------------
    def step_figures(self) -> tuple[int, int, int]:
        """(predicted peak, unplanned peak, smallest budget known to work) of the step that ran last: the whole
        step's device bytes as the ledger counts them, with the plans it ran, nothing moved, the leanest plans."""
        calls = self._calls or self._previous or []
        if not calls:
            raise KarmaError("call the compiled module once first (in training mode, with gradients on): plans "
                             "are made for concrete inputs")
        keep = [c.view.with_fp(self._keep(c.region).fp) for c in calls]
        floor = min(self._sequence_peak([c.view.with_fp(pick(c.region).fp) for c in calls], calls)
                    for pick in self._floor_picks())
        return (self._sequence_peak([c.view for c in calls], calls), self._sequence_peak(keep, calls, margin=False),
                floor)

    # ---- variants ---------------------------------------------------------------------------------------
    def _keep(self, region: Region) -> Variant:
        """The plan that moves nothing. The default strategy runs it wherever it fits (it would plan nothing
        else); a strategy asked for by name plans every step itself, as asked."""
        if region.keep is None:
            region.keep = keep_variant(region, self.config, self.budget_bytes)
            if self.config.strategy in (DEFAULT_STRATEGY, "keep"):
                region.variants.append(region.keep)
        return region.keep

    def _leanest(self, region: Region) -> Variant:
        """The leanest plan known, with the loss head chunked where that is leaner; under the default strategy,
        the step as written where it holds no more in any way the step counts (Inductor's own partition may
        recompute what every plan of the partition planned saves: a small region whose min-cut partition saves
        nothing). Not by its own peak alone: what a region keeps for its backward is held while later regions
        run, and a step as written peaking lower but keeping 11 MiB the leanest plan swaps out made a two-region
        step refuse a budget the leanest plans fitted."""
        if region.leanest is None:
            lean = leanest_variant(region, self.config, self.budget_bytes)
            for twin in region.twins:
                other = leanest_variant(twin, self.config, self.budget_bytes)
                lean = other if other.fp.peak_bytes < lean.fp.peak_bytes else lean
            if self.config.strategy == DEFAULT_STRATEGY and region.prepared.keep_all_excess is not None:
                keep = self._keep(region)
                if _no_more(keep.fp, lean.fp):
                    region.leanest = keep
                    return keep
            region.leanest = lean
            region.variants.append(region.leanest)
        return region.leanest

    def _plan(self, region: Region, target: int) -> Variant:
        """The region planned at ``target``; where it has chunked twins, also each twin's plan that moves nothing
        else, or where that does not fit its plan at ``target``: the fastest that fits, else the leanest."""
        planned = planned_variant(region, self.config, target, self.budget_bytes)
        options = [planned]
        for twin in region.twins:
            if twin.keep is None:
                twin.keep = keep_variant(twin, self.config, self.budget_bytes)
            options.append(twin.keep if twin.keep.fp.peak_bytes <= target else
                           planned_variant(twin, self.config, target, self.budget_bytes))
        fitting = [v for v in options if v.fp.peak_bytes <= target]
        if fitting:
            return min(fitting, key=lambda v: v.plan.step_time_us or 0.0)
        return min(options, key=lambda v: v.fp.peak_bytes)


@dataclass(frozen=True)
class _RegionWeights:
    """What a region's weight inputs hold, as read at its first run after a compile (``Session._region_weights``)."""

    own: dict[int, int]
    """Storage -> bytes of its parameters and buffers."""
    trainable_ids: frozenset[int]
    trainable_bytes: int
    bytes_of: dict[int, int]
    """id of a trainable parameter -> its bytes (those of the gradient it gets)."""
    others: tuple[int, ...]
    """The positions of its other tensor inputs (the batch, activations from earlier runs)."""


def _graph_of(out: Any, gone: list[bool]) -> Any:
    """A weak reference to the autograd node of a run's first output that takes one (the compiled function's
    backward: alive while anything computed from the outputs may still be backpropagated), which sets
    ``gone[0]`` when the node goes; ``None`` where there is none."""
    def went(_: Any) -> None:
        gone[0] = True

    for t in out if isinstance(out, (list, tuple)) else (out,):
        node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if node is not None:
            try:
                return weakref.ref(node, went)
            except TypeError:  # a C++ node (an output that is a view of an input): try the next output
                continue
    return None


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """(an identity, bytes) of the device memory ``t`` holds on this process: its storage's identity (the address
    of the storage object, not of its memory: FSDP2 frees its gathered parameters' storages after each unit's
    run and fills them again in place, at another address each time, where another unit's may have been a
    moment before) and size; for
    a distributed tensor (FSDP2 shards parameters into ``DTensor``s) its local shard's, the rank's own; for a
    tensor subclass without storage of its own, its elements', keyed by the tensor object."""
    t = _this_ranks(t)
    try:
        s = t.untyped_storage()
        return s._cdata, s.nbytes()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass: no storage to read
        return id(t), t.numel() * t.element_size()


def _weak_storage(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage, the one ``storage_of`` names (``None`` for a tensor subclass without
    one of its own)."""
    try:
        return StorageWeakRef(_this_ranks(t).untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _this_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a distributed tensor (``DTensor``) this rank's shard of it: what this process holds."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _gone(ref: Any) -> bool:
    return ref is not None and ref.expired()


def _allocated_on(tensors: Any) -> int:
    """What the CUDA caching allocator holds on the device of ``tensors`` (the first one's: a step's weights are
    on one device), or 0 off CUDA: a CPU keeps no such count."""
    first = next(iter(tensors), None)
    return torch.cuda.memory_allocated(first.device) if first is not None and first.is_cuda else 0


def _profiling() -> bool:
    from karma_fx.measure_run import profiler_running

    return profiler_running()


def _name(strategy: Any) -> str:
    return strategy if isinstance(strategy, str) else getattr(strategy, "name", type(strategy).__name__)


def _no_more(a: Footprint, b: Footprint) -> bool:
    """Whether footprint ``a`` holds no more than ``b`` in either phase, nor across its forward and backward."""
    return (a.fwd_peak_bytes <= b.fwd_peak_bytes and a.bwd_peak_bytes <= b.bwd_peak_bytes
            and a.bwd_peak_of(True) <= b.bwd_peak_of(True) and a.held_bytes <= b.held_bytes
            and a.peak_bytes < b.peak_bytes)
