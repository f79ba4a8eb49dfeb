"""``karma_fx.compile``: the model's training step, planned under a budget and rewritten to follow the plan.

The returned module is a drop-in: same call signature and outputs as the model; ``loss.backward()`` fills
``.grad`` of the model's own parameters (AOTAutograd wraps the rewritten forward and backward graphs in an
autograd function), so any optimizer works. The first call captures, plans and compiles; a call with other
input shapes, dtypes or devices does the same again for those (as ``torch.compile`` recompiles).

Example::

    step = karma_fx.compile(model, budget=0.5, strategy="karma")
    loss = loss_fn(step(x), y); loss.backward()
    print(step.plan.table()); fw, bw = step.graphs[0]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from karma_fx.budget import format_bytes, parse_budget
from karma_fx.costs import estimate_costs
from karma_fx.device import DeviceSpec, get_device
from karma_fx.errors import InfeasibleBudgetError, KarmaError, UnsupportedModelError
from karma_fx.exchange import (DEFAULT_BUCKET_BYTES, GradientPipeline, OptimizerFactory, insert_gradient_hooks,
                               param_storages_of)
from karma_fx.passes.capture import _as_torch_compile_sees_it, _friendly_errors
from karma_fx.passes.partition import make_partition_fn
from karma_fx.plan import Plan
from karma_fx.simulate import simulate
from karma_fx.strategies import DEFAULT_STRATEGY, Strategy
from karma_fx.strategies.base import leanest_peak


@dataclass
class Compiled:
    """One compiled variant (per input signature): the callable and what was planned for it."""

    fn: Any
    plan: Plan
    graphs: tuple[fx.GraphModule, fx.GraphModule]
    out_spec: Any
    problem: Any = None
    costs: Any = None


class _FlatStep(nn.Module):
    """The model with flat tensor inputs and a tuple of tensor outputs, as AOTAutograd wants it."""

    def __init__(self, model: nn.Module, spec: Any, leaves: list[Any], slots: list[int]) -> None:
        super().__init__()
        self.model = model
        self._spec, self._leaves, self._slots = spec, leaves, slots
        self.out_spec: Any = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for slot, t in zip(self._slots, tensors):
            leaves[slot] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out = self.model(*args, **kwargs)
        flat, self.out_spec = pytree.tree_flatten(out)
        return tuple(flat)


def boxed_graph(gm: fx.GraphModule) -> Any:
    """The graph as a boxed function that clears its argument list on entry, so each input (a saved
    activation in the backward) is freed after its last use rather than at the end of the graph. Without
    this the backward holds every saved tensor to its end (measured: +32% peak on the tiny CNN)."""
    from functorch.compile import make_boxed_func

    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is None:  # older torch: correct, but inputs live until the graph returns
        return make_boxed_func(gm.forward)
    gm.graph.set_codegen(codegen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def make_plan_fn(budget: str | int | float, strategy: str | Strategy, device: DeviceSpec,
                 result: dict[str, Any], available_bytes: Callable[[int], int] | None = None,
                 context: Callable[[], str] | None = None, offload_weights: bool = False) -> Callable:
    """The planner the partitioner calls: estimate costs, plan with ``strategy`` under ``budget`` and record
    the problem, costs and simulated timeline in ``result``; raises ``InfeasibleBudgetError`` naming the smallest budget known to
    work. ``available_bytes`` maps the parsed budget to what this region may use (graph breaks share it);
    ``context`` adds to the error what else holds the device."""

    def plan_fn(problem: Any, step: Any) -> Plan:
        costs = estimate_costs(problem, device)
        keep = simulate(problem, (), costs)
        budget_bytes = parse_budget(budget, keep.peak_bytes)
        if available_bytes is not None:
            budget_bytes = available_bytes(budget_bytes)
        from karma_fx.api import Prepared, finalize

        prepared = Prepared(problem=problem, costs=costs, keep=keep, step=step)
        raw = prepared.strategy(strategy, offload_weights=offload_weights)(problem, costs, budget_bytes)
        timeline = simulate(problem, raw, costs)

        plan = finalize(raw, problem, costs, timeline, keep, device=costs.device)
        result.update(problem=problem, costs=costs, timeline=timeline)
        if not plan.fits:
            floor = leanest_peak(problem, costs, stream_weights=offload_weights)
            raise InfeasibleBudgetError(
                f"strategy {plan.strategy!r} cannot fit the training step in {format_bytes(budget_bytes)} (its "
                f"plan peaks at {format_bytes(plan.peak_bytes)}); the smallest budget known to work is "
                f"{format_bytes(floor)} ({floor} bytes, reachable with strategy='cpsat')"
                + (context() if context is not None else ""),
                min_budget_bytes=floor, budget_bytes=budget_bytes)
        return plan

    return plan_fn


class KarmaModule(nn.Module):
    """What ``karma_fx.compile`` returns."""

    def __init__(self, model: nn.Module, budget: str | int | float, device: str | DeviceSpec | None,
                 strategy: str | Strategy | None, optimizer: OptimizerFactory | None = None,
                 data_parallel: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 offload_weights: bool = False) -> None:
        super().__init__()
        parse_budget(budget, unplanned_peak_bytes=1 << 62)
        self.model = model
        self.budget = budget
        self.device_spec = get_device(device)
        self.strategy = strategy if strategy is not None else DEFAULT_STRATEGY
        self._variants: dict[Any, Compiled] = {}
        self.offload_weights = offload_weights
        if offload_weights and any(p.device.type != "cpu" for p in model.parameters()):
            raise UnsupportedModelError(
                "offload_weights=True is implemented for models whose weights are in host memory and run on the "
                "CPU (where it is tested); streaming CUDA weights from pinned host memory is not implemented yet")
        self.pipeline: GradientPipeline | None = None
        if optimizer is not None or data_parallel:
            # In AOTAutograd's primal order: tied weights appear once per name (see _compile).
            params = [p for _, p in model.named_parameters(remove_duplicate=False)]
            self.pipeline = GradientPipeline(params, optimizer=optimizer, data_parallel=data_parallel,
                                             bucket_bytes=bucket_bytes)
            if data_parallel:
                _broadcast_from_rank0(model)

    @property
    def plan(self) -> Plan:
        """The plan of the most recent input signature."""
        if not self._variants:
            raise RuntimeError("call the compiled module once first: plans are made for concrete inputs")
        return list(self._variants.values())[-1].plan

    @property
    def graphs(self) -> list[tuple[fx.GraphModule, fx.GraphModule]]:
        return [v.graphs for v in self._variants.values()]

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget known to work for the most recent input signature (see ``leanest_peak``)."""
        if not self._variants:
            raise RuntimeError("call the compiled module once first: plans are made for concrete inputs")
        variant = list(self._variants.values())[-1]
        return leanest_peak(variant.problem, variant.costs, stream_weights=self.offload_weights)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((list(args), kwargs))
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in slots]
        if self.pipeline is not None:
            self.pipeline.wait_updates()  # the host optimizer may still be applying the last step
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors + list(self.model.parameters())):
            # Inference (no_grad, or nothing requires grad): no backward, nothing saved, nothing to plan.
            return self.model(*args, **kwargs)
        devices = {t.device for t in tensors} | {p.device for p in self.model.parameters()}
        if len(devices) > 1:
            raise UnsupportedModelError(f"inputs and parameters are on mixed devices {sorted(map(str, devices))}")
        key = (spec, tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors),
               tuple(None if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in leaves))
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = self._compile(spec, leaves, slots, tensors)
        flat = variant.fn(*tensors)
        return pytree.tree_unflatten(list(flat), variant.out_spec)

    def _compile(self, spec: Any, leaves: list[Any], slots: list[int], tensors: list[torch.Tensor]) -> Compiled:
        from torch._functorch.aot_autograd import aot_module_simplified

        holes = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        flat = _FlatStep(self.model, spec, holes, slots)
        # AOTAutograd lifts parameters and buffers once per *name* (tied weights twice), then the inputs.
        param_names = list(dict(flat.named_parameters(remove_duplicate=False)))
        buffer_names = list(dict(flat.named_buffers(remove_duplicate=False)))
        kinds = tuple(["param"] * len(param_names) + ["buffer"] * len(buffer_names) + ["input"] * len(tensors))
        names = tuple(param_names + buffer_names + [f"input[{i}]" for i in range(len(tensors))])
        result: dict[str, Any] = {}
        plan_fn = make_plan_fn(self.budget, self.strategy, self.device_spec, result,
                               offload_weights=self.offload_weights)

        def on_done(problem, plan, fw, bw):
            result.update(plan=plan, graphs=(fw, bw))

        slots = list(dict(flat.named_parameters(remove_duplicate=False)).values())
        first_slot: dict[int, int] = {}
        tied = []  # (first slot, later slot) of each weight lifted under two names
        for i, t in enumerate(slots):
            first = first_slot.setdefault(id(t), i)
            if first != i:
                tied.append((first, i))
        partition = make_partition_fn(plan_fn, kinds, names, on_done, tuple(tied))

        def boxed(gm: fx.GraphModule, example_inputs: Any):
            return boxed_graph(gm)

        pipeline = self.pipeline
        param_slots = [i for i, k in enumerate(kinds) if k == "param"]

        def boxed_backward(gm: fx.GraphModule, example_inputs: Any):
            if pipeline is not None:
                fw = result["graphs"][0]
                insert_gradient_hooks(gm, param_slots, pipeline, param_storages_of(fw, param_slots))
            return boxed_graph(gm)

        with _as_torch_compile_sees_it(), _friendly_errors("compiling the training step"):
            fn = aot_module_simplified(flat, tuple(tensors), fw_compiler=boxed, bw_compiler=boxed_backward,
                                       partition_fn=partition)
        return Compiled(fn=fn, plan=result["plan"], graphs=result["graphs"], out_spec=flat.out_spec,
                        problem=result["problem"], costs=result["costs"])


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Start every rank from rank 0's weights and buffers, as ``DistributedDataParallel`` does."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def compile(model: nn.Module, *, budget: str | int | float, device: str | DeviceSpec | None = None,
            strategy: str | Strategy | None = None, optimizer: OptimizerFactory | None = None,
            data_parallel: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            offload_weights: bool = False) -> KarmaModule:
    """Plan ``model``'s training step under ``budget`` and return a drop-in module that runs the plan.

    ``optimizer``: a callable building a PyTorch optimizer from a list of parameters (e.g.
    ``functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)``); the update then runs on the host, bucket
    by bucket, while backward goes on, and those parameters get no ``.grad`` (do not step an optimizer
    yourself). ``data_parallel``: all-reduce gradients across the ``torch.distributed`` world in buckets of
    ``bucket_bytes`` as backward produces them (launch with ``torchrun``); rank 0's weights are broadcast
    first. See ``karma_fx.exchange``. ``offload_weights``: parameters stay in host memory and stream through
    the device window by window, gradients go to the host as soon as they exist, so the budget may be below
    the weights' size (``karma_fx.strategies.weights``; CPU-tested, not implemented for CUDA weights yet).
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"karma_fx.compile takes an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not callable(optimizer):
        raise KarmaError("optimizer must be a callable that builds a torch.optim.Optimizer from a parameter list, "
                         "e.g. functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)")
    return KarmaModule(model, budget, device, strategy, optimizer, data_parallel, bucket_bytes, offload_weights)
