"""``torch.compile(model, backend="karma", options={"budget": ...})``: the planner as a Dynamo backend.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so the string ``"karma"``
works with nothing imported first. Dynamo hands us one FX graph per compiled region; AOTAutograd traces its
joint forward+backward graph and calls our partitioner, exactly as in ``karma_fx.compile``.

Options (all but ``budget`` optional): ``budget`` (bytes, ``"12GiB"`` or a fraction of the unplanned peak),
``strategy``, ``device`` (a preset name or ``DeviceSpec`` for the cost model).

Graph breaks give several regions, which run one after the other in the forward and in reverse in the
backward, so a region's saved tensors stay on the device while every later region runs. How we split the
budget: the regions of one ``torch.compile`` call (one ``options`` dict) share it. A region compiled after
others gets the budget minus what the others hold on the device at the end of their forward (parameters,
buffers and the saved tensors their plans keep there, as simulated; their outputs, which the next region
also counts as its inputs, are counted twice, which errs on the safe side). A fractional budget is first turned into
bytes against the region's own unplanned peak plus what the others hold. A region recompiled for other
shapes replaces its own entry rather than adding to the total. ``regions(options)`` lists what was planned.

Dynamic shapes are not supported: a plan is made for concrete sizes. Dynamo marks a dimension dynamic when it
sees a second shape; pass ``dynamic=False`` to ``torch.compile`` so that it recompiles (and we re-plan)
instead.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from karma_fx.budget import format_bytes, parse_budget
from karma_fx.compiler import boxed_graph, make_plan_fn
from karma_fx.device import get_device
from karma_fx.errors import KarmaError, UnsupportedModelError
from karma_fx.passes.capture import _friendly_errors
from karma_fx.passes.partition import make_partition_fn
from karma_fx.plan import Plan
from karma_fx.strategies import DEFAULT_STRATEGY
from karma_fx.strategies.base import leanest_peak

KNOWN_OPTIONS = {"budget", "strategy", "device"}


@dataclass
class Region:
    """One compiled region: its plan, emitted graphs and what it holds on the device across later regions."""

    key: str
    plan: Plan
    graphs: tuple[fx.GraphModule, fx.GraphModule]
    held_bytes: int
    problem: Any = field(repr=False)
    costs: Any = field(repr=False)

    @functools.cached_property
    def min_budget_bytes(self) -> int:
        """The smallest budget known to work for this region alone (``leanest_peak``)."""
        return leanest_peak(self.problem, self.costs)


@dataclass
class _Ledger:
    regions: dict[str, Region] = field(default_factory=dict)

    def held_by_others(self, key: str) -> int:
        return sum(r.held_bytes for k, r in self.regions.items() if k != key)


_ledgers: dict[int, tuple[dict, _Ledger]] = {}
"""Keyed by ``id`` of the options dict, which is held here too (a dict cannot be weakly referenced), so the
id is never reused for another call's options."""


def _ledger(options: dict) -> _Ledger:
    """The ledger of one ``torch.compile`` call, keyed by its options dict (Dynamo passes the same object to
    every region's backend call)."""
    entry = _ledgers.get(id(options))
    if entry is None or entry[0] is not options:
        entry = _ledgers[id(options)] = (options, _Ledger())
    return entry[1]


def regions(options: dict) -> list[Region]:
    """What the backend planned for the ``torch.compile`` call given ``options``, in compile order."""
    return list(_ledger(options).regions.values())


def mutated_inputs(gm: fx.GraphModule, example_inputs: list[Any]) -> set[int]:
    """Indices of the graph inputs the region updates in place (BatchNorm running stats, counters).

    Read from the graph signature of a functional export of the region (what ``torch.export`` uses): op
    schemas alone miss BatchNorm, whose ``native_batch_norm`` does not mark its running stats as written. A
    recompute must read a snapshot of such an input, never its updated value."""
    from torch._functorch.aot_autograd import aot_export_module

    _, signature = aot_export_module(gm, list(example_inputs), trace_joint=False)
    position = {name: i for i, name in enumerate(signature.user_inputs)}
    return {position[name] for name in signature.user_inputs_to_mutate.values()}


def _primal_kinds(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Kind and name of every primal AOTAutograd will make: the graph's own parameters and buffers (Dynamo
    without inlined modules), then its inputs: parameters, inputs updated in place (buffers), other inputs."""
    params, buffers = list(dict(gm.named_parameters())), list(dict(gm.named_buffers()))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    mutated = mutated_inputs(gm, example_inputs)
    kinds = ["param"] * len(params) + ["buffer"] * len(buffers)
    for i, t in enumerate(example_inputs):
        kinds.append("param" if isinstance(t, nn.Parameter) else "buffer" if i in mutated else "input")
    names = params + buffers + [placeholders[i] if i < len(placeholders) else f"input[{i}]"
                                for i in range(len(example_inputs))]
    return tuple(kinds), tuple(names)


def _check_static(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        symbolic = isinstance(value, torch.SymInt) or (
            isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape))
        if node.op == "placeholder" and symbolic:
            raise UnsupportedModelError(
                "torch.compile traced this region with dynamic shapes, but a karma plan is made for concrete "
                "sizes: pass dynamic=False to torch.compile, so that a new input shape recompiles and re-plans")


def karma_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None) -> Any:
    """The Dynamo backend behind ``backend="karma"``."""
    from torch._functorch.aot_autograd import aot_module_simplified

    if options is None or "budget" not in options:
        raise KarmaError('torch.compile(backend="karma") needs a budget: options={"budget": "12GiB"} '
                         '(bytes) or {"budget": 0.5} (a fraction of the unplanned peak)')
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise KarmaError(f"unknown karma backend options {sorted(unknown)}; known: {sorted(KNOWN_OPTIONS)}")
    budget = options["budget"]
    parse_budget(budget, unplanned_peak_bytes=1 << 62)  # reject malformed budgets before tracing
    strategy = options.get("strategy") or DEFAULT_STRATEGY
    device = get_device(options.get("device"))
    _check_static(gm, example_inputs)
    ledger = _ledger(options)
    key = gm.code  # the region's code identifies it across recompiles for other shapes

    def available(budget_bytes: int) -> int:
        if isinstance(budget, float) and budget <= 1.0:  # a fraction: of this region's peak plus the others
            return budget_bytes + int(budget * ledger.held_by_others(key)) - ledger.held_by_others(key)
        return budget_bytes - ledger.held_by_others(key)

    with _friendly_errors("reading the compiled region"):
        kinds, names = _primal_kinds(gm, example_inputs)
    result: dict[str, Any] = {}

    def context() -> str:
        held = ledger.held_by_others(key)
        if not held:
            return ""
        others = sum(1 for k in ledger.regions if k != key)
        return (f"; the {others} region(s) compiled before this one (graph breaks) hold "
                f"{format_bytes(held)} on the device while it runs, so the whole step needs a budget of at least "
                f"{format_bytes(held)} plus this region's minimum; raise the budget or remove the graph breaks")

    plan_fn = make_plan_fn(budget, strategy, device, result, available_bytes=available, context=context)

    def on_done(problem, plan, fw, bw):
        end_of_forward = result["timeline"].memory[problem.num_fwd_ops - 1][1]
        ledger.regions[key] = Region(key=key, plan=plan, graphs=(fw, bw), held_bytes=end_of_forward,
                                     problem=problem, costs=result["costs"])

    partition = make_partition_fn(plan_fn, kinds, names, on_done)

    def boxed(graph: fx.GraphModule, _: Any) -> Any:
        return boxed_graph(graph)

    with _friendly_errors("compiling the region"):
        return aot_module_simplified(gm, example_inputs, fw_compiler=boxed, bw_compiler=boxed,
                                     partition_fn=partition)
