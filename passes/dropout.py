"""Split each training-mode ``native_dropout`` of a joint graph into a random mask and a deterministic
multiply (``karma_fx.dropout_ops``), so that the planner can rebuild a dropout output from its input and its
1-byte mask instead of keeping it.

The split graph computes what the original computes, bit for bit on a CPU, and draws the same masks. The
backward of a split dropout, ``native_dropout_backward(grad, mask, scale)``, becomes ``karma.dropout_backward``,
the same product without the scratch ATen's CPU kernel allocates (``karma_fx.dropout_ops`` says why).

Example::

    split = split_dropout(joint)       # a new GraphModule (or ``joint`` itself when it has no dropout)
"""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

import karma_fx.dropout_ops  # noqa: F401 - registers torch.ops.karma.dropout_mask, masked_scale, ...


def _splittable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.native_dropout.default:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    unpacked = all(u.target is operator.getitem for u in node.users)
    return isinstance(p, (int, float)) and 0 < p < 1 and train is not False and unpacked


def split_dropout(joint: fx.GraphModule, backward: bool = True) -> fx.GraphModule:
    """A copy of ``joint`` with every training-mode dropout split in two (``joint`` itself if there is none).
    ``backward``: also make each split dropout's backward ``karma.dropout_backward``; not for a graph that
    Inductor compiles, which fuses ``native_dropout_backward`` into its neighbours (a custom op it cannot)."""
    if not any(_splittable(n) for n in joint.graph.nodes):
        return joint
    # A new graph over the same module: a deep copy would copy the module's (fake) tensor constants.
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(joint.graph._codegen)
    graph.output(graph.graph_copy(joint.graph, {}), type_expr=None)
    joint = fx.GraphModule(joint, graph)
    for node in list(graph.nodes):
        if not _splittable(node):
            continue
        x, p = node.args[0], float(node.args[1])
        items = {u.args[1]: u for u in node.users}
        val_out, val_mask = node.meta["val"]
        with graph.inserting_before(node):
            mask = graph.call_function(torch.ops.karma.dropout_mask.default, (x, p))
            out = graph.call_function(torch.ops.karma.masked_scale.default, (x, mask, 1.0 / (1.0 - p)))
        for new, val in ((mask, val_mask), (out, val_out)):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta["val"] = val
        for index, new in ((0, out), (1, mask)):
            if index in items:
                items[index].replace_all_uses_with(new)
                graph.erase_node(items[index])
        graph.erase_node(node)
    for node in list(graph.nodes) if backward else ():
        if (node.op == "call_function" and node.target is torch.ops.aten.native_dropout_backward.default
                and len(node.args) == 3 and not node.kwargs
                and getattr(node.args[1], "target", None) is torch.ops.karma.dropout_mask.default):
            with graph.inserting_before(node):
                grad = graph.call_function(torch.ops.karma.dropout_backward.default, node.args)
            grad.meta.update(node.meta)
            node.replace_all_uses_with(grad)
            graph.erase_node(node)
    graph.lint()
    joint.recompile()
    return joint
