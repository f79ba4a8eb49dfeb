"""Save a narrower value: where the backward reads a saved tensor only through pointwise ops that need nothing
from the backward, run those ops in the forward and save their results instead.

A ReLU in front of a max pooling is the common case. Its output is read by the backward only to make the mask
``relu <= 0`` (``threshold_backward``, decomposed): AOTAutograd's default partition saves the ReLU's output, 4
bytes an element in fp32, where the 1-byte mask is all the backward needs. PyTorch's min-cut partitioner finds
that cut (``torch.compile``'s step saves the masks), so the partition karma planned held more than the step as
written: on VGG-16 in bf16-mixed (batch 128, 224 px, H100 preset) karma's partition with nothing moved was
predicted at 5.16 GiB against min-cut's 4.87 GiB; narrowed, at 4.78 GiB. Offload and recompute cannot express
this cut; moving the ops can, and it is never worse for memory: the saved tensor's readers in the backward are
gone, so it dies in the forward, and each result is smaller than it.

The same ops run on the same inputs, earlier. Op by op the results are bit-identical; under Inductor a moved op
may be computed inside the kernel that makes its input, from the value before it is stored, which in bf16 is
before its rounding (a review found 2% gradient differences on `(x * 3).clamp(min=0.5)` in bf16): that is
``torch.compile``'s own step, whose min-cut partition makes the same cut. Only whole sets move, and only where
the tensor's storage then dies in the forward: not where the backward also reads it elsewhere or through a view
(a ReLU between two linears on a 3-D batch), nor where it is a weight's or an input's, nor where the step returns
it; saving a mask beside it would only add.

Example::

    joint = narrow_saved(joint, num_fwd_outputs)   # a copy with the moved nodes tagged, or ``joint`` itself
"""
from __future__ import annotations

import torch
import torch.fx as fx

from karma_fx.passes.capture import CapturedStep, copy_graph
from karma_fx.passes.fusible import is_pointwise, is_view
from karma_fx.passes.liveness import _forward_nodes, storage_key

NARROWED = "narrowed"
"""The ``meta["karma"]`` key of a node this pass moved into the forward."""


def narrow_saved(joint: fx.GraphModule, num_fwd_outputs: int) -> fx.GraphModule:
    """A copy of ``joint`` with every set of backward pointwise ops moved into the forward that is the only
    backward reader of a forward tensor, reads only forward values and primals, and makes fewer bytes than that
    tensor (``joint`` itself where there is none: callers price the graph as captured too). Each moved node is
    placed right after the last node it reads and tagged ``partitioner_tag="is_forward"`` (with
    ``meta["karma"]``), which the liveness and the split read as forward."""
    sets = _narrowing_sets(joint, num_fwd_outputs)
    if not sets:
        return joint
    saved_by = {name: saved for saved, readers in sets for name in readers}
    copied = _moved_after_inputs(joint, list(saved_by))
    for node in copied.graph.nodes:
        if node.name in saved_by:
            node.meta["partitioner_tag"] = "is_forward"
            node.meta["karma"] = {NARROWED: saved_by[node.name]}
    return copied


def narrowed(joint: fx.GraphModule) -> bool:
    """Whether ``narrow_saved`` moved anything in ``joint``."""
    return any(NARROWED in n.meta.get("karma", {}) for n in joint.graph.nodes)


def _narrowing_sets(joint: fx.GraphModule, num_fwd_outputs: int) -> list[tuple[str, list[str]]]:
    """(saved tensor, the backward readers to move, in graph order) for each tensor ``narrow_saved`` narrows."""
    graph = joint.graph
    step = CapturedStep(joint=joint, primal_kinds=(), primal_names=(), num_fwd_outputs=num_fwd_outputs,
                        output_names=())
    forward = _forward_nodes(step)
    primals = {n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
    known = forward | primals
    order = {n: i for i, n in enumerate(graph.nodes)}
    output = next(n for n in graph.nodes if n.op == "output")
    returned = {a for a in output.args[0] if isinstance(a, fx.Node)}  # the step's outputs and its gradients
    aliases: dict[object, list[fx.Node]] = {}
    for n in known:
        if _is_tensor(n):
            aliases.setdefault(storage_key(n.meta["val"]), []).append(n)
    sets = []
    for node in graph.nodes:
        if node not in forward or node.op != "call_function" or not _is_tensor(node):
            continue
        readers = [u for u in node.users if u not in forward and u.op != "output"]
        if not readers or not all(_movable(u, known) for u in readers):
            continue
        if _stays_anyway(node, aliases[storage_key(node.meta["val"])], forward, returned):
            continue
        if sum(_bytes(u) for u in readers) >= _bytes(node):
            continue
        readers.sort(key=order.__getitem__)
        sets.append((node.name, [u.name for u in readers]))
        forward.update(readers)
        known.update(readers)
        for u in readers:  # moved into the forward, a reader may be narrowed in turn: its own storage
            aliases.setdefault(storage_key(u.meta["val"]), []).append(u)
    return sets


def _stays_anyway(node: fx.Node, same_storage: list[fx.Node], forward: set[fx.Node], returned: set[fx.Node]) -> bool:
    """Whether ``node``'s storage outlives the forward whatever its own readers do: it is an input's or a
    weight's, the step returns it (or a view of it), or the backward reads it through another name (a view made
    in the forward, as a ReLU between two linears on a 3-D batch is read as its 2-D view). A mask saved beside
    it would only add its bytes."""
    for alias in same_storage:
        if alias.op == "placeholder" or alias in returned:
            return True
        if alias is not node and any(u not in forward and u.op != "output" for u in alias.users):
            return True
    return False


def _movable(node: fx.Node, known: set[fx.Node]) -> bool:
    """A pointwise op of one tensor result that reads only what the forward has, and draws no random numbers
    (moved into the forward, a random op such as ``rrelu`` would draw them in another order)."""
    target = node.target
    return (node.op == "call_function" and is_pointwise(target)
            and torch.Tag.nondeterministic_seeded not in target.tags
            and _is_tensor(node)
            and bool(node.all_input_nodes) and all(a in known for a in node.all_input_nodes))


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _bytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def saved_where_computable(fw: fx.GraphModule) -> fx.GraphModule:
    """A copy of a partitioned forward graph with each pointwise node that the forward only saves moved to just
    after the last node it reads (``fw`` itself where none moves). PyTorch's min-cut partition leaves such nodes
    (a ReLU's mask, which it saves instead of the ReLU) at the forward's end; Inductor fuses each into the kernel
    that reads the same input where that is computed (``cpp_fused_mean_relu_threshold_backward``: the mask, the
    ReLU and the pooling in one loop), so the input is never held to the forward's end. Read in graph order, a
    six-block MLP whose ReLUs a mean reads was predicted at 4.00 MB where its forward peaks at 2.02 MB.

    "Saved" here means read by the output only, so the step's outputs and its buffers' updates (a batch norm's
    running statistics) move too. A node that only such nodes read moves with them, and so do the views they
    read: a batch norm's ``x - mean`` that min-cut saves reads the mean through three ``unsqueeze`` views it
    leaves at the forward's end too, and Inductor computes it in the kernel of that batch norm's statistics (tiny
    ResNet-1001: its residual sum's two convolutions were held to the forward's end, 0.5 MB, 13% of the step's
    peak)."""
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    output = next(n for n in fw.graph.nodes if n.op == "output")
    known = set(order)
    late: set[fx.Node] = set()
    for node in reversed(fw.graph.nodes):  # readers first: a node is late where all its readers are
        if (node.users and all(u is output or u in late for u in node.users)
                and (_movable(node, known) or is_view(node))):
            late.add(node)
    earliest: dict[fx.Node, int] = {}
    moves = False
    for node in fw.graph.nodes:
        if node in late:
            earliest[node] = max((earliest.get(a, order[a]) for a in node.all_input_nodes), default=-1)
            moves |= not is_view(node) and earliest[node] + 1 < order[node]
    return _moved_after_inputs(fw, [n.name for n in fw.graph.nodes if n in late]) if moves else fw


def _moved_after_inputs(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A copy of ``gm`` with the nodes ``names`` (in that order) each moved to just after the last node it reads
    (after the last placeholder, where it reads only placeholders)."""
    copied = copy_graph(gm)
    graph = copied.graph
    by_name = {n.name: n for n in graph.nodes}
    for name in names:
        node = by_name[name]
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max(node.all_input_nodes, key=order.__getitem__)
        if last.op == "placeholder":
            last = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__)
        last.append(node)
    graph.lint()
    copied.recompile()
    return copied
