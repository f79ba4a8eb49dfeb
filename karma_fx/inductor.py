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
is fusion: a fused kernel runs where the earliest of its members ran, after all its inputs, so a copy or a
wait keeps its place among the ops that read or make its tensors. No CSE runs after our partitioner (AOT's
joint-graph CSE runs before it, on the unplanned graph), so a recomputed op in the backward stays a
separate, short-lived buffer.

Example::

    fn = compile_region(gm, fake_args, partition, on_backward=session.saw_backward)
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import karma_fx.runtime  # noqa: F401 - registers torch.ops.karma before Inductor meets them

__all__ = ["PLAN_SAFE_CONFIG", "compile_region", "min_cut_partition"]

PLAN_SAFE_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_locality": False,
}
"""Inductor settings patched for a karma compile (and only for it): no pass may reorder the planned graphs."""


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, **options: Any) -> tuple[fx.GraphModule,
                                                                                         fx.GraphModule]:
    """Inductor's own partitioner, as ``torch.compile(backend="inductor")`` calls it (a plan that moves nothing
    gives exactly Inductor's graphs)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    options.setdefault("compiler", "inductor")
    return min_cut_rematerialization_partition(joint, joint_inputs, **options)


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


def compile_region(gm: fx.GraphModule, example_inputs: list[Any], partition: Callable,
                   on_backward: Callable[[], None]) -> Callable:
    """Compile one Dynamo region with Inductor, partitioned (planned and rewritten) by ``partition``.

    ``example_inputs`` are fake tensors (inside a ``TracingContext`` of their fake mode, as at Dynamo's compile
    time). ``gm`` is left untouched (Inductor's pre-grad passes edit the graph they get, and a region is
    compiled once per plan it needs). Returns the callable Dynamo's cached code runs."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        code = compile_fx_inner(graph, inputs, **kwargs)
        return _announcing(code, on_backward) if kwargs.get("is_backward") else code

    patches = {**PLAN_SAFE_CONFIG, "custom_partitioner_fn": _partitioner(partition)}
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
