"""Liveness: turn a captured joint graph into the planner's plain-data ``Problem``.

Three things happen here, all over ``torch.fx`` nodes so nothing downstream has to see one:

* **Order and phase.** The forward is every node the step's forward outputs depend on; it runs first, in traced
  order, then the rest (the backward), as the partitioned graphs would run.
* **Storages.** Views alias their base, so bytes are counted per storage (identified on the fake tensors),
  named after the first node holding it; a node that only views or unpacks (``view``, ``t``, ``getitem``) is
  folded into the ops that read it.
* **Costs' raw inputs.** FLOPs and bytes touched per op, for the cost model.

Example::

    problem = build_problem(capture(model, (x,)))
    problem.saved_activations()     # what the backward needs from the forward
"""
from __future__ import annotations

import operator
import re
from typing import Any, Iterator

import torch
import torch.fx as fx

from karma_fx.errors import UnsupportedModelError
from karma_fx.passes.capture import CapturedStep
from karma_fx.passes.op_stats import is_random, node_bytes_accessed, node_dtype, node_flops
from karma_fx.problem import Op, Problem, Storage, describe_node
# The dependency queries live next to ``Problem`` (strategies ask them without importing the passes); they are
# re-exported here for the callers that always found them in this module.
from karma_fx.dependencies import dependency_graph, recompute_ops  # noqa: F401


def _forward_nodes(step: CapturedStep) -> set[fx.Node]:
    """Nodes the forward outputs depend on, plus every ``getitem`` unpacking a forward op's tuple.

    The unpacking of e.g. batch norm's saved mean lands in the forward, as in the partitioned forward graph
    that returns it as a saved tensor; otherwise the whole tuple (and its big output) would look alive until
    the backward unpacks it.
    """
    graph = step.joint.graph
    output = next(n for n in graph.nodes if n.op == "output")
    forward: set[fx.Node] = set()
    stack = [a for a in output.args[0][: step.num_fwd_outputs] if isinstance(a, fx.Node)]
    while stack:
        node = stack.pop()
        if node in forward or node.op != "call_function":
            continue
        forward.add(node)
        stack.extend(node.all_input_nodes)
    for node in list(forward):
        forward.update(u for u in node.users if u.target is operator.getitem)
    # A forward input the step writes its new value into (``copy_`` of a BatchNorm's running statistics, as
    # Inductor's graphs keep input mutations) is written in the forward: taken for a backward node, it was
    # written again by the backward graph, and every planned step counted two batches in those statistics.
    primals = {n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
    for node in graph.nodes:
        if node.op == "call_function" and is_mutating(node) and node.args and node.args[0] in primals:
            made = _made_from(node, forward | primals)
            if made is not None:
                forward.update(made)
    # What a rewrite put in the forward (swap-outs, buffer snapshots) runs there, as the partition places it,
    # though no forward output depends on it.
    forward.update(n for n in graph.nodes if "karma" in n.meta and n.meta.get("partitioner_tag") == "is_forward")
    return forward


def _made_from(node: fx.Node, known: set[fx.Node]) -> set[fx.Node] | None:
    """``node`` and what it is computed from beyond ``known``, or None where that reaches a graph input not in
    ``known`` (a tangent: a value of the backward)."""
    made: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in known or current in made:
            continue
        if current.op == "placeholder":
            return None
        if current.op != "call_function":
            continue  # a constant
        made.add(current)
        stack.extend(current.all_input_nodes)
    return made


def execution_order(step: CapturedStep) -> list[fx.Node]:
    """Call nodes in the order the step runs them: the forward, then the backward (each in traced order)."""
    forward = _forward_nodes(step)
    calls = [n for n in step.joint.graph.nodes if n.op == "call_function"]
    return [n for n in calls if n in forward] + [n for n in calls if n not in forward]


def forward_node_count(step: CapturedStep) -> int:
    """How many leading nodes of the execution order belong to the forward."""
    return len(_forward_nodes(step))


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """The tensors inside a node's ``meta['val']`` (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_of(v)


def storage_key(t: torch.Tensor) -> Any:
    """Identity of a tensor's storage, shared by all of its views (works on fake and real tensors)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def is_mutating(node: fx.Node) -> bool:
    """An op whose schema writes into one of its arguments (``copy_`` into a buffer, an in-place op)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


_ROOT = re.compile(r"""^(?:[LG]\[(['"]).*?\1\]\.?|L__self___?)""")
_INDEX = re.compile(r"""\[(['"]?)([^\]'"]*)\1\]""")
_GETATTR = re.compile(r"""getattr\(([^(),]+), (['"])([^'"]*)\2\)""")


def user_module_path(raw: str) -> str:
    """A module path as Dynamo records it (``L['self'].transformer.h[3].mlp``, ``getattr(L['self'].h, '0')``,
    ``L['model']._orig_mod.fc``) in the user's ``model.named_modules()`` terms: ``transformer.h.3.mlp``."""
    path = raw
    while "getattr(" in path:
        unwrapped = _GETATTR.sub(r"\1.\3", path)
        if unwrapped == path:
            break
        path = unwrapped
    path = _ROOT.sub("", path.replace("._modules[", "["))
    path = _INDEX.sub(r".\2", path)
    return ".".join(p for p in path.split(".") if p and p != "_orig_mod")


def _innermost(stack: Any, paths: dict[str, str]) -> str:
    """The innermost module of an ``nn_module_stack`` (outermost first: path key → (path, class)), in user
    terms; ``paths`` caches the translation, which thousands of nodes share."""
    if not stack:
        return ""
    value = next(reversed(stack.values()))
    raw = value[0] if isinstance(value, tuple) else str(value)
    if raw not in paths:
        paths[raw] = user_module_path(raw)
    return paths[raw]


def node_modules(graph: fx.Graph, forward: set[fx.Node]) -> dict[fx.Node, str]:
    """The module each call node ran in (``user_module_path``; "" when unknown), from the metadata AOTAutograd
    keeps: a forward node's ``nn_module_stack``; for a backward node, the stack of the forward node it
    differentiates (``fwd_nn_module_stack``), else of the first forward node with its autograd sequence number
    (``seq_nr``), as AOTAutograd itself matches them. Gradient accumulations (``is_gradient_acc``) sum what
    several forward uses sent back and belong to none of them. One pass, cached translations: cheap on
    3,000-node graphs."""
    paths: dict[str, str] = {}
    modules: dict[fx.Node, str] = {}
    by_seq: dict[int, str] = {}
    calls = [n for n in graph.nodes if n.op == "call_function"]
    for node in calls:
        if node in forward:
            module = modules[node] = _innermost(node.meta.get("nn_module_stack"), paths)
            seq = node.meta.get("seq_nr")
            if module and seq is not None:
                by_seq.setdefault(seq, module)
    for node in calls:
        meta = node.meta
        if node in forward:
            if not modules[node]:  # made by a pass (a split dropout) from a node with a stack
                modules[node] = by_seq.get(meta.get("seq_nr"), "")
            continue
        module = _innermost(meta.get("nn_module_stack"), paths) or _innermost(meta.get("fwd_nn_module_stack"), paths)
        if not module and not meta.get("is_gradient_acc"):
            module = by_seq.get(meta.get("seq_nr"), "")
        modules[node] = module
    return modules


_MAY_COPY = frozenset({"aten.reshape.default", "aten.flatten.using_ints", "aten.reshape_as.default"})
"""View ops by schema that copy where the input's strides do not allow a view."""


def aliased_base(node: fx.Node) -> fx.Node | None:
    """The input a view op's result aliases, whatever its traced value says: a functionalized graph's traced
    values may give a view a storage of its own (an in-place update of a transposed view, replayed as a
    ``permute`` of the updated tensor), which counted it a second time beside its base, as a 1 MiB buffer
    nothing allocates."""
    target = node.target
    if node.op != "call_function" or not getattr(target, "is_view", False) or str(target) in _MAY_COPY:
        return None
    base = node.args[0] if node.args else None
    return base if isinstance(base, fx.Node) else None


def build_problem(step: CapturedStep, name: str = "model") -> Problem:
    """The plain-data ``Problem`` for a captured step (see the module docstring)."""
    graph = step.joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    forward = _forward_nodes(step)
    calls = [n for n in graph.nodes if n.op == "call_function"]
    order = [n for n in calls if n in forward] + [n for n in calls if n not in forward]
    num_fwd_nodes = len(forward)
    modules = node_modules(graph, forward)

    key_to_name: dict[Any, str] = {}
    size: dict[str, int] = {}
    kind: dict[str, str] = {}
    producer_node: dict[str, fx.Node] = {}
    node_storages: dict[fx.Node, list[str]] = {}
    provisional: set[str] = set()

    def register(node: fx.Node, storage_kind: str | None) -> list[str]:
        names: list[str] = []
        val = node.meta.get("val")
        if val is None and node.op == "call_function":
            if node.target is operator.getitem or is_mutating(node):
                return []
            raise UnsupportedModelError(f"node {describe_node(node.name, str(node.target), modules.get(node, ''))} "
                                        "has no traced value; cannot plan it")
        many = not isinstance(val, torch.Tensor)
        base = aliased_base(node)
        for i, t in enumerate(tensors_of(val)):
            key = storage_key(t)
            if base is not None and key not in key_to_name and len(node_storages.get(base, ())) == 1:
                key_to_name[key] = node_storages[base][0]
            if key not in key_to_name:
                sname = f"{node.name}#{i}" if many else node.name
                key_to_name[key] = sname
                size[sname] = int(t.untyped_storage().nbytes())
                kind[sname] = storage_kind or "temp"
                producer_node[sname] = node
                if many:
                    provisional.add(sname)
            names.append(key_to_name[key])
        return names

    for i, ph in enumerate(placeholders):
        if ph.name.startswith("tangents"):
            pkind = "tangent"
        else:
            pkind = step.primal_kinds[i] if i < len(step.primal_kinds) else "input"
        node_storages[ph] = register(ph, pkind)
    for node in order:
        node_storages[node] = register(node, None)

    # Name storages of multi-output ops after the getitem that unpacks them, so plans key on node names.
    renames: dict[str, str] = {}
    for node in order:
        if node.target is operator.getitem and len(node_storages[node]) == 1:
            sname = node_storages[node][0]
            if sname in provisional and sname not in renames:
                renames[sname] = node.name
    if renames:
        def rn(s: str) -> str:
            return renames.get(s, s)
        node_storages = {n: [rn(s) for s in ss] for n, ss in node_storages.items()}
        size = {rn(s): v for s, v in size.items()}
        kind = {rn(s): v for s, v in kind.items()}
        producer_node = {rn(s): v for s, v in producer_node.items()}

    # Ops: call nodes that allocate or mutate; pure views and unpacking fold into their readers.
    op_nodes: list[fx.Node] = []
    created_by: dict[str, fx.Node] = {s: n for s, n in producer_node.items() if n.op == "call_function"}
    for node in order:
        makes = [s for s in node_storages[node] if created_by.get(s) is node]
        if node.target is operator.getitem:
            makes = []
        if makes or is_mutating(node):
            op_nodes.append(node)
    # A getitem never allocates: attribute storages of multi-output ops to the op itself.
    op_index = {n: i for i, n in enumerate(op_nodes)}
    num_fwd_ops = sum(1 for n in order[:num_fwd_nodes] if n in op_index)

    fwd_output_nodes = {a for a in output.args[0][: step.num_fwd_outputs] if isinstance(a, fx.Node)}
    grad_output_nodes = {a for a in output.args[0][step.num_fwd_outputs:] if isinstance(a, fx.Node)}
    output_storages: set[str] = set()
    for n in fwd_output_nodes | grad_output_nodes:
        output_storages.update(node_storages.get(n, []))
    grad_storages = {s for n in grad_output_nodes for s in node_storages.get(n, [])}

    users: dict[str, list[int]] = {s: [] for s in size}
    ops: list[Op] = []
    for i, node in enumerate(op_nodes):
        inputs: list[str] = []
        for arg in node.all_input_nodes:
            for s in node_storages.get(arg, []):
                if s not in inputs:
                    inputs.append(s)
        outputs = [s for s in node_storages[node] if created_by.get(s) is node]
        # Multi-output ops: their outputs' storages were registered on the op node itself.
        for s in inputs:
            users[s].append(i)
        phase = "fwd" if i < num_fwd_ops else "bwd"
        for s in outputs:
            if kind[s] == "temp":
                kind[s] = "gradient" if s in grad_storages else ("activation" if phase == "fwd" else "temp")
        ops.append(Op(
            name=node.name,
            target=str(node.target),
            phase=phase,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            flops=int(node_flops(node)),
            bytes_accessed=int(node_bytes_accessed(node)),
            dtype=node_dtype(node),
            random=bool(is_random(node)),
            mutates=is_mutating(node),
            module=modules[node],
        ))

    storages: list[Storage] = []
    for sname in size:
        pnode = producer_node[sname]
        if pnode.op == "placeholder":
            producer = None
        elif pnode in op_index:
            producer = op_index[pnode]
        else:
            continue  # allocated by nothing we execute (cannot happen for well-formed graphs)
        storages.append(Storage(
            name=sname,
            size_bytes=size[sname],
            kind=kind[sname],  # type: ignore[arg-type]
            producer=producer,
            users=tuple(sorted(set(users[sname]))),
            is_output=sname in output_storages,
            arrives_at=num_fwd_ops if kind[sname] == "tangent" else 0,
        ))
    aliases = tuple((n.name, s) for n, ss in node_storages.items() for s in ss[:1] if len(ss) == 1)
    return Problem(ops=tuple(ops), storages=tuple(storages), num_fwd_ops=num_fwd_ops,
                   cut_points=_cut_points(ops, storages, num_fwd_ops), aliases=aliases, name=name)


def _cut_points(ops: list[Op], storages: list[Storage], num_fwd_ops: int) -> tuple[int, ...]:
    """Forward ops after which later forward ops read no activation made before them.

    Only activations on the gradient path count: a causal mask or rotary table made once from the inputs and
    read by every layer does not tie the layers together (it stays resident, like an input).
    """
    on_grad_path = {s.name for s in storages if s.kind == "param"}
    for op in ops[:num_fwd_ops]:
        if any(s in on_grad_path for s in op.inputs):
            on_grad_path.update(op.outputs)
    producer = {s.name: s.producer for s in storages if s.producer is not None and s.name in on_grad_path}
    earliest_read = [
        min((producer[s] for s in op.inputs if s in producer), default=i) for i, op in enumerate(ops[:num_fwd_ops])
    ]
    cuts: list[int] = []
    suffix_min = num_fwd_ops
    for i in range(num_fwd_ops - 1, -1, -1):
        if suffix_min >= i and ops[i].outputs and any(s in on_grad_path for s in ops[i].outputs):
            cuts.append(i)
        suffix_min = min(suffix_min, earliest_read[i])
    return tuple(sorted(cuts))
