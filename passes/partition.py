"""Partition: plan the captured joint graph, rewrite it, and split it into forward and backward graphs.

This is the ``partition_fn`` handed to AOTAutograd, the seam where ``torch.compile`` (and
``karma_fx.compile``) give us the joint graph. The forward keeps what the forward outputs need plus the
offload copies; everything the backward reads from the forward is saved, exactly as AOTAutograd's default
partitioner does, but after the rewrite the backward reads host copies and recomputed values instead.
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from karma_fx.passes.capture import CapturedStep
from karma_fx.passes.liveness import _forward_nodes, build_problem
from karma_fx.passes.dropout import split_dropout
from karma_fx.passes.narrowing import narrow_saved, narrowed
from karma_fx.passes.rewrite import rewrite_joint
from karma_fx.plan import Plan
from karma_fx.problem import Problem

PlanFn = Callable[[Problem, CapturedStep], Plan]


def make_partition_fn(plan_fn: PlanFn, primal_kinds: tuple, primal_names: tuple,
                      on_done: Callable[[Problem, Plan, fx.GraphModule, fx.GraphModule], None],
                      save_params: bool = False, keep_all: Callable | None = None,
                      keep_all_excess: Callable | None = None, dropout_backward: bool = True) -> Callable:
    """A ``partition_fn`` that plans with ``plan_fn`` and reports the result to ``on_done``.
    ``keep_all``: the partitioner of a plan that moves nothing, given the graph as captured (Inductor's min-cut
    partitioner under ``compiler="inductor"``, so that such a step is exactly ``torch.compile``'s); by default
    PyTorch's default partitioner, as ``aot_eager`` uses, on the graph planned (its dropouts split).
    ``keep_all_excess``: what ``keep_all`` holds above the partition planned, as
    ``keep_all_excess(joint, joint_inputs, num_fwd_outputs=..., **options)`` on a joint graph it must not edit;
    handed to ``plan_fn`` as ``step.keep_all_excess``, to call where it prices the step.
    ``save_params``: route each parameter's gradient through a ``hand_over`` marker that also reads the
    parameter (``hand_over_gradients``), so that the gradient pipeline learns which parameter a gradient belongs
    to; saving a parameter for the backward costs no memory, it lives all step anyway.
    ``dropout_backward``: see ``split_dropout``'s ``backward`` (off for graphs that Inductor compiles)."""

    def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **options: Any):
        # Planned on the graph with each dropout split into mask and multiply (what plan() captures), so a
        # dropout output can be rebuilt; under Inductor a plan that moves nothing partitions the graph as
        # captured (``keep_all``).
        step = CapturedStep(joint=narrow_saved(split_dropout(joint, dropout_backward), num_fwd_outputs),
                            primal_kinds=primal_kinds,
                            primal_names=primal_names, num_fwd_outputs=num_fwd_outputs, output_names=(),
                            joint_inputs=joint_inputs)
        if keep_all_excess is not None:
            step.keep_all_excess = functools.partial(keep_all_excess, joint, joint_inputs,
                                                     num_fwd_outputs=num_fwd_outputs, **options)
        problem = build_problem(step)
        plan = plan_fn(problem, step)
        moves = bool(plan.decisions or plan.splits)
        # A narrowed graph (``narrow_saved``) is split as planned; under Inductor a plan that moves nothing still
        # runs the step as written, whose min-cut partition finds such cuts itself.
        if moves or save_params or (keep_all is None and narrowed(step.joint)):
            rewritten, offload_names = rewrite_joint(step, problem, plan) if moves else (step.joint, set())
            if save_params:
                hand_over_gradients(rewritten, primal_kinds, num_fwd_outputs)
            fw, bw = split(rewritten, num_fwd_outputs, offload_names)
        elif keep_all is not None:  # nothing moves: exactly the graphs that partitioner emits (no karma ops)
            fw, bw = keep_all(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **options)
        else:  # nothing moves: PyTorch's default partition of the graph planned, whose dropouts are split, so
            # that the step allocates what the plan counts (ATen's CPU dropout backward has a scratch the
            # planned graph's lacks)
            from torch._functorch.partitioners import default_partition

            fw, bw = default_partition(step.joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **options)
        on_done(problem, plan, fw, bw)
        return fw, bw

    return partition


def hand_over(grad: Any, param: Any, *read_before: Any) -> Any:
    """A marker in the joint graph: ``grad`` of ``param`` is final here, and neither is read any more.
    ``read_before``: the backward's results computed from the parameter, which the call must follow
    (``hand_over_gradients``). Returns ``grad``; the backward compiler turns each marker into a call to the
    gradient pipeline."""
    return grad


def hand_over_gradients(joint: fx.GraphModule, primal_kinds: tuple, num_fwd_outputs: int) -> None:
    """Route each parameter's gradient through a ``hand_over(grad, param, *read_before)`` node placed after
    the gradient is made, after its own last read, and after the parameter's last read (each directly or
    through a view), in place. The parameter thereby reaches the backward graph, so the pipeline learns which
    parameter a gradient belongs to even when one compiled region runs for several layers, each with its own
    weights.

    Graph order is not enough under Inductor, which computes a pointwise result inside the kernel that reads
    it, wherever that kernel runs: a ``grad * weight`` placed before the hand-over could read the weight after
    the host optimizer's worker updated it. The backward's results computed from the parameter are therefore
    inputs of the hand-over (``read_before``), which Inductor computes before the call (the op-by-op compiler
    drops them: it runs the graph in order). And a gradient the
    backward still reads (a bias added to a tensor of its own shape: its gradient is also the gradient that
    flows on) would be handed over while Inductor may still write a later result into its buffer."""
    from karma_fx.passes.liveness import storage_key

    graph = joint.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    primals = [n for n in nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    output = next(n for n in nodes if n.op == "output")
    outs = list(output.args[0])
    readers: dict[Any, list[fx.Node]] = {}
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            readers.setdefault(storage_key(val), []).extend(u for u in node.users if u.op != "output")
    # what the split puts in the forward graph; everything else of the joint graph runs in the backward
    # (recomputes too, which read no tangent)
    forward = _forward_nodes(CapturedStep(joint=joint, primal_kinds=(), primal_names=(),
                                          num_fwd_outputs=num_fwd_outputs, output_names=()))
    changed = False
    for slot, kind in enumerate(primal_kinds):
        at = num_fwd_outputs + slot
        if kind != "param" or slot >= len(primals) or at >= len(outs) or not isinstance(outs[at], fx.Node):
            continue
        param, grad = primals[slot], outs[at]
        val = param.meta.get("val")
        later = readers.get(storage_key(val), []) if isinstance(val, torch.Tensor) else list(param.users)
        grad_val = grad.meta.get("val")
        grad_readers = readers.get(storage_key(grad_val), []) if isinstance(grad_val, torch.Tensor) else []
        anchor = max([grad] + [r for r in [*later, *grad_readers] if r in position], key=position.__getitem__)
        key = storage_key(val) if isinstance(val, torch.Tensor) else None
        read_before = sorted({r for r in later if r not in forward and _result_of_its_own(r, key)},
                             key=position.__getitem__)
        with graph.inserting_after(anchor):
            marker = graph.call_function(hand_over, (grad, param, *read_before))
        marker.meta = {k: v for k, v in grad.meta.items() if k in ("val", "tensor_meta")}
        marker.meta["partitioner_tag"] = "is_backward"
        outs[at] = marker
        changed = True
    if changed:
        output.args = (type(output.args[0])(outs),)
        graph.lint()
        joint.recompile()


def _result_of_its_own(node: fx.Node, key: Any) -> bool:
    """Whether ``node`` makes one tensor that is not a view of storage ``key``: a result computed from the
    parameter (pointwise ops, casts, gathers, concatenations are all computed inside their readers' kernels
    by Inductor), not another name for it."""
    from karma_fx.passes.liveness import storage_key

    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and storage_key(val) != key


def split(joint: fx.GraphModule, num_fwd_outputs: int, forced_forward: set[str]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward modules of a (rewritten) joint graph; ``forced_forward`` nodes run in the forward."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    step = CapturedStep(joint=joint, primal_kinds=(), primal_names=(), num_fwd_outputs=num_fwd_outputs,
                        output_names=())
    forward = _forward_nodes(step) | {n for n in joint.graph.nodes if n.name in forced_forward}
    saved: list[fx.Node] = []
    for node in joint.graph.nodes:
        is_primal = node.op == "placeholder" and not node.name.startswith("tangents")
        if not (is_primal or node in forward):
            continue
        if node.op == "call_function" and node.users and all(u.target is operator.getitem for u in node.users):
            continue  # a tuple: its getitems are saved instead
        if any(u not in forward and u.op != "output" for u in node.users):
            saved.append(node)
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if "ignore_must_be_in_fw_bw" in inspect.signature(_extract_fwd_bwd_modules).parameters:
        kwargs["ignore_must_be_in_fw_bw"] = True
    return _extract_fwd_bwd_modules(joint, saved, [], **kwargs)
