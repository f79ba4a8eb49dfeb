"""Dependency queries over a ``Problem``: what must re-run to rebuild a storage.

They sit next to ``Problem`` (plain data in, plain data out) so the strategies can ask them without importing
the graph passes: a strategy plans any ``Problem``, captured or hand-built, and never needs ``torch.fx``.

Example::

    graph = dependency_graph(problem)
    recompute_ops(problem, ["relu_1"], resident={"x", "w"}, graph=graph)   # -> (0, 1): op indices, in order
"""
from __future__ import annotations

from typing import Container

import networkx as nx

from karma_fx.problem import Problem


def dependency_graph(problem: Problem) -> nx.DiGraph:
    """Bipartite DiGraph: storage → op that reads it, op → storage it makes (nodes ``("s", name)``/``("o", i)``)."""
    g = nx.DiGraph()
    for i, op in enumerate(problem.ops):
        g.add_node(("o", i))
        for s in op.inputs:
            g.add_edge(("s", s), ("o", i))
        for s in op.outputs:
            g.add_edge(("o", i), ("s", s))
    return g


def recompute_ops(problem: Problem, targets: list[str] | tuple[str, ...], resident: Container[str],
                  graph: nx.DiGraph | None = None, max_ops: int | None = None) -> tuple[int, ...]:
    """The ops to re-run, in execution order, to rebuild ``targets`` from the ``resident`` storages.

    Raises ``ValueError`` if that needs an op that must not run twice (random, mutating), a graph input that
    is not resident, or more than ``max_ops`` ops (the walk stops there).
    """
    g = graph if graph is not None else dependency_graph(problem)
    # Walk producers backwards from each target and stop at resident storages: the work is proportional to
    # the chain, not the graph (a filtered networkx view would re-count the whole graph at every step).
    needed: set[int] = set()
    seen: set[tuple[str, object]] = set()
    stack = [("s", t) for t in targets if t not in resident]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node[0] == "s":
            if node[1] in resident:
                continue
            if problem.storage(node[1]).producer is None:
                raise ValueError(f"rebuilding {list(targets)} needs graph input {node[1]}, which is not resident")
        else:
            needed.add(node[1])
            if max_ops is not None and len(needed) > max_ops:
                raise ValueError(f"rebuilding {list(targets)} needs more than {max_ops} ops")
        stack.extend(g.predecessors(node))
    for i in needed:
        if not problem.ops[i].recomputable:
            raise ValueError(f"rebuilding {targets} would re-run {problem.ops[i].name} "
                             f"({'random' if problem.ops[i].random else 'mutating'})")
    return tuple(sorted(needed))
