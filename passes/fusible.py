"""What Inductor fuses, read from FX graphs: the ops it computes in its own loops, the pointwise results it
inlines into their readers rather than storing, and one joint graph stitched back from a partitioned forward
and backward. ``karma_fx.fusion`` prices a step from these answers (memory as Inductor allocates it, time as
its kernels run); this module only reads graphs.

Example::

    fusible, inlined = fusible_ops(step.joint.graph), inlined_ops(step.joint.graph)
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx as fx

from karma_fx.passes.liveness import storage_key

__all__ = ["CONCATENATIONS", "CONVOLUTION_READS", "SEEDED_LOOP_OPS", "SHAPE_READS", "STITCHED_FROM", "addmm_adds",
           "computes_in_loops", "extern_readers", "fusible_ops", "inlined_ops", "inlined_past_views",
           "is_lazily_stored", "is_pointwise", "is_reduction", "is_view", "layout_optimized", "stitched",
           "with_channels_last_copies", "channels_last_nodes"]

_LOOP_OPS: frozenset[str] = frozenset({
    "aten.embedding.default", "aten.gather.default", "aten.index.Tensor", "aten._unsafe_index.Tensor",
    "aten.full.default", "aten.scalar_tensor.default", "aten.zeros.default", "aten.ones.default",
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten._to_copy.default",
    "aten.clone.default", "aten.var_mean.correction", "aten.max.dim", "aten.min.dim", "prims.iota.default",
    "prims.convert_element_type.default", "aten.slice_scatter.default", "aten.constant_pad_nd.default",
    "aten.copy.default", "aten.select_scatter.default", "prims._low_memory_max_pool_with_offsets.default",
    "prims._low_memory_max_pool_offsets_to_indices.default", "aten.cat.default",
})
"""Untagged ops that Inductor lowers to a loop nest of its own (an index load, a fill, a copy, a Welford or
arg reduction, a padding, slice or row written into a copy, a functional ``copy``) rather than to an extern
kernel, so they fuse like pointwise and reduction nodes. ``copy`` and ``select_scatter`` (what functionalization
makes of an in-place update of a view) counted as extern kernels, a chain of them looked like several kernels
each freeing what the last wrote, where Inductor writes one function holding all of it (10.7% under a step's
peak)."""

SCATTER_OPS: frozenset[str] = frozenset({
    "aten._unsafe_masked_index_put_accumulate.default", "aten.index_put.default", "aten._unsafe_index_put.default",
    "aten.scatter_add.default", "aten.scatter.src", "aten.scatter.value", "aten.as_strided_scatter.default",
})
"""Functional scatters Inductor lowers itself: it copies the tensor scattered into (``clone``, a loop that
inlines what made it: an embedding's gradient is a fill written once, into the scatter's own output, not a
zeroed buffer and then a second one) and then writes the scattered values into that copy in a loop of its own
that reads the values, the indices and the mask inlined. The result is always stored, as a reduction's is.
Counted as an extern kernel, a decoder's embedding gradient held its zero fill and the result (two 64 KiB
buffers at the tiny size, and the eager kernel's 8 KiB scratch besides: 7.6% over a Llama step's peak).
``as_strided_scatter`` (the backward of an ``as_strided`` read) is lowered the same way: counted as an extern
kernel, the copy it scatters was stored beside the buffer it scatters into (a plan 16% above its peak)."""

CONCATENATIONS: frozenset[str] = frozenset({"aten.cat.default"})
"""Inductor lowers a ``cat`` on a CPU to a ``ConcatKernel`` (of 8-bit integers only, to ATen's: ``_in_loops``): a
buffer of its own, which the loops computing its inputs write their slices of, so it is a loop op whose result is
always stored and never written over an input that dies there. An input computed at the cat costs nothing; one
Inductor has stored already with a layout it may still choose (a reduction, a 2-D matmul's output) is written into
its slice too, and one it may not (a graph input, a view, a saved value) is copied in by a loop. The model counts
those written earlier as buffers of their own beside the cat's (more than runs), and starts the cat's buffer at
the cat, where Inductor allocates it with the first of them (less than runs, by the cat less that input: a known
gap). Counted as an extern kernel, each input was a buffer of its own beside the result: a cat of sixteen
pointwise pieces predicted a third above its allocator peak. On a GPU Inductor may lower it pointwise and store
nothing (fewer bytes than this counts)."""

SEEDED_LOOP_OPS: frozenset[str] = frozenset({
    "prims.inductor_random.default", "prims.inductor_randint.default", "prims.inductor_lookup_seed.default",
})
"""Inductor's own random draws (what its ``replace_random`` pass makes of a dropout's ``rand``): generated in
its loops from a seed, so they fuse with their neighbours, but their result is stored, never inlined."""

SHAPE_READS: dict[str, int] = {
    "aten.avg_pool2d_backward.default": 1,
    "aten.avg_pool3d_backward.default": 1,
    "aten.max_pool2d_with_indices_backward.default": 1,
}
"""Backward ops whose Inductor lowering reads one input (its position among the op's inputs) for its sizes
only: a pooling's backward computes the input's gradient from the output's gradient (and, for max pooling,
the indices), never from the input's values."""

_HEAVY_ON_CPU = ("exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh")
"""Ops whose result Inductor's CPU backend stores rather than recomputes in each of several readers."""


_REDUCTION_TAG = getattr(torch.Tag, "reduction", None)
_REDUCTIONS: frozenset[str] = frozenset({
    "aten.all.default", "aten.all.dim", "aten.all.dims", "aten.amax.default", "aten.amin.default",
    "aten.aminmax.default", "aten.any.default", "aten.any.dim", "aten.any.dims", "aten.argmax.default",
    "aten.argmin.default", "aten.count_nonzero.default", "aten.count_nonzero.dim_IntList",
    "aten.linalg_vector_norm.default", "aten.logsumexp.default", "aten.max.default", "aten.max.dim",
    "aten.mean.default", "aten.mean.dim", "aten.min.default", "aten.min.dim", "aten.nansum.default",
    "aten.norm.Scalar", "aten.norm.ScalarOpt_dim", "aten.norm.ScalarOpt_dim_dtype", "aten.norm.ScalarOpt_dtype",
    "aten.prod.default", "aten.prod.dim_int", "aten.std.correction", "aten.std.default", "aten.std.dim",
    "aten.std_mean.correction", "aten.std_mean.default", "aten.std_mean.dim", "aten.sum.default",
    "aten.sum.dim_IntList", "aten.var.correction", "aten.var.default", "aten.var.dim", "aten.var_mean.correction",
    "aten.var_mean.default", "aten.var_mean.dim",
})
"""The ops torch 2.13 tags as reductions (``torch.Tag.reduction``), for a torch without that tag (2.9 has
none: every Inductor step failed there, ``AttributeError`` on the tag)."""


def is_reduction(target: object) -> bool:
    """Whether ``target`` (an op, or its name as ``str(op)`` writes it) reduces: Inductor generates its loops."""
    if _REDUCTION_TAG is not None and isinstance(target, torch._ops.OpOverload) and _REDUCTION_TAG in target.tags:
        return True
    return str(target) in _REDUCTIONS


def is_pointwise(target: object) -> bool:
    """Whether ``target`` (an op, or its name as ``str(op)`` writes it) is an aten op tagged pointwise (one output
    element from the same element of each input)."""
    if isinstance(target, str):
        target = _op_named(target)
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _op_named(name: str) -> object:
    """The op ``str(op)`` names (``aten.where.self``), or None."""
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def _computes_in_loops(target: object) -> bool:
    if is_pointwise(target):
        return True
    return is_reduction(target) or str(target) in _LOOP_OPS or str(target) in SCATTER_OPS


def _in_loops(node: fx.Node) -> bool:
    """Whether Inductor computes the op ``node`` calls in its own loops (``_computes_in_loops``), save a ``cat`` of
    8-bit integers, which it leaves to ATen on a CPU: an extern kernel, each input a buffer of its own."""
    if not _computes_in_loops(node.target):
        return False
    if str(node.target) in CONCATENATIONS and node.args and isinstance(node.args[0], (list, tuple)):
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[0]]
        if all(isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype in (torch.int8, torch.uint8)
               for v in vals):
            return False
    return True


def _stores_its_result(target: object) -> bool:
    """A reduction or a scatter: Inductor always writes its result to a buffer, never inlines it."""
    name = str(target)
    return is_reduction(target) or name in (
        "aten.var_mean.correction", "aten.max.dim", "aten.min.dim", "prims._low_memory_max_pool_with_offsets.default"
    ) or name in SCATTER_OPS or name in CONCATENATIONS


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def computes_in_loops(node: fx.Node) -> bool:
    """Whether Inductor computes ``node`` in its own loops (not an extern kernel, not a view)."""
    return node.op == "call_function" and not _is_view(node) and _in_loops(node)


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is a view (or an item of a tuple) of another node's result."""
    return node.op == "call_function" and _is_view(node)


def fusible_ops(graph: fx.Graph) -> frozenset[str]:
    """Names of the call nodes of ``graph`` that Inductor computes in its own (fusible) loops: pointwise and
    reduction ops, index loads, fills, copies and the scatters Inductor generates (``SCATTER_OPS``). Everything
    else (matmuls, convolutions, random draws, fallbacks, ``karma`` ops) is an extern kernel that reads and
    writes allocated buffers."""
    return frozenset(n.name for n in graph.nodes if n.op == "call_function" and _in_loops(n))


def inlined_ops(graph: fx.Graph) -> frozenset[str]:
    """Names of the pointwise nodes of ``graph`` whose result Inductor's lowering inlines into its readers
    rather than storing. Lowering walks the graph in order and stores (realises) a pointwise result that
    several nodes read when recomputing it in each would cost too much: its expression, with everything
    inlined into it, holds a transcendental op on a CPU, more than ``realize_opcount_threshold`` ops, or
    reads more than ``realize_reads_threshold`` stored buffers; and any result that has accumulated more
    than the accumulated-reads threshold of buffer reads. Reductions and scatters always write a buffer."""
    return frozenset(n.name for n in _inlining(graph, views_stored_alone=False)[0]) | kernel_local_draws(graph)


def addmm_adds(graph: fx.Graph) -> frozenset[str]:
    """Names of the adds Inductor's post-grad pattern rewrites with a matmul into one ``addmm``: an ``add`` one
    of whose operands is a matmul read by nothing else, directly (not through a view), the other a tensor of
    the same dtype that broadcasts to the product's two dimensions (``is_valid_addmm_fusion``; on a GPU it
    also keeps such an add apart where only pointwise ops read it). A residual block's gradient is the sum of
    two matmuls read as 3-D views: no rewrite, and Inductor inlines the sum into its readers."""
    found = set()
    for node in graph.nodes:
        if node.op != "call_function" or str(node.target) != "aten.add.Tensor" or len(node.args) != 2:
            continue
        for mm, other in ((node.args[1], node.args[0]), (node.args[0], node.args[1])):  # add(c, mm) first
            if not (isinstance(mm, fx.Node) and str(mm.target) == "aten.mm.default" and len(mm.users) == 1
                    and isinstance(other, fx.Node)):
                continue
            product, addend = mm.meta.get("val"), other.meta.get("val")
            if not (isinstance(product, torch.Tensor) and isinstance(addend, torch.Tensor)):
                continue
            if addend.dim() <= 2 and addend.dtype == product.dtype and all(
                    a in (1, b) for a, b in zip(reversed(addend.shape), reversed(product.shape))):
                if product.device.type != "cuda" or not all(is_pointwise(u.target) for u in node.users):
                    found.add(node.name)
                    break
    return frozenset(found)


def kernel_local_draws(graph: fx.Graph) -> frozenset[str]:
    """Names of Inductor's random draws (``prims.inductor_random``) that it never allocates: lowering stores
    each draw, but one whose every reader is a pointwise op over as many elements (a dropout's ``rand > p``)
    is fused with them into one kernel, and the scheduler drops a buffer only that kernel uses. Counted as
    stored, each attention dropout held an S×S float buffer that neither Inductor's own step nor a planned
    one allocates (``karma_fx.fusion.fused_storages`` also asks that whatever computes the draw again runs in
    its stretch of loops)."""
    found = set()
    for node in graph.nodes:
        if node.op != "call_function" or str(node.target) != "prims.inductor_random.default" or not node.users:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if all(u.op == "call_function" and is_pointwise(u.target) and isinstance(u.meta.get("val"), torch.Tensor)
               and u.meta["val"].numel() == val.numel() for u in node.users):
            found.add(node.name)
    return frozenset(found)


def _inlining(graph: fx.Graph, *, views_stored_alone: bool) -> tuple[set[fx.Node], dict[fx.Node, frozenset[fx.Node]]]:
    """The nodes ``inlined_ops`` names, and for each the stored nodes its expression reads. ``views_stored_alone``:
    a result an extern kernel reads only through views Inductor stores by themselves (``_stores_only_the_view``)
    is not stored for that (``inlined_past_views``)."""
    from torch._inductor import config

    reads: dict[fx.Node, frozenset[fx.Node]] = {}
    ops: dict[fx.Node, frozenset[str]] = {}
    count: dict[fx.Node, int] = {}
    inlined: set[fx.Node] = set()
    base: dict[fx.Node, fx.Node] = {}
    opcount_limit = config.realize_opcount_threshold or config._realize_opcount_threshold_default
    backward = _after_tangents(graph) if views_stored_alone else set()
    rewritten = addmm_adds(graph)  # extern kernels (``addmm``): their result and what they read are buffers
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _is_view(node) and node.all_input_nodes:
            base[node] = base.get(node.all_input_nodes[0], node.all_input_nodes[0])
            continue
        if not _in_loops(node) or _stores_its_result(node.target) or node.name in rewritten:
            continue
        my_reads: set[fx.Node] = set()
        my_ops = {str(node.target).split(".")[1] if str(node.target).count(".") >= 2 else str(node.target)}
        my_count = 1
        for arg in node.all_input_nodes:
            src = base.get(arg, arg)
            if src in inlined and (node not in backward or src in backward):  # a saved value is the forward's output
                my_reads |= reads[src]
                my_ops |= ops[src]
                my_count += count[src]
            else:
                my_reads.add(src)
        val = node.meta.get("val")
        cpu = isinstance(val, torch.Tensor) and val.device.type == "cpu"
        acc_limit = (config.realize_acc_reads_threshold
                     or (config.realize_cpu_acc_reads_threshold if cpu else config._realize_acc_reads_threshold_default))
        many_readers = len(set(node.users)) > 1 or any(_is_view(u) and len(u.users) > 1 for u in node.users)
        read_by_extern = (_read_by_extern_unless_through_views(node) if views_stored_alone else _read_by_extern(node)
                          ) or any(u.name in rewritten for u in _read_through_views(node.users))
        stored = (many_readers and ((cpu and any(op in _HEAVY_ON_CPU for op in my_ops))
                                    or my_count > opcount_limit or len(my_reads) > config.realize_reads_threshold)
                  ) or len(my_reads) > acc_limit or read_by_extern
        if not stored:
            inlined.add(node)
            reads[node], ops[node], count[node] = frozenset(my_reads), frozenset(my_ops), my_count
    return inlined, reads


def is_lazily_stored(node: fx.Node) -> bool:
    """Whether Inductor lowers ``node`` to a loop it stores only when a reader needs it (a pointwise op, a
    fill, a copy), not as soon as it is lowered (a reduction, a scatter) nor as an extern kernel."""
    return (node.op == "call_function" and not _is_view(node) and _in_loops(node)
            and not _stores_its_result(node.target) and isinstance(node.meta.get("val"), torch.Tensor))


def extern_readers(node: fx.Node, *, copy_into_input_is_extern: bool = False) -> list[fx.Node]:
    """The extern kernels (not Inductor's loops) that read ``node``, directly or through views. A ``copy_`` into
    a graph input (a BatchNorm's running statistics) is a loop of Inductor's writing into that input; the
    memory model counts it as an extern kernel (``copy_into_input_is_extern``), which it has matched so far."""
    return [user for user in _read_through_views(node.users) if not _in_loops(user)
            and (copy_into_input_is_extern or user.target is not torch.ops.aten.copy_.default)]


def _read_through_views(users: Iterable[fx.Node]) -> list[fx.Node]:
    """The ops (not views) among ``users`` and what reads them through views, each once."""
    stack, seen, found = list(users), set(), []
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if _is_view(user):
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _read_by_extern(node: fx.Node) -> bool:
    """Whether an extern kernel (a convolution, a matmul, a ``karma`` op) reads ``node``, directly or through
    views: Inductor realises every input of an extern kernel, so such a result is a buffer, and a pointwise
    reader elsewhere reads that buffer, not what it was computed from. Counted as inlined, a BatchNorm-ReLU
    output that a convolution reads lent its own reads to the ReLU mask of its backward, which then looked
    too costly to inline; Inductor inlines the mask into each reader, and the output stayed allocated past
    where the model freed it (a pooling CNN's step 0.8 MiB over its plan, 14%)."""
    return bool(extern_readers(node, copy_into_input_is_extern=True))


_RESHAPES = frozenset({"aten.view.default", "aten.reshape.default"})


def _after_tangents(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph computed from its tangents: the backward's, as far as what it reads of the
    forward goes (a forward value a backward node reads is saved, so stored, whatever the forward inlines)."""
    found = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _is_extern(node: fx.Node) -> bool:
    return node.op == "call_function" and not _is_view(node) and not _in_loops(node)


def _stores_only_the_view(view: fx.Node) -> bool:
    """A reshape that an extern kernel reads directly, with other readers besides: lowering hints Inductor to
    store a node with several readers one of which is an extern kernel (``realize_hint``), and for a reshape of
    an unstored result that stores the reshaped copy alone, unless the result reads more than one buffer at a
    varying index (then the result itself is stored). A reshape that only the extern kernel reads gets no hint,
    and the kernel's input is then the result itself, stored."""
    return str(view.target) in _RESHAPES and len(set(view.users)) > 1 and any(_is_extern(u) for u in view.users)


def _read_by_extern_unless_through_views(node: fx.Node) -> bool:
    """Whether an extern kernel reads ``node`` other than through a view that Inductor stores by itself."""
    for user in node.users:
        if _is_view(user):
            if extern_readers(user, copy_into_input_is_extern=True) and not _stores_only_the_view(user):
                return True
        elif _is_extern(user):
            return True
    return False


def _varying_reads(reads: frozenset[fx.Node]) -> int:
    """How many of ``reads`` a loop reads at an index that varies (not one element, read at a constant index)."""
    def numel(n: fx.Node) -> int:
        val = n.meta.get("val")
        return val.numel() if isinstance(val, torch.Tensor) else 1
    return sum(1 for n in reads if numel(n) != 1)


def inlined_past_views(graph: fx.Graph) -> dict[str, dict[str, bool]]:
    """Pointwise results that an extern kernel reads only through a reshape Inductor stores by itself
    (``_stores_only_the_view``), each with the loop ops that compute it again inline, and for each whether it
    also reads the stored reshape. Inductor then stores the reshape (``buf0 = (2048, 128)`` for a matmul), not the
    result, which stays unstored and is inlined into its other loop readers, so what it is computed from is read
    there. A two-pass residual MLP's backward starts with the loss's gradient (``2 * x * g / n``, one read at a
    varying index, ``g`` a scalar): a matmul and a bias gradient's sum read its 2-D view, and the residual
    gradient's sum, a block later, computes it again from ``x``, which stays allocated until then (1 MiB above
    every plan of that step, the step as written too). Only results Inductor would inline were no extern kernel
    reading them (``inlined_ops``) and that read at most one buffer at a varying index; with two (``x * g``, ``g``
    of the same shape or broadcast), a transpose read (a ReLU gradient a matmul reads as ``t``) or a reshape only
    the matmul reads, Inductor stores the result itself and its readers read that."""
    inlined, reads = _inlining(graph, views_stored_alone=True)
    found: dict[str, dict[str, bool]] = {}
    for node in graph.nodes:
        if node not in inlined or not _read_by_extern(node) or _varying_reads(reads[node]) > 1:
            continue
        stored = {u for u in node.users if _is_view(u) and extern_readers(u, copy_into_input_is_extern=True)}
        through = {u.name for u in _read_through_views(stored) if _in_loops(u)}
        again = {u.name for u in _read_through_views(u for u in node.users if u not in stored)
                 if _in_loops(u)}
        if again:
            found[node.name] = {name: name in through for name in again}
    return found


STITCHED_FROM = "karma_stitched_from"
"""Meta key of a stitched node: the name of the node it copies. A backward op the partitioner recomputes has a
forward op's name, which the stitched graph renames (``relu_1``, perhaps another op's name); its measured
scratch is the op's it copies."""


def stitched(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> fx.GraphModule:
    """One joint graph equivalent to the partitioned ``fw`` then ``bw``: each backward placeholder for a saved
    value reads the forward node that computed it, tangents stay placeholders, and the outputs are the
    forward's own ``num_fwd_outputs`` then the backward's. Forward nodes are tagged as forward
    (``partitioner_tag``, as a rewrite tags what it adds), so a value computed only to be saved runs in the
    forward, where the partition put it, and not in the backward where nothing but its readers are."""
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    fw_out: tuple = ()
    for node in fw.graph.nodes:
        if node.op == "output":
            fw_out = tuple(node.args[0])
            continue
        new = graph.node_copy(node, lambda a: env[a])
        if node.op == "call_function":
            new.meta["karma"] = {"stitched": True}
            new.meta["partitioner_tag"] = "is_forward"
            new.meta[STITCHED_FROM] = node.name
        env[node] = new
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved = [n for n in placeholders if not n.name.startswith("tangents")]
    benv: dict[fx.Node, object] = {}
    for node, value in zip(saved, fw_out[num_fwd_outputs:num_fwd_outputs + len(saved)]):
        benv[node] = env[value] if isinstance(value, fx.Node) else value
    bw_out: tuple = ()
    fresh: dict[object, torch.Tensor] = {}
    for node in bw.graph.nodes:
        if node.op == "output":
            bw_out = tuple(node.args[0])
        elif node not in benv:
            new = graph.node_copy(node, lambda a: benv[a])
            if node.op == "call_function":
                new.meta["val"] = _own_storages(node, fresh)
                new.meta[STITCHED_FROM] = node.name
            benv[node] = new
    outputs = [env[a] if isinstance(a, fx.Node) else a for a in fw_out[:num_fwd_outputs]]
    outputs += [benv[a] if isinstance(a, fx.Node) else a for a in bw_out]
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _own_storages(node: fx.Node, fresh: dict[object, torch.Tensor]) -> object:
    """``node``'s traced value with storages of its own. A partitioner that recomputes a forward node in the
    backward copies its traced value, fake storage and all, so the recompute would look like the forward
    tensor itself, alive from the forward to the backward. A tensor that aliases an input of ``node`` (a
    view, an unpacked tuple element) is put on whatever storage that input now has; any other gets a new
    one (``fresh``: old storage to its new base, shared by the views read later)."""
    inputs = {storage_key(t) for arg in node.all_input_nodes for t in _tensors(arg.meta.get("val"))}

    def own(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in fresh:
            if key in inputs:
                return t  # an alias of a value the backward did not make (a saved tensor, a tangent)
            with t.fake_mode:  # type: ignore[attr-defined]
                fresh[key] = torch.empty((t.untyped_storage().nbytes(),), dtype=torch.uint8, device=t.device)
        with t.fake_mode:  # type: ignore[attr-defined]
            return fresh[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return own(val)
    if isinstance(val, (tuple, list)):
        return type(val)(own(v) if isinstance(v, torch.Tensor) else v for v in val)
    return val


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


CONVOLUTION_READS: dict[object, tuple[int, ...]] = {
    torch.ops.aten.convolution.default: (0, 1),  # input, weight
    torch.ops.aten.convolution_backward.default: (1, 2),  # the forward's input, weight
}


def layout_optimized(fw: fx.GraphModule) -> bool:
    """Whether Inductor, with its settings as they are now, runs the convolutions of the forward graph ``fw``
    channels-last (its layout optimization: on a CPU with oneDNN whenever there is a convolution, on a GPU by
    a FLOPs heuristic). Asked of Inductor itself (``GraphLowering.decide_layout_opt``); ``False`` where it
    cannot answer."""
    try:
        from torch._inductor.graph import GraphLowering

        return bool(GraphLowering.decide_layout_opt(fw, is_inference=False))
    except Exception:  # noqa: BLE001 - an Inductor without the heuristic: no layout optimization counted
        return False


def channels_last_nodes(fw: fx.GraphModule) -> frozenset[str]:
    """The nodes of the forward graph ``fw`` whose results Inductor's layout optimization stores channels-last,
    by its own rule (``GraphLowering.find_nodes_prefer_channels_last``): a convolution, what one reads, and what
    reads those, up to the last convolution. A result made after it from that convolution alone (a ReLU's mask
    before a global mean) keeps the traced, channels-first layout; one that also reads an earlier convolution's
    (a residual sum with a projection shortcut) is channels-last. Empty where Inductor cannot answer."""
    try:
        from types import SimpleNamespace

        from torch._inductor.graph import GraphLowering

        return frozenset(n.name for n in GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=fw)))
    except Exception:  # noqa: BLE001 - an Inductor without the rule: every saved value counted channels-first
        return frozenset()


def with_channels_last_copies(joint: fx.GraphModule, num_fwd_outputs: int,
                              channels_last: frozenset[str] = frozenset()) -> tuple[fx.GraphModule, int]:
    """``joint`` (a stitched step, edited in place) as Inductor's layout optimization runs it: every input a
    convolution reads (a weight, the batch) that is not already channels-last is copied to channels-last at the
    forward's start, in one kernel, and the convolutions of both phases read the copy, which the forward saves
    for the backward in place of the input (read off the generated code of a small CNN: the copies are made
    before the first convolution and returned among the saved tensors). So each copy is held from the forward's
    start to its last convolution in the backward: on ResNet-50 at tiny size 0.21 MiB the step as written held
    above a model without them (14% of its peak). A 1x1 kernel's weight is channels-last already: no copy.
    In the backward, a convolution's incoming gradient made from the head's (a global mean's backward, the
    tangent) is written channels-first and copied to channels-last by the same kernel: both are held, with the
    stored tensors that kernel reads (a plain two-convolution CNN: 27% over the model without the copy, 0.01%
    under with it); one that comes from another convolution's backward is channels-last already. So is one
    whose kernel reads a saved value stored channels-last (``channels_last``, forward node names, from
    ``channels_last_nodes``): Inductor orders a kernel's loops by what it reads, and a batch norm's backward at
    the head of a pre-activation ResNet reads the residual sum, channels-last (tiny WRN-28-10 and ResNet-1001:
    32 and 64 KiB the model held twice; the plain CNN's kernel reads only a ReLU mask stored channels-first).

    Also returned: the largest gradient of such a weight. The backward returns those gradients channels-last,
    and autograd stores a parameter's gradient in the parameter's own layout, so it copies each one after the
    backward graph has returned them all, one at a time: the step's end holds every gradient and one copy
    (ResNet-50 and a wide ResNet at tiny size: 0.14 MiB, 7-10% of the peak, after the backward's last op)."""
    graph = joint.graph
    copied: dict[fx.Node, fx.Node] = {}
    anchor = None  # the last of the forward's inputs (the tangents are placeholders further down)
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        anchor = node
    for node in list(graph.nodes):
        positions = CONVOLUTION_READS.get(node.target, ())
        for i in positions:
            source = node.args[i] if i < len(node.args) else None
            if not isinstance(source, fx.Node) or source.op != "placeholder":
                continue
            val = source.meta.get("val")
            if (not isinstance(val, torch.Tensor) or val.dim() != 4
                    or val.is_contiguous(memory_format=torch.channels_last)):
                continue
            if source not in copied:
                if anchor is None:  # pragma: no cover - a convolution reads a placeholder, so there is one
                    return joint
                with graph.inserting_after(anchor):
                    copy = graph.call_function(torch.ops.aten.clone.default, (source,),
                                               {"memory_format": torch.channels_last})
                with val.fake_mode:  # type: ignore[attr-defined]
                    copy.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device=val.device,
                                                   memory_format=torch.channels_last)
                copy.meta["karma"] = {"stitched": True}
                copy.meta["partitioner_tag"] = "is_forward"
                copied[source] = anchor = copy
            node.update_arg(i, copied[source])
    for node in [n for n in graph.nodes if n.target is torch.ops.aten.convolution_backward.default]:
        gradient = node.args[0]
        if (not isinstance(gradient, fx.Node) or _from_channels_last_gradients(gradient)
                or _reads_channels_last(gradient, channels_last)):
            continue
        val = gradient.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 4:
            continue
        # made channels-first (from the head's gradient: a mean, a flatten, the tangent) and copied to
        # channels-last for the convolution's backward by the kernel that writes it: both held from there, with
        # what that kernel reads. The copy is modelled as a node reading all of them that the fusion model takes
        # for an extern kernel's (so the gradient is stored, not inlined into it); this graph is never run
        # (not an input read for its sizes only, a pooling's: the kernel never loads it, and counted as read
        # here it would not be held to the backward's end, where Inductor, which never frees it, holds it). The
        # node is a ``stack``, which nothing here computes in loops (a ``cat`` is a loop op: ``CONCATENATIONS``)
        sized = SHAPE_READS.get(str(gradient.target))
        inputs = [a for k, a in enumerate(gradient.all_input_nodes) if k != sized]
        reads = [gradient] + [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor)
                              and (a.op == "placeholder" or a.meta.get("partitioner_tag") == "is_forward"
                                   or not _in_loops(a))]  # stored anyway: inputs, saved, extern
        with graph.inserting_before(node) if gradient.op == "placeholder" else graph.inserting_after(gradient):
            copy = graph.call_function(torch.ops.aten.stack.default, (reads,))
        with val.fake_mode:  # type: ignore[attr-defined]
            copy.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device=val.device,
                                           memory_format=torch.channels_last)
        copy.meta["karma"] = {"channels_last_copy": True}
        node.update_arg(0, copy)
    graph.lint()
    joint.recompile()
    position = {n: i for i, n in enumerate(n for n in graph.nodes
                                           if n.op == "placeholder" and not n.name.startswith("tangents"))}
    output = next(n for n in graph.nodes if n.op == "output")
    gradients = output.args[0][num_fwd_outputs:]
    regathered = [_bytes(source) for source in copied
                  if position.get(source, len(gradients)) < len(gradients)
                  and gradients[position[source]] is not None]
    return joint, max(regathered, default=0)


def _reads_channels_last(node: fx.Node, channels_last: frozenset[str]) -> bool:
    """Whether the backward loops computing ``node`` read forward values of its shape (through the loop ops
    before it, up to stored values: forward nodes and placeholders) and Inductor stores every one of them
    channels-last. Where some are channels-first its loop order is a vote this does not model, so the copy is
    counted."""
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    layouts: set[bool] = set()
    shape = node.meta["val"].shape
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        # a forward node of the stitched graph (``stitched``), not a recomputation's copy of one in the backward,
        # which carries the forward's partitioner tag too
        if n.meta.get("karma", {}).get("stitched") or n.op == "placeholder":
            if isinstance(val, torch.Tensor) and val.shape == shape:  # per-channel statistics cast no vote
                layouts.add(n.meta.get(STITCHED_FROM, n.name) in channels_last)
            continue
        if n.op == "call_function" and _in_loops(n):
            stack.extend(n.all_input_nodes)
    return layouts == {True}


def _from_channels_last_gradients(node: fx.Node) -> bool:
    """Whether a backward value is computed from a convolution's backward (whose gradients oneDNN returns
    channels-last, and which the pointwise ops after it keep), not only from the head's gradient and what the
    forward saved."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function" or n.meta.get("partitioner_tag") == "is_forward":
            continue
        seen.add(n)
        if n.target is torch.ops.aten.convolution_backward.default:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _bytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()
