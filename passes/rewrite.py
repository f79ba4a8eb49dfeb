"""Rewrite: apply a ``Plan`` to the joint forward+backward graph.

For every decision the backward stops reading the forward's tensor and reads a new one instead:

* offload: ``h = karma.offload(x)`` right after ``offload_after`` (in the forward), ``karma.wait(h)`` before
  ``release_before`` where the plan needs the swap-out landed, ``y = karma.prefetch(h)`` before ``prefetch_at``
  and ``z = karma.wait(y)`` before the first backward read; every backward read of ``x`` (or of a view of it)
  now reads ``z`` (or the same view of ``z``);
* recompute: copies of the plan's ops, just before the first backward read of what they rebuild, reading
  what stays resident (or earlier copies); backward reads of the rebuilt tensors read the copies.

The forward no longer hands ``x`` to the backward, so the partitioner does not save it; it saves ``h`` (host)
or the recompute chain's inputs instead. Views in the backward are first sunk to just before their first
reader so that nothing reads a tensor earlier than the plan says. Nothing here looks at memory or time: the
plan is the simulator's business, the rewrite only makes the graph do what the plan says.

Example::

    rewritten = rewrite_joint(step, problem, plan)      # a new GraphModule; step.joint is untouched
"""
from __future__ import annotations

import bisect
import operator

import torch
import torch.fx as fx

import karma_fx.runtime  # noqa: F401 - registers torch.ops.karma
from karma_fx.errors import InvalidPlanError
from karma_fx.passes.capture import CapturedStep, copy_joint
from karma_fx.passes.fusible import computes_in_loops, extern_readers, is_lazily_stored, is_view
from karma_fx.passes.liveness import _forward_nodes
from karma_fx.plan import GradToHost, Offload, Plan, Recompute, StreamWeight
from karma_fx.problem import Problem
from karma_fx.split_ops import SPLIT_OPS


_KARMA_OPS = (torch.ops.karma.offload.default, torch.ops.karma.prefetch.default, torch.ops.karma.wait.default)
"""Extern kernels whose result (an alias, to Inductor a view) is a buffer already."""


def rewrite_joint(step: CapturedStep, problem: Problem, plan: Plan) -> tuple[fx.GraphModule, set[str]]:
    """A copy of ``step.joint`` doing what ``plan`` says, and the names of the nodes that must run in the
    forward (the offloads and buffer snapshots), for the partitioner."""
    joint = copy_joint(step)
    graph = joint.graph
    nodes = {n.name: n for n in graph.nodes}
    forward = {nodes[n.name] for n in _forward_nodes(step)}
    _forward_first(graph, forward)
    op_names = {op.name for op in problem.ops}
    storage_of = dict(problem.aliases)
    _sink_backward_views(graph, forward, op_names)

    def backward_readers(storage: str) -> list[fx.Node]:
        """Backward nodes reading ``storage`` directly or through a view made in the forward."""
        return [u for n in graph.nodes if storage_of.get(n.name) == storage for u in n.users
                if u not in forward and u.op != "output"]

    def first_in_graph(candidates: list[fx.Node]) -> fx.Node:
        order = {n: i for i, n in enumerate(graph.nodes)}
        return min(candidates, key=order.__getitem__)

    forward_offloads: set[str] = set()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    buffers = {placeholders[i] for i, kind in enumerate(step.primal_kinds) if kind == "buffer"}
    snapshots: dict[fx.Node, fx.Node] = {}

    def snapshot(buffer: fx.Node) -> fx.Node:
        """A forward copy of a buffer for recomputes to read: the step updates buffers in place after the
        forward (BatchNorm running stats), and a recompute must neither see nor trip over that update."""
        if buffer not in snapshots:
            with graph.inserting_after(placeholders[-1]):
                snap = graph.call_function(torch.ops.aten.clone.default, (buffer,))
            _copy_meta(snap, buffer, "forward")
            snapshots[buffer] = snap
            forward_offloads.add(snap.name)
        return snapshots[buffer]

    reloaded: dict[fx.Node, fx.Node] = {}  # offloaded tensor → its waited reload, for recomputes to read
    for d in plan.decisions:
        if isinstance(d, Offload):
            source = nodes[d.tensor]
            readers = backward_readers(d.tensor)
            if not readers:
                continue
            # A tensor the backward makes leaves the device before its first read (a gradient piece the
            # backward adds up at its end): its copy out runs in the backward, and every reader reads it back.
            made_in_backward = source not in forward
            if made_in_backward and d.free_after != problem.ops[problem.storage(d.tensor).producer].name:
                raise InvalidPlanError(f"{d.tensor} is made by the backward: it can leave the device only between "
                                       f"its production and its first read, not after {d.free_after}")
            phase = "backward" if made_in_backward else "forward"
            # After the producing op, or after the getitem that unpacks it when the op returns a tuple.
            order = {n: i for i, n in enumerate(graph.nodes)}
            after = max(nodes[d.offload_after], source, key=order.__getitem__)
            with graph.inserting_after(after):
                host = graph.call_function(torch.ops.karma.offload.default, (source,))
            if not made_in_backward:
                forward_offloads.add(host.name)
            saved = host
            if d.release_before is not None:  # the swap-out must have landed here: its bytes are free after;
                with graph.inserting_before(nodes[d.release_before]):  # the prefetch reads the waited copy,
                    saved = graph.call_function(torch.ops.karma.wait.default, (host,))  # so the wait stays
                _copy_meta(saved, source, phase, device=torch.device("cpu"))
                if not made_in_backward:
                    forward_offloads.add(saved.name)
            with graph.inserting_before(nodes[d.prefetch_at]):
                fetched = graph.call_function(torch.ops.karma.prefetch.default, (saved, _device_of(source)))
            with graph.inserting_before(first_in_graph(readers + [nodes[d.reload_before]])):
                ready = graph.call_function(torch.ops.karma.wait.default, (fetched,))
            _copy_meta(host, source, phase, device=torch.device("cpu"))
            _copy_meta(fetched, source, "backward")
            _copy_meta(ready, source, "backward")
            _redirect(graph, readers, {source: ready}, op_names)
            reloaded[source] = ready
    # In the order they run, so that a recompute reading what an earlier one rebuilt reads the rebuilt copy, as
    # the plan says; reading the original kept the forward's tensor alive until then.
    position = {n: i for i, n in enumerate(graph.nodes)}
    gaps: dict[str, list[int]] = {}  # a tensor rebuilt more than once → where each rebuild's readers start
    for d in plan.decisions:
        if isinstance(d, Recompute):
            for t in d.tensors:
                gaps.setdefault(t, []).append(position[nodes[d.reload_before]])

    def served(t: str, d: Recompute) -> list[fx.Node]:
        """The backward readers of ``t`` that ``d``'s rebuild serves: up to the next rebuild of ``t``, from
        ``d``'s own ``reload_before`` when an earlier rebuild serves the readers before it."""
        starts = sorted(gaps[t])
        at = position[nodes[d.reload_before]]
        later = [p for p in starts if p > at]
        low = at if starts[0] < at else -1
        return [r for r in backward_readers(t) if low <= position[r] < (later[0] if later else len(position))]

    chains = []
    for i, d in enumerate(plan.decisions):
        if isinstance(d, Recompute):
            readers = [r for t in d.tensors for r in served(t, d)]
            if readers:
                anchor = first_in_graph(readers + [nodes[d.reload_before]])
                chains.append((position[anchor], i, d, readers, anchor))
    rebuilt_before: dict[fx.Node, fx.Node] = {}  # a tensor earlier recomputes rebuilt → its latest copy
    joined: list[tuple[fx.Node, tuple[str, ...], int]] = []  # a chain's last node, the ops joining it, its id
    for _, chain_id, d, readers, anchor in sorted(chains, key=lambda c: c[:2]):
        # A recompute reading an offloaded tensor (a dropout output rebuilt from its swapped-out mask)
        # reads the reload, as the plan says; the original would stay on the device all along.
        replaced: dict[fx.Node, fx.Node] = {**reloaded, **rebuilt_before}
        with graph.inserting_before(anchor):
            for name in d.ops:
                original = nodes[name]
                if original.meta.get("val") is None:
                    raise InvalidPlanError(f"cannot recompute {name}: it has no traced value")
                stand_ins = _running_stat_stand_ins(original)
                clone = graph.node_copy(original, lambda a: stand_ins.get(a) or snapshot(a) if a in buffers
                                        else _materialize(graph, a, replaced, op_names))
                clone.meta["partitioner_tag"] = "is_backward"
                clone.meta["karma"] = {"recompute_of": name, "chain": chain_id}
                replaced[original] = clone
                _unpack_now(graph, original, clone, replaced)
        chain_end = anchor.prev
        # Readers take the copies of what the plan rebuilds, nothing else: a rebuilt op's other outputs
        # (a batch norm's new running statistics) are still resident, and reading their copies would keep
        # bytes alive that the plan never counted.
        rebuilt = set(d.tensors)
        copies = {o: c for o, c in replaced.items() if storage_of.get(o.name) in rebuilt}
        _redirect(graph, readers, copies, op_names)
        rebuilt_before.update(copies)
        if d.joins:
            joined.append((chain_end, d.joins, chain_id))
    for last, names, chain_id in joined:
        _join(last, [nodes[name] for name in names], chain_id)
    for d in plan.decisions:
        if isinstance(d, StreamWeight) and nodes[d.tensor].op != "placeholder":
            _host_cast(nodes[d.tensor], storage_of, {s.name for s in problem.storages if s.kind == "param"})
    for d in plan.decisions:
        if isinstance(d, StreamWeight):
            _stream_weight(graph, nodes, d, storage_of, op_names, forward)
        elif isinstance(d, GradToHost):
            _grad_to_host(graph, nodes, d, storage_of)
    _split_kernels(graph, dict(plan.splits))
    _record_traced_inputs(graph)
    _stable_topological_order(graph)
    _prefetches_just_before_compute(graph, op_names)
    graph.lint()
    joint.recompile()
    return joint, forward_offloads


def _split_kernels(graph: fx.Graph, splits: dict[str, int]) -> None:
    """Each op the plan splits along the batch, and each recompute of it, becomes the karma op that runs it a
    piece at a time (``karma_fx.split_ops``): the same arguments, then the number of pieces."""
    if not splits:
        return
    seen: set[str] = set()
    for node in graph.nodes:
        name = node.meta.get("karma", {}).get("recompute_of", node.name) if node.op == "call_function" else None
        if name not in splits:
            continue
        if node.target not in SPLIT_OPS:
            raise InvalidPlanError(f"the plan splits {name} ({node.target}), which cannot run a piece of the batch "
                                   "at a time")
        node.target = SPLIT_OPS[node.target]
        node.kwargs = {**node.kwargs, "chunks": splits[name]}
        seen.add(name)
    missing = sorted(set(splits) - seen)
    if missing:
        raise InvalidPlanError(f"the plan splits {missing[:3]}, which are not ops of this graph")


def _record_traced_inputs(graph: fx.Graph) -> None:
    """Make Inductor give what a ``karma`` copy reads the traced layout. The host copy has its source's layout
    and the backward was traced with the traced one; where Inductor laid the source out otherwise (an
    offloaded ``clone`` of a transposed view came out in its input's order), the forward copied the returned
    host tensor into a buffer of the traced layout, a CPU kernel reading the host copy while the copy engine
    was still writing it: a 4-layer GPT's gradients were 17% off with 5 ms late copies, and each such copy was
    2 MiB the plan never counted. So each offloaded value is realised in its traced strides where it is made
    (``inductor_realize_to_strides``: once, not as a second copy for the offload), and each inserted node
    carries its inputs' traced values (``eager_input_vals``), without which Inductor leaves a custom op's
    inputs inserted by a pass free of any layout constraint."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _KARMA_OPS:
            continue
        if node.target is torch.ops.karma.offload.default and isinstance(node.args[0], fx.Node):
            node.args[0].meta["inductor_realize_to_strides"] = True
        if "eager_input_vals" not in node.meta:
            node.meta["eager_input_vals"] = (
                tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args), dict(node.kwargs))


def _running_stat_stand_ins(node: fx.Node) -> dict[fx.Node, fx.Node]:
    """What a recompute of ``node`` may read instead of a forward snapshot of each buffer it reads.

    A training-mode batch norm's output and saved statistics do not depend on the running statistics, and its
    backward ignores them; they only need a tensor of the right shape. The forward's own new running
    statistics are step outputs, resident to the end and never mutated, so they cost nothing, where a
    snapshot would stay on the device from the forward to the recompute. (The live buffers themselves cannot
    be read: the step updates them in place, and autograd's version check refuses that.)"""
    if node.target is not torch.ops.aten._native_batch_norm_legit_functional.default:
        return {}
    if len(node.args) < 6 or node.args[5] is not True:
        return {}
    outputs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    stats = {node.args[3]: outputs.get(3), node.args[4]: outputs.get(4)}
    return {buffer: out for buffer, out in stats.items() if isinstance(buffer, fx.Node) and out is not None}


def _cast_dtype(node: fx.Node, plain: bool = True) -> torch.dtype | None:
    """The dtype ``node`` casts its first argument to, if it is a cast, else ``None``; with ``plain``, only a
    cast that changes nothing else (a weight's cast made on the host must be exactly the device's). A gradient's
    widening may also name its layout or device: the host makes it in host memory anyway."""
    if node.target is torch.ops.aten._to_copy.default and len(node.args) == 1 and "dtype" in node.kwargs:
        return node.kwargs["dtype"] if set(node.kwargs) == {"dtype"} or not plain else None
    if node.target is torch.ops.prims.convert_element_type.default and len(node.args) == 2 and not node.kwargs:
        return node.args[1]
    return None


def _host_cast(node: fx.Node, storage_of: dict[str, str], weights: set[str]) -> None:
    """A weight's narrower cast that the plan streams (bf16 on the wire, ``karma_fx.wire``) is made on the host
    from the weight in host memory (``karma.host_cast``); its readers then read the copies the windows bring."""
    dtype = _cast_dtype(node)
    if dtype is None:
        raise InvalidPlanError(f"{node.name} is streamed from the host, but it is neither a parameter nor a plain "
                               f"cast of one ({node.target})")
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node) or storage_of.get(source.name) not in weights:
        raise InvalidPlanError(f"{node.name} is streamed from the host, but what it casts is not a weight")
    device = _device_of(node)
    node.target = torch.ops.karma.host_cast.default
    node.args, node.kwargs = (node.args[0], dtype, device), {}
    node.meta["karma_streams_to"] = device
    _copy_meta(node, node, "forward", device=torch.device("cpu"))


def _stream_weight(graph: fx.Graph, nodes: dict[str, fx.Node], d: StreamWeight, storage_of: dict[str, str],
                   op_names: set[str], forward: set[fx.Node]) -> None:
    """The parameter stays on the host (its placeholder); each window prefetches a device copy and every
    reader in the window (ops and recompute copies, directly or through views) reads that copy instead."""
    aliases = {n for n in graph.nodes if storage_of.get(n.name) == d.tensor}
    readers = list(dict.fromkeys(u for n in aliases for u in n.users if u not in aliases and u.op != "output"
                                 and u.target is not torch.ops.karma.host_cast.default))
    if not readers:
        return
    position = {n: i for i, n in enumerate(graph.nodes)}
    readers.sort(key=position.__getitem__)
    placeholder = nodes[d.tensor]
    previous_end = -1
    for w in d.windows:
        end = position[nodes[w.free_after]]
        members = [r for r in readers if previous_end < position[r] <= end]
        previous_end = end
        if not members:
            continue
        with graph.inserting_before(nodes[w.prefetch_at] if position[nodes[w.prefetch_at]] < position[members[0]]
                                    else members[0]):
            fetched = graph.call_function(torch.ops.karma.prefetch.default,
                                          (placeholder, placeholder.meta.get("karma_streams_to") or _device_of(placeholder)))
        with graph.inserting_before(members[0]):
            ready = graph.call_function(torch.ops.karma.wait.default, (fetched,))
        phase = "forward" if members[0] in forward else "backward"
        _copy_meta(fetched, placeholder, phase)
        _copy_meta(ready, placeholder, phase)
        _redirect(graph, members, {placeholder: ready}, op_names | {fetched.name, ready.name})
    late = [r for r in readers if position.get(r, -1) > previous_end]
    if late:
        raise InvalidPlanError(f"{d.tensor} is read by {late[0].name} after its last window on the device")


def _grad_to_host(graph: fx.Graph, nodes: dict[str, fx.Node], d: GradToHost, storage_of: dict[str, str]) -> None:
    """The step returns a host copy of the gradient, made right after it is produced; where the plan says
    (``release_before``), compute waits for that copy to land, so its device bytes go where the plan frees
    them even when the copy engine runs late (the step returns the waited copy, which keeps the wait)."""
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])

    def to_host(arg: fx.Node) -> fx.Node:
        with graph.inserting_after(arg):
            host = graph.call_function(torch.ops.karma.offload.default, (arg,))
        _copy_meta(host, arg, "backward", device=torch.device("cpu"))
        if d.release_before is not None:
            with graph.inserting_before(nodes[d.release_before]):
                waited = graph.call_function(torch.ops.karma.wait.default, (host,))
            _copy_meta(waited, arg, "backward", device=torch.device("cpu"))
            host = waited
        return host

    returned = [i for i, arg in enumerate(outs) if isinstance(arg, fx.Node) and storage_of.get(arg.name) == d.tensor]
    for i in returned:
        outs[i] = to_host(outs[i])
    output.args = (tuple(outs),) if isinstance(output.args[0], tuple) else (outs,)
    if returned:
        return
    # A narrow gradient the step widens into the one it returns (karma_fx.wire): sent narrow, widened on the host.
    aliases = {n for n in graph.nodes if storage_of.get(n.name) == d.tensor}
    readers = {u for n in aliases for u in n.users if u not in aliases}
    widen = next(iter(readers), None)
    dtype = _cast_dtype(widen, plain=False) if widen is not None else None
    if len(readers) != 1 or dtype is None or widen not in outs:
        raise InvalidPlanError(f"{d.tensor} is sent to the host, but it is neither a parameter gradient the step "
                               "returns nor one it widens into that")
    host = to_host(widen.args[0])  # what the widening reads: the narrow gradient or a view of it
    widen.target = torch.ops.karma.host_cast.default
    widen.args, widen.kwargs = (host, dtype, torch.device("cpu")), {}
    _copy_meta(widen, widen, "backward", device=torch.device("cpu"))
    # Widened at the end of the step, where the copy has long landed: right after the narrow gradient it would
    # block compute for every copy (a wait the plan does not have).
    output.prepend(widen)


def _forward_first(graph: fx.Graph, forward: set[fx.Node]) -> None:
    """Put every forward node before every backward node, each in its own order: the order the plan was made
    in (``build_problem`` lists the forward's ops first). A joint graph may compute forward values after
    backward ones (Inductor's traces update batch norm's running statistics late), and a copy anchored to one of
    those would otherwise be placed among the backward: a wait the plan put early in the forward then read an
    offload placed late, and restoring the order pulled the whole forward ahead of every copy (a Wide ResNet's
    planned step peaked 27% over its plan, every offload run after the forward's last kernel)."""
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    first = [n for n in body if n in forward or n.op == "get_attr"]
    ordered = first + [n for n in body if not (n in forward or n.op == "get_attr")]
    if ordered == body:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:  # a graph without inputs: keep it as it is (nothing to anchor the order to)
        return
    anchor = placeholders[-1]
    for node in ordered:
        anchor.append(node)
        anchor = node


def _stable_topological_order(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, moving as little as possible: a replica made for an
    early reader may need an input that the rewrite placed later."""
    order = list(graph.nodes)
    placed: set[fx.Node] = set()
    result: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        stack = [(node, False)]
        while stack:
            current, ready = stack.pop()
            if current in placed:
                continue
            if ready:
                placed.add(current)
                result.append(current)
                continue
            stack.append((current, True))
            stack.extend((arg, False) for arg in reversed(current.all_input_nodes) if arg not in placed)

    for node in order:
        place(node)
    if result != order:
        anchor = result[0]
        for node in result[1:]:
            anchor.append(node)
            anchor = node


def _prefetches_just_before_compute(graph: fx.Graph, op_names: set[str]) -> None:
    """Move each prefetch down to just before the next compute node (a planned op or a recompute of one), past
    the waits, views and swap-outs between them, keeping the prefetches' own order (the copy stream's).

    The simulator frees what is released before an op (a swapped-out tensor or a gradient sent to the host,
    waited for there) before it allocates what is prefetched at that op. The rewrite inserts each decision's
    nodes in turn, so a window's prefetch could land before another decision's wait at the same op, or before
    the views and copy of a gradient made just above it: both allocated at once, one weight over the plan
    (an autocast MLP streaming its weights peaked +28% over its plan on a plan that put a backward window's
    prefetch where the previous layer's gradient was released)."""
    prefetch = torch.ops.karma.prefetch.default

    def is_boundary(node: fx.Node, fetched: fx.Node) -> bool:
        return (node.op == "output" or node.target is prefetch or fetched in node.all_input_nodes
                or node.name in op_names or _recomputes(node))

    for p in reversed([n for n in graph.nodes if n.target is prefetch]):
        nxt = p.next
        while not is_boundary(nxt, p):
            nxt = nxt.next
        if nxt is not p.next:
            nxt.prepend(p)


def _lowered_at(reader: fx.Node) -> fx.Node:
    """Where Inductor lowers ``reader``: a matmul whose product only an add of its size reads is lowered as an
    ``addmm`` where that add is (its post-grad rewrite; ``karma_fx.fusion.delayed_matmuls`` prices it)."""
    users = list(reader.users)
    if reader.target is torch.ops.aten.mm.default and len(users) == 1 and \
            users[0].target is torch.ops.aten.add.Tensor:
        mine, theirs = reader.meta.get("val"), users[0].meta.get("val")
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.numel() == theirs.numel():
            return users[0]
    return reader


_JOINED = "karma_joined"
"""Meta key of a backward op moved to run with a recompute chain (``Recompute.joins``): the chain's id."""
JOINED_PIN = "karma_joined_pin"
"""Meta key of a ``karma.wait`` that ends a joined run: Inductor may fuse the run's loops across it
(``karma_fx.inductor.PlanOrder``)."""


def _join(last: fx.Node, ops: list[fx.Node], chain_id: int) -> None:
    """Move ``ops`` (in graph order) to just after ``last``, a chain's last node, and mark them joined to it;
    the views they read come along (``_stable_topological_order``)."""
    at = last
    for node in ops:
        at.append(node)
        node.meta[_JOINED] = chain_id
        at = node


def _joins(node: fx.Node) -> bool:
    """A backward op the rewrite moved to run with a recompute chain."""
    return _JOINED in node.meta


def chain_of(node: fx.Node) -> int | None:
    """The id of the recompute chain ``node`` rebuilds for or joins."""
    if _joins(node):
        return node.meta[_JOINED]
    return node.meta.get("karma", {}).get("chain") if _recomputes(node) else None


def _recomputes(node: fx.Node) -> bool:
    """A node the rewrite inserted to rebuild a tensor the plan recomputes."""
    return "recompute_of" in node.meta.get("karma", ())


def _starts_a_recompute(node: fx.Node) -> bool:
    """The first node of a recomputation the rewrite inserted (the node before it rebuilds nothing)."""
    return _recomputes(node) and (node.prev.op == "root" or not _recomputes(node.prev))


def computed_where_planned(gm: fx.GraphModule) -> int:
    """Make Inductor compute, before each prefetch and before each recomputation, the pointwise results the graph
    computes before it and an extern kernel reads after it; returns how many it had to pin. For planned graphs
    Inductor compiles.

    Inductor lowers a pointwise op lazily: its loop is stored (realised) only when a reader needs a buffer,
    and for an extern kernel (a convolution's backward) that is when the reader is lowered, after any
    ``karma.prefetch`` the graph puts between them. The kernel then runs after the prefetch has allocated,
    and what it reads stays alive until it runs. The plan counts it where the graph has it: a BatchNorm's
    backward output was written after the next convolution's input was prefetched, and the prefetched
    BatchNorm input and the incoming gradient it reads were held with it, 1 MiB above the plan (a small
    CNN's leanest plan measured 10% over; ``tests/test_inductor.py``). Each such result now goes
    through ``karma.wait`` (an identity for a tensor no copy made) just after it is computed: an extern
    kernel's input, realised there.

    A recomputation the plan places (nodes the rewrite marks ``recompute_of``) is a boundary for the same
    reason: on a CPU Inductor emits every loop between two extern kernels as one function that allocates all
    its outputs before it runs and frees its inputs after, so a rebuilt tensor realised with the loops before
    it was allocated beside their outputs and held their inputs (a 1 MiB gradient chain and its rebuilt
    activation: the in-place-views probe of ``bench/budget_probes.py`` 5% above its plan at 0.9). The
    ``karma.wait`` between them is an extern kernel, so the rebuild starts a function of its own."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    boundaries = [position[n] for n in nodes if n.target is torch.ops.karma.prefetch.default
                  or _starts_a_recompute(n)]
    if not boundaries:
        return 0
    pinned = 0
    for node in nodes:
        if node.op != "call_function" or not is_lazily_stored(node):
            continue
        readers = extern_readers(node)
        if not readers or any(u.meta.get(JOINED_PIN) for u in node.users):  # stored where its joined run ends
            continue
        first = min(position[_lowered_at(r)] for r in readers)
        i = bisect.bisect_right(boundaries, position[node])
        if i == len(boundaries) or boundaries[i] > first:
            continue
        _read_through_a_wait(graph, node)
        pinned += 1
    if pinned:
        graph.lint()
        gm.recompile()
    return pinned


def recomputations_end_their_functions(gm: fx.GraphModule) -> int:
    """Make each recomputation the plan places end a function of loops wherever it rebuilds, with loops, a tensor
    that the backward reads, by passing that tensor through ``karma.wait`` just after it is computed; returns
    how many it pinned. For planned graphs Inductor compiles, before ``computed_where_planned`` (which then sees a
    recomputation start after each wait and may pin more: more functions, never fewer, than the simulator counts).

    On a CPU Inductor emits every loop between two extern kernels as one function that allocates all its
    outputs before it runs and frees what it read after it returns. A recomputation whose last ops are loops
    (a rebuilt ``tanh`` and ``sigmoid`` of a rebuilt matmul) was fused with the backward's loops that read it,
    so the rebuilt matmul's output, the rebuilt tensors and the backward's outputs were all held together: a
    plan rebuilding three blocks measured 9% above its prediction (``tests/test_inductor.py``). The wait is an
    extern kernel, so the function ends there: the backward's loops start one of their own, and the simulator
    ends the recomputation's function at each rebuilt tensor the backward reads (``karma_fx.simulate``). Each is
    pinned where it is computed, not all at the chain's end: Inductor stores a loop's result when its reader is
    lowered, so a value pinned after another's wait was computed after it, past the boundary. A recomputation
    that starts with loops right after the backward's loops also begins a function of its own: its first op reads
    one of its inputs, a buffer already (a saved tensor, a matmul's output), through a wait, so that the loops
    before it, which the simulator counts apart, do not join its first function. A tuple's items
    (a rebuilt ``var_mean``'s mean) are pinned where the rewrite unpacks them; a value read through views only
    by the recomputation (which Inductor may inline) is left alone. The rebuilt tensors are stored either way:
    a backward op reads them. A chain run with backward loops (``Recompute.joins``) is one function by design:
    the values of its last stretch of loops and of its joined ops are pinned after the last joined op, by
    waits marked ``JOINED_PIN``."""
    graph = gm.graph
    starts = [node for node in graph.nodes if _recomputes(node) and computes_in_loops(node)
              and _begins_after_loops(node)]
    rebuilt: list[fx.Node] = []
    joined_runs: dict[fx.Node, list[fx.Node]] = {}  # a joined run's last node → the values it hands on
    for node in graph.nodes:
        if not ((_recomputes(node) or _joins(node)) and computes_in_loops(node)):
            continue
        values = [node] if isinstance(node.meta.get("val"), torch.Tensor) else [
            u for u in node.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
        values = [v for v in values if _read_past_its_recomputation(v)]
        end = _joined_run_end(node)
        if end is not None:
            joined_runs.setdefault(end, []).extend(values)
        elif not _joins(node):
            rebuilt.extend(values)
    for node in rebuilt:
        _read_through_a_wait(graph, node)
    for end, values in joined_runs.items():  # the whole run is one function: its values are pinned after it
        for value in reversed(values):
            _read_through_a_wait(graph, value, after=end, mark=True)
        rebuilt.extend(values)
    begun = 0
    for node in starts:  # a recomputation after loops begins a function: it reads a buffer through a wait
        read = next((a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
                     and (a.op == "placeholder" or a.op == "call_function" and not computes_in_loops(a) and (
                         not is_view(a) or a.target in _KARMA_OPS))), None)
        if read is None:
            continue
        with graph.inserting_before(node):
            node.replace_input_with(read, _wait_for(graph, read))
        begun += 1
    if rebuilt or begun:
        graph.lint()
        gm.recompile()
    return len(rebuilt) + begun


def _wait_for(graph: fx.Graph, value: fx.Node) -> fx.Node:
    """A ``karma.wait`` of ``value`` at the graph's insertion point: an identity Inductor runs as an extern kernel,
    so a function of loops ends before it and ``value`` is stored."""
    waited = graph.call_function(torch.ops.karma.wait.default, (value,))
    waited.meta.update({k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")})
    return waited


def _read_through_a_wait(graph: fx.Graph, node: fx.Node, after: fx.Node | None = None, mark: bool = False) -> None:
    """Every reader of ``node`` reads it through a ``karma.wait`` placed just after it (``_wait_for``), or, given
    ``after`` (a joined run's last op), every reader past the run, with the wait just after ``after`` (``mark``:
    a wait ``karma_fx.inductor.PlanOrder`` lets the run's loops fuse across). A view inside the run that readers
    past it read too is made again after the wait, from the waited value, for them."""
    with graph.inserting_after(after or node):
        waited = _wait_for(graph, node)
    if mark:
        waited.meta[JOINED_PIN] = True
    if after is None:
        node.replace_all_uses_with(waited, delete_user_cb=lambda user: user is not waited)
        return
    inside, at = set(), node
    while at is not after:
        at = at.next
        inside.add(at)
    _read_past(graph, node, waited, inside)


def _read_past(graph: fx.Graph, value: fx.Node, replacement: fx.Node, inside: set[fx.Node]) -> None:
    """Readers of ``value`` outside ``inside`` (a run) read ``replacement`` instead; a view of ``value`` inside the
    run is replicated from ``replacement`` for its readers outside it."""
    for user in list(value.users):
        if user is replacement:
            continue
        if user not in inside:
            user.replace_input_with(value, replacement)
        elif is_view(user) and any(u not in inside for u in user.users):
            with graph.inserting_after(replacement):
                replica = graph.node_copy(user, lambda a: replacement if a is value else a)
            _read_past(graph, user, replica, inside)
            if not user.users:
                graph.erase_node(user)


def _joined_run_end(node: fx.Node) -> fx.Node | None:
    """The last joined op (``Recompute.joins``) in the run of ``node``'s chain, its joins and views from ``node``
    on; ``None`` where the run has none, or where an extern kernel of the chain comes first."""
    chain = chain_of(node)
    if chain is None:
        return None
    end, at = None, node
    while at.op == "call_function" and (chain_of(at) == chain or is_view(at) and at.target not in _KARMA_OPS):
        if _joins(at):
            end = at
        elif not (is_view(at) or computes_in_loops(at)):  # the chain's own extern kernel ends the stretch:
            return None  # ``node`` is computed before the stretch the joins run with, and pinned there
        at = at.next
    return end


def _begins_after_loops(node: fx.Node) -> bool:
    """Whether the op before ``node`` in the graph (views passed over) is not a recomputation's and is computed
    in Inductor's loops: ``node`` begins a recomputation that would join those loops' function."""
    before = node.prev
    while before.op == "call_function" and is_view(before) and before.target not in _KARMA_OPS:
        before = before.prev
    return not _recomputes(before) and computes_in_loops(before)


def _read_past_its_recomputation(value: fx.Node) -> bool:
    """Whether a node that is not a recomputation's reads ``value``, directly or through views."""
    stack, seen = list(value.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view(user):
            stack.extend(user.users)
        elif not (_recomputes(user) or _joins(user)):
            return True
    return False


def _device_of(node: fx.Node) -> torch.device:
    return node.meta["val"].device


def _copy_meta(new: fx.Node, like: fx.Node, phase: str, device: torch.device | None = None) -> None:
    """Traced value and partitioner tag for an inserted node (a host copy lives on the CPU)."""
    val = like.meta.get("val")
    if isinstance(val, torch.Tensor):
        if device is not None and val.device != device:
            mode = getattr(val, "fake_mode", None)
            with mode if mode is not None else torch.device("meta"):
                val = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device)
        new.meta["val"] = val
    new.meta["partitioner_tag"] = f"is_{phase}"
    new.meta["karma"] = {"from": like.name}


def _unpack_now(graph: fx.Graph, original: fx.Node, clone: fx.Node, replaced: dict[fx.Node, fx.Node]) -> None:
    """Unpack a recomputed tuple right away: a tuple unpacked lazily keeps every element (batch norm's full
    output with its saved statistics) alive until its last element is taken, far later than planned."""
    last = clone
    for user in list(original.users):
        if user.target is operator.getitem and user not in replaced:
            with graph.inserting_after(last):
                item = graph.call_function(operator.getitem, (clone, user.args[1]))
            item.meta = {k: v for k, v in user.meta.items() if k in ("val", "tensor_meta")}
            item.meta["partitioner_tag"] = "is_backward"
            item.meta["karma"] = {"view_of": user.name}
            replaced[user] = last = item


def _materialize(graph: fx.Graph, node: fx.Node, replaced: dict[fx.Node, fx.Node], op_names: set[str]) -> fx.Node:
    """The node that stands for ``node`` after the rewrite: its replacement, a replica of a view/getitem of a
    replaced node (made at the current insertion point), or ``node`` itself if nothing it aliases moved."""
    if node in replaced:
        return replaced[node]
    if node.op != "call_function" or node.name in op_names or "karma" in node.meta:
        return node  # an op, an input, or a node the rewrite inserted: never replicated
    # Every other traced node is a view or an unpacking. That includes the ones no single storage names
    # (``unbind`` / ``split`` return several views of one tensor): a recompute that read the original
    # ``unbind`` of a rebuilt tensor would keep the whole original storage alive into the backward.
    mapped = fx.map_arg((node.args, node.kwargs), lambda a: _materialize(graph, a, replaced, op_names))
    if mapped == (node.args, node.kwargs):
        return node
    replica = graph.create_node("call_function", node.target, mapped[0], mapped[1])
    replica.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
    replica.meta["partitioner_tag"] = "is_backward"
    replica.meta["karma"] = {"view_of": node.name}
    replaced[node] = replica
    return replica


def _redirect(graph: fx.Graph, readers: list[fx.Node], replaced: dict[fx.Node, fx.Node], op_names: set[str]) -> None:
    """Make ``readers`` read the replacements (views of moved tensors are replicated just before each)."""
    for reader in dict.fromkeys(readers):
        with graph.inserting_before(reader):
            new_args = fx.map_arg((reader.args, reader.kwargs),
                                  lambda a: _materialize(graph, a, replaced, op_names))
        reader.args, reader.kwargs = new_args


def _sink_backward_views(graph: fx.Graph, forward: set[fx.Node], op_names: set[str]) -> None:
    """Move each backward view / getitem to just before its first reader, so it reads nothing early (and
    drop the dead ones).

    Walking backwards, every reader of a node is already in its final place; a moved node takes its first
    reader's position (a fractional key keeps the order comparable without renumbering the graph).
    """
    position = {n: float(i) for i, n in enumerate(graph.nodes)}
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node in forward or node.name in op_names:
            continue
        if not node.users:  # a dead view would otherwise count as an early reader
            graph.erase_node(node)
            continue
        first = min(node.users, key=position.__getitem__)
        if first.op != "output" and position[first] > position[node]:
            first.prepend(node)
            position[node] = position[first] - 1e-6
