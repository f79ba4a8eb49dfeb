"""Gradient hooks: the backward graph hands each parameter's gradient to the gradient pipeline
(``karma_fx.exchange``) as soon as it is final, instead of returning it.

The partition (``karma_fx.passes.partition.hand_over_gradients``) marks each parameter's gradient with a
``hand_over(grad, param)`` node placed after the parameter's last read; once the backward graph is emitted,
``insert_gradient_hooks`` turns every marker into a call of the operator ``karma::gradient_ready`` (which
Inductor compiles as an extern kernel; ``karma_fx.exchange.gradient_ready`` behind it) and drops those
gradients from the graph's outputs, so the pipeline, not autograd, owns them.

Example::

    dropped = insert_gradient_hooks(backward_graph, pipeline)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from karma_fx.exchange import GradientPipeline
from karma_fx.passes.partition import hand_over

__all__ = ["insert_gradient_hooks"]


def insert_gradient_hooks(bw: fx.GraphModule, pipeline: GradientPipeline, order_reads: bool = True) -> list[int]:
    """Turn each ``hand_over(grad, param, *read_before)`` marker of an emitted backward graph (see
    ``karma_fx.passes.partition.hand_over_gradients``) into a ``gradient_ready`` call, in place, and drop those
    gradients from the graph's outputs: the pipeline consumes them. ``order_reads``: keep the results computed
    from the parameter as inputs of the call (for Inductor, which would otherwise compute them later; a graph
    run op by op runs in order, and they would only live longer). Returns the output positions dropped."""
    graph = bw.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    consumed = []
    for i, o in enumerate(outs):
        if isinstance(o, fx.Node) and o.target is hand_over:
            grad, param, *read_before = o.args
            o.target, o.args = torch.ops.karma.gradient_ready.default, (
                grad, param, pipeline.id, read_before if order_reads else [])
            o.meta.pop("val", None)  # it returns nothing
            o.meta.pop("tensor_meta", None)
            outs[i] = None
            consumed.append(i)
    output.args = (tuple(outs),)
    graph.lint()
    bw.recompile()
    return consumed
