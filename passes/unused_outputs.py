"""Outputs no backward differentiates, detached in the region's graph: no tangent, no backward branch for them.

A HuggingFace language model given ``labels`` returns its logits beside the loss, and ``loss.backward()`` gives
the logits no gradient. The compiled region's backward is one autograd node for all its outputs, so autograd
fills the logits' missing gradient with zeros of their size before calling it (``torch.autograd.Function``
materializes undefined gradients), and AOTAutograd's backward then runs the logits' branch on those zeros: on
GPT-2 at 8x1024 in bf16 a 785 MiB tensor of zeros and two matmuls over the vocabulary, every step, for nothing
(``torch.compile`` does the same; eager autograd skips the branch). With the output detached inside the region,
AOTAutograd traces no tangent for it and the joint graph has no branch to run; the tensor itself is still
returned, computed as before. ``karma_fx.unused_grads`` decides which outputs, from what the backward received.

Example::

    gm2 = detach_outputs(gm, (1,))   # a copy of gm whose second output is returned detached
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

__all__ = ["detach_outputs"]


def detach_outputs(gm: fx.GraphModule, positions: tuple[int, ...]) -> fx.GraphModule:
    """A copy of the (Dynamo) region graph ``gm`` whose outputs at ``positions`` are returned detached: the same
    values, none of them requiring grad. ``gm`` is not modified."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    flat = output.args[0]
    single = isinstance(flat, fx.Node)
    outs = [flat] if single else list(flat)
    for k in positions:
        node = outs[k]
        if not isinstance(node, fx.Node):
            raise ValueError(f"output {k} of the region is not a graph value: it cannot be detached")
        with graph.inserting_before(output):
            outs[k] = graph.call_function(torch.Tensor.detach, (node,))
    output.args = (outs[0] if single else type(flat)(outs),)
    graph.lint()
    return fx.GraphModule(gm, graph)
