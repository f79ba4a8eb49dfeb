"""``compiler="inductor"``: the planned forward and backward graphs compiled by Inductor.

The region goes through ``torch._inductor.compile_fx.compile_fx``, Inductor's own front door, so that
decompositions, joint-graph passes, post-grad passes and code generation are exactly what
``torch.compile(backend="inductor")`` does; only the partitioner is ours (Inductor's ``custom_partitioner_fn``
hook): it plans the decomposed joint graph, rewrites it with the ``karma`` ops and splits it. A plan that
moves nothing hands the joint graph to Inductor's min-cut partitioner, so such a step is Inductor's step.

The ``karma`` ops are custom ops with fake kernels; Inductor runs them as fallback (extern) kernels, in graph
order. Three of Inductor's scheduling passes could undo the plan and are switched off for our compiles only
(``PLAN_SAFE_CONFIG``): ``reorder_for_peak_memory`` reorders nodes by its own memory estimate (it would move
prefetches and recomputes away from the ops the plan anchors them to), ``reorder_for_compute_comm_overlap``
moves collectives and waits, ``reorder_for_locality`` moves producers next to their consumers. What stays
is fusion: a fused kernel runs where the earliest of its members ran, after all its inputs, which pulls the
later member's inputs, extern kernels included, ahead of it; for a planned graph ``PlanOrder`` refuses a
fusion across an extern kernel, so a copy, a wait or a matmul keeps its place among the ops the plan put
around it. No CSE runs after our partitioner (AOT's
joint-graph CSE runs before it, on the unplanned graph), so a recomputed op in the backward stays a
separate, short-lived buffer.

Switching ``reorder_for_peak_memory`` off has a side effect this module undoes (``ReuseGuard``). Inductor's
wrapper hands a freed buffer to a later allocation of the same size instead of freeing it (``buf13 = buf2;
del buf2  # reuse``), which keeps the freed buffer alive until that later allocation. It does so only where
its own estimate of the graph's memory says the graph's peak does not grow, but that estimate reads sizes
and readers the scheduler computes only inside the peak-memory pass: with the pass off only the graph's
inputs count, and reuses that raise the peak are taken. The plan frees each tensor after its last reader, so
each such reuse is memory the plan never counted: on a two-layer GPT (``bench/inductor_overhead.py``) one 0.5 MiB
gradient held across a 2 MiB matmul put the measured peak 2.4% above the plan and over the budget.
``ReuseGuard`` computes that information after fusion, on the final node order, so the reuse guard works
as it does under ``torch.compile(backend="inductor")``: a reuse never raises the graph's peak *as Inductor
estimates it*. That estimate is not the plan's timeline (it counts a kernel's in-place output as a second
buffer, so its peak can sit well above the real one and leave room for held buffers elsewhere), which is
enough for a step that moves nothing (it peaks at the plan: the bench above) but not for a planned one: the
graphs of a plan that moves tensors are compiled with buffer reuse off (``PLANNED_CONFIG``).

Example::

    fn = compile_region(gm, fake_args, partition, on_backward=session.saw_backward)
"""
from __future__ import annotations

import bisect
import copy
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import karma_fx.runtime  # noqa: F401 - registers torch.ops.karma before Inductor meets them

__all__ = ["COPY_SAFE_CONFIG", "PLAN_SAFE_CONFIG", "PLANNED_CONFIG", "PlanOrder", "ReuseGuard",
           "compile_region", "min_cut_partition", "reuse_guard_patches"]

PLAN_SAFE_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_locality": False,
}
"""Inductor settings patched for a karma compile (and only for it): no pass may reorder the planned graphs."""


class ReuseGuard:
    """Inductor post-fusion scheduler pass: fill in the memory-planning information (each buffer's size and
    readers) that Inductor's wrapper needs to refuse a buffer reuse that would raise the graph's peak. Inductor
    computes it inside ``reorder_for_peak_memory``, which karma switches off (``PLAN_SAFE_CONFIG``); without it
    the wrapper sees every buffer as 0 bytes and reuses freely, holding freed buffers across later, larger
    allocations that the plan does not count (see the module docstring). The node order is not changed.

    ``previous``: a post-fusion pass already configured (run first, then the information is computed on the
    nodes it returns)."""

    VERSION = "karma_fx.inductor.ReuseGuard:1"

    def __init__(self, previous: Callable[[list], list] | None = None) -> None:
        self.previous = previous

    def __call__(self, nodes: list) -> list:
        from torch._inductor.memory import assign_memory_planning_info_for_scheduler_buffers
        from torch._inductor.virtualized import V

        if self.previous is not None:
            nodes = self.previous(nodes)
        assign_memory_planning_info_for_scheduler_buffers(nodes, V.graph.scheduler.name_to_buf)
        return nodes


def reuse_guard_patches() -> dict[str, Any]:
    """The Inductor settings that keep buffer reuse from raising a karma graph's peak (``ReuseGuard``), for
    the torch at hand: the guard as a post-fusion pass, chained after any pass already set. It is a
    ``CustomSchedulerPass`` with a fixed ``uuid`` unless a plain callable was set before it, so that it never
    makes Inductor's FX graph cache bypass a graph the cache would otherwise take, nor lets a cached graph
    compiled without it be reused (karma's compiles, traced without a shape environment, bypass that cache
    today anyway); a plain callable already set bypasses the cache, as it did. A torch without
    the hook or the guard gets ``allow_buffer_reuse=False``: every buffer is freed after its last reader,
    exactly as the plan counts it (the cost is an allocator call per buffer)."""
    from torch._inductor import config

    try:
        from torch._inductor.codegen.wrapper import EfficientPeakEstimate  # noqa: F401
        from torch._inductor.custom_graph_pass import CustomSchedulerPass
        from torch._inductor.memory import assign_memory_planning_info_for_scheduler_buffers  # noqa: F401
    except ImportError:
        return {"allow_buffer_reuse": False}
    if not hasattr(config, "_post_fusion_custom_pass"):
        return {"allow_buffer_reuse": False}
    previous = config._post_fusion_custom_pass
    if previous is not None and not isinstance(previous, CustomSchedulerPass):
        return {"_post_fusion_custom_pass": ReuseGuard(previous)}

    class CachedReuseGuard(ReuseGuard, CustomSchedulerPass):
        def uuid(self) -> Any:
            return (self.VERSION, None if self.previous is None else self.previous.uuid())

    return {"_post_fusion_custom_pass": CachedReuseGuard(previous)}


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, **options: Any) -> tuple[fx.GraphModule,
                                                                                         fx.GraphModule]:
    """The partition of a plan that moves nothing: Inductor's own (min-cut, as ``torch.compile(backend=
    "inductor")`` calls it, so such a step is exactly Inductor's) where it peaks no higher than the partition
    the plan counted, else that one (PyTorch's default partition: every forward value the backward reads is
    saved).

    The plan, and the unplanned peak a fractional budget is a fraction of, count the default partition; the
    min-cut partitioner picks what to save by bytes saved, not by peak, and recomputes in the backward what it
    did not save. Usually that peaks lower; where it peaks higher (a two-layer GPT: it saves both embeddings,
    0.5 MiB + 64 KiB, to rebuild their 0.5 MiB sum in the backward, and peaks 52 KB higher), the step would
    run above the plan and, at ``budget=1.0``, above the budget. Both are compared on Inductor's memory model
    (``karma_fx.fusion.partition_peak_bytes``); if that cannot be built, the min-cut partition is kept."""
    import logging

    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    from karma_fx.fusion import partition_peak_bytes

    num_fwd_outputs = options["num_fwd_outputs"]
    counted = None
    try:  # before min-cut, which replaces the joint's graph by its CSE'd copy
        counted = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                    static_lifetime_input_indices=options.get("static_lifetime_input_indices"))
    except Exception:  # pragma: no cover - keep Inductor's partition rather than fail the compile
        logging.getLogger("karma_fx").debug("default partition failed; keeping min-cut", exc_info=True)
    options.setdefault("compiler", "inductor")
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **options)
    if counted is None:
        return fw, bw
    try:
        if partition_peak_bytes(fw, bw, num_fwd_outputs) > partition_peak_bytes(*counted, num_fwd_outputs):
            return counted
    except Exception:  # pragma: no cover - same
        logging.getLogger("karma_fx").debug("partition peaks not comparable; keeping min-cut", exc_info=True)
    return fw, bw


def _partitioner(partition: Callable) -> Any:
    """``partition`` as the ``CustomPartitionerFn`` Inductor's config takes. Its ``uuid`` is ``None``: the plan
    depends on the budget and on what the step's other regions hold, which no cache key of Inductor's sees,
    so AOTAutograd's cache must never hand back another plan's graphs (Inductor's per-graph code cache,
    keyed by the rewritten graphs themselves, still works)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class KarmaPartitioner(CustomPartitionerFn):
        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                     ) -> tuple[fx.GraphModule, fx.GraphModule]:
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> None:
            return None

    return KarmaPartitioner()


def _announcing(code: Any, on_call: Callable[[], None]) -> Callable:
    """A boxed callable running Inductor's compiled ``code`` after ``on_call`` (the session learns that the
    step's backward began)."""

    def run(args: list) -> Any:
        on_call()
        return code(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class PlanOrder:
    """Inductor's fusion choices (the handler it had, ``inner``) with one rule more, for a planned graph: two
    kernels never fuse across an extern kernel (a matmul, an attention, a ``karma`` op) that runs between
    them. A fused kernel runs where its earliest member ran, so Inductor pulls the later member's inputs
    ahead of it, extern kernels included: a recomputed softmax fused with the softmax backward it serves put
    the backward's S×S matmul before the recompute's, and a cpsat step (4-layer GPT with dropout, 0.6 of the
    peak) peaked 3.8% above its plan, past the budget; with the rule, +0.2%, and -4.5% once offloaded values
    kept their traced layout (``passes/rewrite.py``; ``bench/inductor_overhead.py``).
    It also bounds each kernel by a run of loop ops, as ``karma_fx.fusion.outputs_held_through_runs`` counts
    it. Every other choice is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._anchors: "weakref.WeakKeyDictionary[Any, list[int]]" = weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if self.crosses_extern(scheduler, node1, node2):
            return False
        return self._inner.can_fuse(scheduler, node1, node2, shared_data_score)

    def crosses_extern(self, scheduler: Any, node1: Any, node2: Any) -> bool:
        """Whether an extern kernel's place in the scheduler's original order lies strictly between the
        earliest and the latest of the two nodes' members (extern kernels never fuse, so their places stay)."""
        anchors = self._anchors.get(scheduler)
        if anchors is None:  # once per graph: this is asked for every candidate pair of a fusion round
            from torch._inductor.scheduler import ExternKernelSchedulerNode

            anchors = sorted(n.min_order for n in scheduler.nodes if isinstance(n, ExternKernelSchedulerNode))
            self._anchors[scheduler] = anchors
        low = min(node1.min_order, node2.min_order)
        high = max(node1.max_order, node2.max_order)
        i = bisect.bisect_right(anchors, low)
        return i < len(anchors) and anchors[i] < high


PLANNED_CONFIG: dict[str, Any] = {"allow_buffer_reuse": False}
"""Inductor settings for the graphs of a plan that moves tensors. The plan frees each tensor after its last
reader; Inductor's buffer reuse instead holds a freed buffer until a later allocation of the same size takes
it, wherever its own estimate of the graph's peak allows, and that estimate is not the plan's: on a 4-layer
d=512 GPT (``bench/inductor_overhead.py``) a checkpoint plan's backward held one 8 MiB buffer per layer and
the step peaked 9.8% above the plan (cpsat at 0.75 of the peak: 8.8%, over the budget); with reuse off both
peak at the plan (-0.7%, +0.0%). A plan that moves nothing keeps Inductor's reuse, guarded by ``ReuseGuard``,
so that its step stays exactly Inductor's. The cost: an allocator call per buffer (that checkpoint step
took 1.6% longer on a CPU, within its run-to-run spread)."""

COPY_SAFE_CONFIG: dict[str, Any] = {"allow_buffer_reuse": False, "inplace_buffers": False}
"""Inductor settings for a graph that swaps tensors out. ``karma.offload`` returns as soon as its copy is
queued; the copy reads the source afterwards (a CUDA side stream, or a CPU copy worker). Inductor only knows
the extern call returned, so it may hand the source's buffer to a later kernel (``buf9 = buf2  # reuse``) or let
the source's last reader write its result in place: either overwrites the tensor while it is being copied, and
the backward then reads garbage (measured: a 2-layer GPT with copies 3 ms late had gradients off by 300%). With
both off, every buffer is freed after its last reader, and a source being copied stays allocated until compute
has waited for its copy (``karma_fx.runtime`` holds it), as the plan counts it."""


def _offloads(graph: fx.GraphModule) -> bool:
    return any(node.target is torch.ops.karma.offload.default for node in graph.graph.nodes)


def compile_region(gm: fx.GraphModule, example_inputs: list[Any], partition: Callable,
                   on_backward: Callable[[], None], moves: Callable[[], bool] = lambda: False) -> Callable:
    """Compile one Dynamo region with Inductor, partitioned (planned and rewritten) by ``partition``.

    ``example_inputs`` are fake tensors (inside a ``TracingContext`` of their fake mode, as at Dynamo's compile
    time). ``gm`` is left untouched (Inductor's pre-grad passes edit the graph they get, and a region is
    compiled once per plan it needs). ``moves``: whether the plan ``partition`` chose moves tensors (asked
    when each graph is compiled, after the partition: its graphs then get ``PLANNED_CONFIG``). Returns the
    callable Dynamo's cached code runs."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        import contextlib

        from torch._inductor.virtualized import V

        planned = moves()
        settings = {**(PLANNED_CONFIG if planned else {}), **(COPY_SAFE_CONFIG if _offloads(graph) else {})}
        order = V.set_choices_handler(PlanOrder(V.choices)) if planned else contextlib.nullcontext()
        with torch._inductor.config.patch(settings), order:
            code = compile_fx_inner(graph, inputs, **kwargs)
        return _announcing(code, on_backward) if kwargs.get("is_backward") else code

    patches = {**PLAN_SAFE_CONFIG, **reuse_guard_patches(), "custom_partitioner_fn": _partitioner(partition)}
    return compile_fx(_own_copy(gm), example_inputs, inner_compile=inner, config_patches=patches)


def _own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo region with a graph of its own, keeping what AOTAutograd reads to know it came from
    Dynamo (where each input comes from, so that parameters are static inputs: without it the partitioner
    saves other tensors and the step is no longer exactly Inductor's)."""
    own = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    own.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        own._param_name_to_source = gm._param_name_to_source  # type: ignore[assignment]
    for mine, theirs in zip(own.graph.nodes, gm.graph.nodes):
        if hasattr(theirs, "_dynamo_source"):
            mine._dynamo_source = theirs._dynamo_source  # type: ignore[attr-defined]
    return own
