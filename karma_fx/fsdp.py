"""FSDP2's step on many GPUs, predicted: the single-device timeline plus each unit's all-gathers and
reduce-scatter, overlapped as FSDP2 overlaps them.

FSDP2 (``fully_shard`` on every transformer block, then on the root) keeps each rank's shard of every weight,
gradient and optimizer state. A unit's full weights are all-gathered before its forward and again before its
backward (``reshard_after_forward``, the default for every unit but the root, which stays gathered from its
forward to its backward), and its gradients are reduce-scattered once its backward is done. It prefetches one
unit ahead: the next unit's all-gather is issued as a unit starts computing, in the forward in execution order,
in the backward in reverse; the backward's first unit (resharded after its forward, as by default) is gathered
when the backward reaches it, unhidden. Compute waits for a unit's all-gather; the collectives share the network
one after another (``Cluster``'s hierarchical ring: all-gather and reduce-scatter each move half an all-reduce's
bytes).

Units are read off the ops' modules: a parameter belongs to the unit named by its first reader's module path up
to its first numbered component (``transformer.h.3``, ``model.layers.10``), as a block list is sharded;
parameters of no numbered module (embeddings, the final norm, a tied head) belong to the root. The optimizer
update of each rank's shard is counted as free, as ``cluster.parallel_step`` counts a device update.

Plain data over the ``Timeline`` that ``simulate`` returns, as ``karma_fx.cluster`` is.
"""
from __future__ import annotations

from dataclasses import dataclass

from karma_fx.cluster import Cluster, ParallelStep
from karma_fx.problem import Problem
from karma_fx.simulate import Interval, Timeline

ROOT = ""


def unit_of(module: str) -> str:
    """The FSDP2 unit of a module path: up to its first numbered component (``transformer.h.3.mlp`` ->
    ``transformer.h.3``), else the root."""
    parts = module.split(".") if module else []
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return ROOT


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard``ed module: its parameters' bytes, and the compute window of its forward and backward
    (the first and last op of each that ran in the unit's modules, as indices into the step's ops; a backward op
    carries its forward op's module)."""

    name: str
    param_bytes: int
    forward: tuple[int, int]
    backward: tuple[int, int] | None


def fsdp_units(problem: Problem) -> list[Unit]:
    """The step's FSDP2 units, the root first, then the blocks in forward order. The root's windows span the
    step: its weights are gathered first and its gradients reduce-scattered after the whole backward."""
    nf, n = problem.num_fwd_ops, len(problem.ops)
    param_bytes: dict[str, int] = {}
    for s in problem.storages:
        if s.kind == "param" and s.users:
            name = unit_of(problem.ops[min(s.users)].module)
            param_bytes[name] = param_bytes.get(name, 0) + s.size_bytes
    ops_of: dict[str, list[int]] = {}
    for k, op in enumerate(problem.ops):
        ops_of.setdefault(unit_of(op.module), []).append(k)
    units = []
    for name, size in param_bytes.items():
        if name == ROOT:
            units.append(Unit(ROOT, size, (0, max(nf - 1, 0)), (nf, n - 1) if nf < n else None))
            continue
        fwd = [k for k in ops_of.get(name, ()) if k < nf]
        bwd = [k for k in ops_of.get(name, ()) if k >= nf]
        if not fwd:
            continue
        units.append(Unit(name, size, (fwd[0], fwd[-1]), (bwd[0], bwd[-1]) if bwd else None))
    units.sort(key=lambda u: (u.name != ROOT, u.forward[0]))
    return units


def gather_us(cluster: Cluster, size_bytes: int) -> float:
    """One all-gather (or reduce-scatter) of a unit's ``size_bytes``: half an all-reduce's traffic."""
    return cluster.allreduce_us(size_bytes) / 2 if cluster.world_size > 1 else 0.0


def fsdp_step(problem: Problem, timeline: Timeline, cluster: Cluster) -> ParallelStep:
    """The FSDP2 step time of ``timeline`` (one rank's planned step) on ``cluster`` (see the module docstring):
    compute as planned, delayed wherever a unit's all-gather has not landed; the step ends when compute and the
    last reduce-scatter are done."""
    units = fsdp_units(problem)
    op_items = [iv for iv in timeline.compute if iv.kind == "op"]
    start = [iv.start_us for iv in op_items]
    end = [iv.end_us for iv in op_items]
    # events in the planned timeline, each at an op's start: (time, order, kind, unit)
    events: list[tuple[float, int, str, Unit]] = []
    for u in units:
        if u.name != ROOT:
            events.append((start[u.forward[0]], 1, "fwd", u))
            if u.backward is not None:
                events.append((start[u.backward[0]], 1, "bwd", u))
        if u.backward is not None:
            events.append((end[u.backward[1]], 2, "grads", u))
    events.sort(key=lambda e: (e[0], e[1]))
    fwd_order = [u for u in units if u.name != ROOT]
    bwd_order = sorted((u for u in units if u.name != ROOT and u.backward is not None),
                       key=lambda u: u.backward[0])
    net_free, delay = 0.0, 0.0
    network: list[Interval] = []
    landed: dict[tuple[str, str], float] = {}

    def collective(label: str, issue: float, size: int) -> float:
        nonlocal net_free
        us = gather_us(cluster, size)
        begin = max(issue, net_free)
        net_free = begin + us
        if us > 0:
            network.append(Interval(label, begin, net_free, "allgather" if "gather" in label else "reduce"))
        return net_free

    root = next((u for u in units if u.name == ROOT), None)
    if root is not None:
        landed[("fwd", ROOT)] = collective("gather root", 0.0, root.param_bytes)
        delay = max(delay, landed[("fwd", ROOT)])  # the root's weights come first (embeddings)
    if fwd_order:
        landed[("fwd", fwd_order[0].name)] = collective(f"gather {fwd_order[0].name}", 0.0, fwd_order[0].param_bytes)
    for t, _, kind, u in events:
        now = t + delay
        if kind in ("fwd", "bwd"):
            order = fwd_order if kind == "fwd" else bwd_order
            key = (kind, u.name)
            if key not in landed:  # not prefetched: issued when needed
                landed[key] = collective(f"gather {u.name}", now, u.param_bytes)
            if landed[key] > now:
                delay += landed[key] - now
                now = landed[key]
            k = order.index(u)
            if k + 1 < len(order):  # prefetch the next unit's weights as this one starts
                nxt = order[k + 1]
                landed[(kind, nxt.name)] = collective(f"gather {nxt.name}", now, nxt.param_bytes)
        else:
            collective(f"reduce {u.name}", now, u.param_bytes)
    step_end = max(timeline.makespan_us + delay, net_free)
    comm = sum(iv.end_us - iv.start_us for iv in network)
    return ParallelStep(step_time_us=step_end, single_step_us=timeline.makespan_us,
                        compute_us=timeline.compute_us + timeline.recompute_us,
                        copy_us=sum(iv.end_us - iv.start_us for iv in timeline.d2h + timeline.h2d),
                        allreduce_us=comm, host_update_us=0.0, buckets=len(units), allreduce=tuple(network))
