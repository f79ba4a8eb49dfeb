"""Anyone's graphs: read a training graph written as networkx node-link JSON, plan it, or generate one.

The format is the one rematerialization planners exchange (Checkmate, Moccasin): a JSON object with

* ``nodes``: objects with an ``id``, ``cost_cpu`` (the node's compute time, in time units), ``cost_ram`` (the
  bytes of the node's output), ``backward`` (true for nodes of the backward pass) and ``name``. Where no node
  has an ``id``, each node's ``name`` is its id (Moccasin's files);
* ``links`` (or ``edges``, as newer networkx writes it): objects with ``source`` and ``target`` ids, each a
  data dependency (the target reads the source's output); ``"0"`` and ``"1"`` stand for them where a graph
  was written with those link keys (Moccasin's files again);
* ``graph``: optional attributes. ``order`` lists the node ids in execution order; without it the ids are the
  execution order (integers ascending, or the order of ``nodes`` for other ids). ``cpu_tag`` and ``ram_tag``
  (Moccasin: ``node_duration_tag``, ``node_output_cost_tag``) name the node keys holding the time and the
  size, for graphs that use other names; without them ``cost_cpu`` / ``cost_ram`` are read, or ``duration`` /
  ``out_cost`` when no node has the former. Moccasin's parameter, input and edge costs
  (``node_param_cost_tag``, ``node_input_cost_tag``, ``edge_cost_tag``) are read to check that they are zero,
  as in every graph it ships: memory outside the nodes' outputs is not modelled, so a graph with any is
  refused rather than planned wrongly. ``source_node`` / ``target_node``, where given, must be the first and
  the last node in execution order. A graph whose nodes carry no ``backward`` flag at all is read as forward
  only (nothing then can be moved: general rematerialization is not modelled).

Mapping (``read_node_link``): node ``k`` in execution order is op ``k``, producing one storage of ``cost_ram``
bytes named like the op (the node's ``name``; ``name#id`` where names repeat); forward nodes must all come
before backward ones. A storage is an ``activation`` when a forward node makes it and a backward node reads
it (the candidates to recompute or offload), a ``temp`` otherwise; a storage no node reads (the last node's,
the gradients the step returns) is an output and lives to the end. The op's time is ``cost_cpu`` read as µs.

The memory model the simulator then applies: a node's output is allocated when the node runs and freed after
its last reader has run; while a node runs, its inputs and its output are all on the device; outputs stay
to the end. The budget bounds the sum of live outputs at every node.

Recompute only (``allow_offload=False``, the default here) is Checkmate's problem: the host link is ignored,
and every strategy only keeps or recomputes.

Example::

    prepared = prepare_graph("graph.json")                      # recompute only
    planned = prepared.plan(0.8, "cpsat", time_limit_s=10)
    print(planned.plan.table())
"""
from __future__ import annotations

import json
import math
import numbers
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Union

from karma_fx.costs import Costs
from karma_fx.errors import KarmaError
from karma_fx.problem import Op, Problem, Storage

if TYPE_CHECKING:
    from karma_fx.api import Prepared
    from karma_fx.device import DeviceSpec

__all__ = ["GraphFormatError", "ExternalGraph", "read_node_link", "from_node_link", "graph_costs", "prepare_graph",
           "random_layered_graph", "random_wide_graph"]

CPU_TAGS = ("cost_cpu", "duration")
RAM_TAGS = ("cost_ram", "out_cost")


class GraphFormatError(KarmaError, ValueError):
    """A node-link graph could not be read: a missing field, a bad value, a cycle, ids out of order."""


@dataclass(frozen=True)
class ExternalGraph:
    """A node-link graph as the planner sees it: the problem, each op's time (µs) and its node id."""

    problem: Problem
    op_time_us: tuple[float, ...]
    node_ids: tuple[Any, ...]


# ---- reading ----------------------------------------------------------------------------------------------
def _load(source: Union[str, Path, Mapping[str, Any]]) -> tuple[Mapping[str, Any], str]:
    if isinstance(source, Mapping):
        return source, "graph"
    if not isinstance(source, (str, Path)):
        raise GraphFormatError(f"a node-link graph is a dict or a path to a JSON file, got {type(source).__name__}")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise GraphFormatError(f"cannot read graph file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise GraphFormatError(f"graph file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass a "
                               "node-link JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GraphFormatError(f"graph file {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise GraphFormatError(f"graph file {path} is not a node-link graph: its JSON is nested too deeply to "
                               "read") from None
    if not isinstance(data, Mapping):
        raise GraphFormatError(f"graph file {path} holds a JSON {type(data).__name__}, not a node-link object")
    return data, path.stem


MAX_TOTAL_TIME = 1e15
"""Largest sum of the nodes' times (µs, or any time unit): the CP-SAT models count time in integers of
0.1 µs (int64), and a plan may run every node twice; 1e15 µs is 31 years of compute."""
MAX_TOTAL_BYTES = 2 ** 53
"""Largest sum of the nodes' output sizes (8 PiB): beyond it byte counts are no longer exact as floats, and
the planner's sums and tables would be silently wrong."""


def _number(node: Mapping[str, Any], key: str, what: str, node_id: Any, limit: float, unit: str) -> float:
    """``node[key]`` as a float in ``[0, limit]``, or a ``GraphFormatError`` naming the node and the key."""
    if key not in node:
        raise GraphFormatError(f"node {node_id!r} has no {key!r} ({what})")
    value = node[key]
    shown = f"{value!r:.40}"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise GraphFormatError(f"node {node_id!r}: {key} must be a finite number, got {shown}")
    if isinstance(value, numbers.Integral):  # exact: an int too large for a float must not raise OverflowError
        if value < 0:
            raise GraphFormatError(f"node {node_id!r}: {key} must not be negative, got {shown}")
        if value > limit:
            raise GraphFormatError(f"node {node_id!r}: {key} {shown} is out of range (at most {limit:g} {unit})")
        return float(value)
    if not math.isfinite(value):
        raise GraphFormatError(f"node {node_id!r}: {key} must be a finite number, got {shown}")
    if value < 0:
        raise GraphFormatError(f"node {node_id!r}: {key} must not be negative, got {shown}")
    if value > limit:
        raise GraphFormatError(f"node {node_id!r}: {key} {shown} is out of range (at most {limit:g} {unit})")
    return float(value)


def _costs(by_id: Mapping[Any, Mapping[str, Any]], order: list, key: str, what: str, limit: float,
           unit: str) -> list[float]:
    """Every node's ``key`` in execution order, each and their sum at most ``limit``."""
    values = [_number(by_id[i], key, what, i, limit, unit) for i in order]
    total = sum(values)
    if total > limit:
        raise GraphFormatError(f"the nodes' {key} values add up to {total:g} {unit}, more than the {limit:g} "
                               f"{unit} the planner can count exactly; check the graph's units")
    return values


def _tag(graph_attrs: Mapping[str, Any], nodes: list, attrs: tuple[str, ...], defaults: tuple[str, str]) -> str:
    """The node key named by the first of ``attrs`` the graph has, else the first of ``defaults`` any node has
    (or the second, where only it appears)."""
    for attr in attrs:
        if attr in graph_attrs:
            tag = graph_attrs[attr]
            if not isinstance(tag, str):
                raise GraphFormatError(f"graph attribute {attr} must name a node key, got {tag!r}")
            return tag
    first, second = defaults
    return first if any(first in n for n in nodes) or not any(second in n for n in nodes) else second


def _link_ends(link: Any) -> tuple[Any, Any] | None:
    """A link's (source, target): keyed ``source`` / ``target``, or ``"0"`` / ``"1"`` as networkx writes a graph
    whose link keys were given as 0 and 1; None when it is neither."""
    if not isinstance(link, Mapping):
        return None
    for s_key, t_key in (("source", "target"), ("0", "1")):
        if s_key in link and t_key in link:
            return link[s_key], link[t_key]
    return None


OTHER_COSTS = (("node_param_cost_tag", "param_cost", "its parameters' bytes"),
               ("node_input_cost_tag", "input_cost", "its inputs' bytes"))
"""Moccasin's graph attributes naming node costs besides the output, with the key each names by default."""


def _refuse_other_costs(attrs: Mapping[str, Any], nodes: list, links: list, id_key: str) -> None:
    """Refuse a graph that gives memory outside the nodes' outputs (parameter, input or edge costs) anything but
    zero: the memory model here counts outputs only, and a plan made without them would not fit."""
    for attr, default, what in OTHER_COSTS:
        key = attrs.get(attr, default)
        for n in nodes:
            value = n.get(key, 0) if isinstance(key, str) else 0
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0:
                continue
            raise GraphFormatError(f"node {n[id_key]!r} has {key} {value!r:.40} ({what}): only the bytes of each "
                                   "node's output are modelled, so a graph with other memory costs is not read")
    edge_key = attrs.get("edge_cost_tag", "edge_cost")
    for k, link in enumerate(links):
        value = link.get(edge_key, 0) if isinstance(link, Mapping) and isinstance(edge_key, str) else 0
        if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0):
            raise GraphFormatError(f"links[{k}] has {edge_key} {value!r:.40}: only the bytes of each node's output "
                                   "are modelled, so a graph with edge costs is not read")


def _find_cycle(ids: list, succ: dict) -> list | None:
    """A cycle among the nodes (as a list of ids), or None: Kahn's algorithm, then a walk inside what is left."""
    indegree = {v: 0 for v in ids}
    for v in ids:
        for w in succ[v]:
            indegree[w] += 1
    ready = [v for v in ids if indegree[v] == 0]
    while ready:
        v = ready.pop()
        for w in succ[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.append(w)
    left = [v for v in ids if indegree[v] > 0]
    if not left:
        return None
    pred: dict = {v: [] for v in left}
    for v in left:
        for w in succ[v]:
            if w in pred:
                pred[w].append(v)
    v, path, seen = left[0], [], {}
    while v not in seen:  # every node left has a predecessor left: walk back until a node repeats
        seen[v] = len(path)
        path.append(v)
        v = pred[v][0]
    return (path[seen[v]:] + [v])[::-1]


def read_node_link(source: Union[str, Path, Mapping[str, Any]], *, name: str | None = None) -> ExternalGraph:
    """Read a node-link training graph (a dict, or a path to its JSON file) into an ``ExternalGraph``.

    Raises ``GraphFormatError`` naming the first problem: a missing field, a negative or non-numeric cost,
    an unknown or repeated id, a cycle, a link from a later node to an earlier one (ids not in execution
    order), a forward node after a backward one."""
    data, stem = _load(source)
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise GraphFormatError("a node-link graph needs a non-empty 'nodes' list")
    links = data.get("links", data.get("edges"))
    if links is None:
        raise GraphFormatError("a node-link graph needs a 'links' list (or 'edges'), even an empty one")
    if not isinstance(links, list):
        raise GraphFormatError(f"'links' must be a list, got {type(links).__name__}")
    attrs = data.get("graph") or {}
    if not isinstance(attrs, Mapping):
        raise GraphFormatError(f"'graph' attributes must be an object, got {type(attrs).__name__}")
    for k, node in enumerate(nodes):
        if not isinstance(node, Mapping):
            raise GraphFormatError(f"nodes[{k}] must be an object, got {type(node).__name__}")
    id_key = "id" if any("id" in n for n in nodes) or not all("name" in n for n in nodes) else "name"
    for k, node in enumerate(nodes):
        if id_key not in node:
            raise GraphFormatError(f"nodes[{k}] has no 'id'" + (" (other nodes have one)" if k else ""))
    cpu_tag = _tag(attrs, nodes, ("cpu_tag", "node_duration_tag"), CPU_TAGS)
    ram_tag = _tag(attrs, nodes, ("ram_tag", "node_output_cost_tag"), RAM_TAGS)
    by_id: dict[Any, Mapping[str, Any]] = {}
    for node in nodes:
        node_id = node[id_key]
        if not isinstance(node_id, (str, int)) or isinstance(node_id, bool):
            raise GraphFormatError(f"node ids must be integers or strings, got {node_id!r}")
        if node_id in by_id:
            raise GraphFormatError(f"node id {node_id!r} appears twice")
        by_id[node_id] = node
    flagged = [n for n in nodes if "backward" in n]
    if flagged and len(flagged) < len(nodes):
        missing = next(n[id_key] for n in nodes if "backward" not in n)
        raise GraphFormatError(f"node {missing!r} has no 'backward' flag (other nodes have one)")
    for n in nodes:
        label = n.get("name")
        if label is not None and (not isinstance(label, (str, int, float)) or isinstance(label, bool)):
            raise GraphFormatError(f"node {n[id_key]!r}: name must be a string, got {type(label).__name__}")
    for n in flagged:
        if not isinstance(n["backward"], bool):
            raise GraphFormatError(f"node {n[id_key]!r}: backward must be true or false, got {n['backward']!r}")
    _refuse_other_costs(attrs, nodes, links, id_key)

    # Execution order.
    if "order" in attrs:
        order = attrs["order"]
        if not isinstance(order, list) or sorted(map(repr, order)) != sorted(map(repr, by_id)):
            raise GraphFormatError("graph attribute 'order' must list every node id exactly once")
    elif all(isinstance(i, int) for i in by_id):
        order = sorted(by_id)
    else:
        order = [n[id_key] for n in nodes]
    position = {node_id: k for k, node_id in enumerate(order)}

    succ: dict[Any, list] = {i: [] for i in by_id}
    pred: dict[Any, list] = {i: [] for i in by_id}
    for k, link in enumerate(links):
        ends = _link_ends(link)
        if ends is None:
            raise GraphFormatError(f"links[{k}] needs a 'source' and a 'target'")
        s, t = ends
        for end in (s, t):
            if not isinstance(end, (str, int)) or isinstance(end, bool) or end not in by_id:
                raise GraphFormatError(f"links[{k}] refers to unknown node {end!r}")
        if t not in succ[s]:
            succ[s].append(t)
            pred[t].append(s)
    cycle = _find_cycle(order, succ)
    if cycle is not None:
        raise GraphFormatError(f"the graph has a cycle: {' -> '.join(map(repr, cycle))}")
    for s in order:
        for t in succ[s]:
            if position[t] < position[s]:
                raise GraphFormatError(f"link {s!r} -> {t!r} goes from a later node to an earlier one: node ids "
                                       "must be in execution order (or give the graph an 'order' attribute)")
    for attr, at in (("source_node", 0), ("target_node", -1)):
        if attr in attrs and repr(attrs[attr]) != repr(order[at]):
            raise GraphFormatError(f"graph attribute {attr} is {attrs[attr]!r}, but the {'first' if at == 0 else 'last'}"
                                   f" node in execution order is {order[at]!r}")
    backward = [bool(by_id[i].get("backward", False)) for i in order]
    if any(b and not later for b, later in zip(backward, backward[1:])):
        k = next(k for k in range(len(order) - 1) if backward[k] and not backward[k + 1])
        raise GraphFormatError(f"forward node {order[k + 1]!r} runs after backward node {order[k]!r}: every forward "
                               "node must come before the backward ones")

    # Names: the node's name, made unique with its id where names repeat.
    raw = [str(by_id[i].get("name", i)) for i in order]
    counts: dict[str, int] = {}
    for r in raw:
        counts[r] = counts.get(r, 0) + 1
    names = [r if counts[r] == 1 else f"{r}#{i}" for r, i in zip(raw, order)]
    if len(set(names)) != len(names):
        names = [f"{r}#{i}" for r, i in zip(raw, order)]

    times = tuple(_costs(by_id, order, cpu_tag, "its compute time", MAX_TOTAL_TIME, "time units"))
    sizes = _costs(by_id, order, ram_tag, "the bytes of its output", MAX_TOTAL_BYTES, "bytes")
    num_fwd = sum(1 for b in backward if not b)
    ops, storages = [], []
    for k, node_id in enumerate(order):
        inputs = tuple(names[j] for j in sorted(position[p] for p in pred[node_id]))
        ops.append(Op(name=names[k], target=str(by_id[node_id].get("name", "node")),
                      phase="bwd" if backward[k] else "fwd", inputs=inputs, outputs=(names[k],)))
    for k, node_id in enumerate(order):
        users = tuple(sorted(position[t] for t in succ[node_id]))
        saved = k < num_fwd and any(u >= num_fwd for u in users)
        storages.append(Storage(name=names[k], size_bytes=int(round(sizes[k])), kind="activation" if saved else "temp",
                                producer=k, users=users, is_output=not users))
    label = name or str(attrs.get("name") or stem)
    problem = Problem(ops=tuple(ops), storages=tuple(storages), num_fwd_ops=num_fwd,
                      cut_points=_cut_points(ops, num_fwd), name=label)
    return ExternalGraph(problem=problem, op_time_us=times, node_ids=tuple(order))


def from_node_link(source: Union[str, Path, Mapping[str, Any]], *, name: str | None = None) -> Problem:
    """The ``Problem`` of a node-link training graph (a dict, or a path to its file): ``read_node_link``'s
    problem without its node times (``graph_costs`` or ``prepare_graph`` use those). It lives here, not in
    ``problem.py``, so the plain-data ``Problem`` depends on no reader. Raises ``GraphFormatError``."""
    return read_node_link(source, name=name).problem


def _cut_points(ops: list[Op], num_fwd: int) -> tuple[int, ...]:
    """Forward ops ``c`` after which no later forward op reads an output made before ``c``."""
    producer = {op.outputs[0]: k for k, op in enumerate(ops[:num_fwd])}
    earliest = [min((producer[s] for s in op.inputs if s in producer), default=k) for k, op in enumerate(ops[:num_fwd])]
    cuts, suffix_min = [], num_fwd
    for c in range(num_fwd - 1, -1, -1):
        if suffix_min >= c:
            cuts.append(c)
        suffix_min = min(suffix_min, earliest[c])
    return tuple(sorted(cuts))


# ---- costs and planning -----------------------------------------------------------------------------------
def graph_costs(graph: ExternalGraph, device: "DeviceSpec | str | None" = None, *,
                allow_offload: bool = False) -> Costs:
    """The graph's own node times as op times (µs), with ``device``'s host link (default h100) for copies;
    ``allow_offload=False`` (the default) plans recompute only, so the link is never used."""
    from karma_fx.device import get_device

    try:
        spec = get_device(device)
    except ValueError as exc:
        raise KarmaError(str(exc)) from None
    return Costs(op_time_us=graph.op_time_us, d2h_bytes_per_us=spec.d2h_bytes_per_s / 1e6,
                 h2d_bytes_per_us=spec.h2d_bytes_per_s / 1e6, copy_latency_us=spec.copy_latency_us,
                 device=spec.name if allow_offload else f"{spec.name}, recompute only", allow_offload=allow_offload)


def prepare_graph(source: Union[str, Path, Mapping[str, Any], ExternalGraph], *,
                  device: "DeviceSpec | str | None" = None, allow_offload: bool = False,
                  name: str | None = None) -> "Prepared":
    """A node-link graph ready to plan at any budget with any strategy (``Prepared.plan``); budgets that are
    fractions are of the graph's unplanned peak."""
    from karma_fx.api import Prepared
    from karma_fx.simulate import simulate

    graph = source if isinstance(source, ExternalGraph) else read_node_link(source, name=name)
    costs = graph_costs(graph, device, allow_offload=allow_offload)
    return Prepared(problem=graph.problem, costs=costs, keep=simulate(graph.problem, (), costs))


# ---- random layered graphs --------------------------------------------------------------------------------
def random_layered_graph(n_nodes: int, seed: int, *, max_width: int = 4, edge_prob: float = 0.15,
                         max_skip: int = 2, time_range: tuple[int, int] = (1, 100),
                         size_range_mib: tuple[int, int] = (1, 64), backward_time_factor: float = 2.0,
                         backward: bool = True) -> dict[str, Any]:
    """A random layered training graph of about ``n_nodes`` nodes as a node-link dict (the format
    ``read_node_link`` reads), the same for the same arguments.

    Forward: ``n_nodes // 2`` nodes in layers of random width (1 to ``max_width``) ending in one loss node;
    each node reads one random node of the layer before, and each node of the ``max_skip`` layers before
    with probability ``edge_prob / distance``; every node is read by the next layer. Times are random
    integers in ``time_range``, sizes random whole MiB in ``size_range_mib``. Backward: a mirror, one node
    per forward node in reverse order, reading that node, its forward inputs and the backward nodes of its
    readers (as a gradient does); it takes ``backward_time_factor`` times as long and is as large.

    ``backward=False``: ``n_nodes`` forward nodes and no mirror, written as Moccasin writes its random layered
    graphs (no ids, the name is the id; links keyed ``"0"`` / ``"1"``; graph attributes naming the cost keys;
    a source, a target and an order): the general rematerialization problem, planned by ``remat``."""
    if not isinstance(n_nodes, int) or n_nodes < 4:
        raise KarmaError(f"n_nodes must be an integer of at least 4, got {n_nodes!r}")
    if max_width < 1 or max_skip < 1 or not 0 <= edge_prob <= 1:
        raise KarmaError("max_width and max_skip must be at least 1 and edge_prob in [0, 1]")
    rng = random.Random(seed)
    n_fwd = n_nodes // 2 if backward else n_nodes
    layers: list[list[int]] = []
    left, nxt = n_fwd - 1, 0
    while left > 0:
        width = rng.randint(1, min(max_width, left))
        layers.append(list(range(nxt, nxt + width)))
        nxt += width
        left -= width
    layers.append([nxt])  # the loss
    preds: dict[int, set[int]] = {v: set() for v in range(n_fwd)}
    for depth in range(1, len(layers)):
        for v in layers[depth]:
            preds[v].add(rng.choice(layers[depth - 1]))
            for back in range(1, min(max_skip, depth) + 1):
                for u in layers[depth - back]:
                    if rng.random() < edge_prob / back:
                        preds[v].add(u)
        readers = {u for v in layers[depth] for u in preds[v]}
        for u in layers[depth - 1]:
            if u not in readers:
                preds[rng.choice(layers[depth])].add(u)
    times = [rng.randint(*time_range) for _ in range(n_fwd)]
    sizes = [rng.randint(*size_range_mib) * 2 ** 20 for _ in range(n_fwd)]
    succs: dict[int, set[int]] = {v: set() for v in range(n_fwd)}
    for v, ps in preds.items():
        for u in ps:
            succs[u].add(v)

    if not backward:
        return {"directed": True, "multigraph": False,
                "graph": {"name": f"layered-forward-{n_fwd}-s{seed}", "seed": seed, "source_node": 0,
                          "target_node": n_fwd - 1, "node_duration_tag": "duration",
                          "node_output_cost_tag": "out_cost", "node_param_cost_tag": "param_cost",
                          "order": list(range(n_fwd))},
                "nodes": [{"name": v, "duration": times[v], "out_cost": sizes[v], "param_cost": 0}
                          for v in range(n_fwd)],
                "links": [{"0": u, "1": v} for v in range(n_fwd) for u in sorted(preds[v])]}

    def bwd(v: int) -> int:
        return n_fwd + (n_fwd - 1 - v)

    nodes = [{"id": v, "name": f"f{v}", "cost_cpu": times[v], "cost_ram": sizes[v], "backward": False}
             for v in range(n_fwd)]
    nodes += [{"id": bwd(v), "name": f"b{v}", "cost_cpu": round(backward_time_factor * times[v], 3),
               "cost_ram": sizes[v], "backward": True} for v in reversed(range(n_fwd))]
    links = [(u, v) for v in range(n_fwd) for u in sorted(preds[v])]
    for v in reversed(range(n_fwd)):
        links += [(v, bwd(v))] + [(u, bwd(v)) for u in sorted(preds[v])] + [(bwd(w), bwd(v)) for w in sorted(succs[v])]
    return {"directed": True, "multigraph": False,
            "graph": {"name": f"layered-{2 * n_fwd}-s{seed}", "seed": seed},
            "nodes": nodes, "links": [{"source": s, "target": t} for s, t in links]}


def random_wide_graph(n_nodes: int, seed: int, *, width: float = 0.3, skip: float = 0.14) -> dict[str, Any]:
    """A random graph without a backward shaped like Moccasin's random layered graphs, as a node-link dict in
    their format (no ids, links keyed ``"0"`` / ``"1"``, the cost keys named by graph attributes, a source, a
    target and an order), the same for the same arguments.

    Where ``random_layered_graph(backward=False)`` makes narrow chains (a node reads two or three others, so
    each op's own inputs are most of the peak and nothing can lower it much), Moccasin's graphs are wide and
    long-ranged, which is what makes rematerialization pay. Here: a source (node 0, no time) read by the first
    layer, then layers of random width up to ``width`` x 3.3 x sqrt(``n_nodes``) (10 nodes at 100 nodes, 31
    at 1000; Moccasin's files of those sizes have 9 and 33); each node reads the nodes of the layer before at its
    scaled position and the two beside it (each of those with probability 0.7), every node is read by the next
    layer, and with probability ``skip`` a node is also read by a random node two or more layers later. The
    last layer is read by the target (node 1, no time). Times are random integers from 1 to 1000, sizes random
    multiples of 10 from 10 to 6200; the execution order interleaves neighbouring layers, as theirs do."""
    if not isinstance(n_nodes, int) or n_nodes < 4:
        raise KarmaError(f"n_nodes must be an integer of at least 4, got {n_nodes!r}")
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (width, skip)) or not (
            0 < width and 0 <= skip <= 1):
        raise KarmaError(f"width must be a positive number and skip a number in [0, 1], got {width!r} and {skip!r}")
    rng = random.Random(seed)
    widest = max(2, round(width * 3.3 * math.sqrt(n_nodes)))
    layers, nxt, left = [[0]], 2, n_nodes - 2
    while left > 0:
        size = min(left, rng.randint(1, widest))
        layers.append(list(range(nxt, nxt + size)))
        nxt, left = nxt + size, left - size
    layers.append([1])
    preds: dict[int, set[int]] = {v: set() for v in range(n_nodes)}
    for depth in range(1, len(layers)):
        before, here = layers[depth - 1], layers[depth]
        for k, v in enumerate(here):
            centre = min(len(before) - 1, int((k + 0.5) / len(here) * len(before)))
            preds[v].add(before[centre])
            for u in before[max(0, centre - 1):centre + 2]:
                if rng.random() < 0.7:
                    preds[v].add(u)
        for u in before:
            if not any(u in preds[v] for v in here):
                preds[rng.choice(here)].add(u)
    depth_of = {v: d for d, layer in enumerate(layers) for v in layer}
    for d, layer in enumerate(layers[1:-1], start=1):
        later = [v for layer_after in layers[d + 2:-1] for v in layer_after]
        for v in layer:
            if later and rng.random() < skip:
                preds[rng.choice(later)].add(v)
    jitter = {v: depth_of[v] + 1.5 * rng.random() for v in range(n_nodes)}
    waiting = {v: len(preds[v]) for v in range(n_nodes)}
    readers: dict[int, list[int]] = {v: [] for v in range(n_nodes)}
    for v, ps in preds.items():
        for u in ps:
            readers[u].append(v)
    order, ready = [], [(jitter[0], 0)]
    while ready:  # a topological order, by jittered depth among the nodes whose inputs are made
        ready.sort(reverse=True)
        _, v = ready.pop()
        order.append(v)
        for w in readers[v]:
            waiting[w] -= 1
            if not waiting[w]:
                ready.append((jitter[w], w))
    sizes = [10 * rng.randint(1, 620) for _ in range(n_nodes)]
    times = [0, 0] + [rng.randint(1, 1000) for _ in range(n_nodes - 2)]
    return {"directed": True, "multigraph": False,
            "graph": {"name": f"wide-{n_nodes}-s{seed}", "seed": seed, "source_node": 0, "target_node": 1,
                      "node_duration_tag": "duration", "node_output_cost_tag": "out_cost",
                      "node_param_cost_tag": "param_cost", "order": order},
            "nodes": [{"name": v, "duration": times[v], "out_cost": sizes[v], "param_cost": 0}
                      for v in range(n_nodes)],
            "links": [{"0": u, "1": v} for v in range(n_nodes) for u in sorted(preds[v])]}
