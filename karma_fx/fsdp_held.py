"""What FSDP2 holds on a rank that no trace of the step shows when it is freed: its collective buffers.

FSDP2 reduce-scatters each unit's gradients as its backward ends, from one buffer of the unit's full (unsharded)
gradients, and keeps that buffer until the collective is done (``reduce_scatter_max_input_buffers`` of them, one
by default); it all-gathers each unit's weights one unit ahead, from a copy of the rank's shard into a buffer of
the full unit. When those buffers are freed, and when gloo's worker threads (two by default) make and drop their
own unit-sized copies, is decided by the collectives, not by the program. On this CPU with gloo (two ranks, a
4-block model, units of 132,352 B, the same plan every run, ``compiler="eager"``) a steady step peaked
134,920 B above its plan in six runs of ten and 203,656 B to 336,008 B in the others; on a CI machine the same
step peaked 468,360 B above it (three and a half units) and broke the budget by 1%. The session measures steps
to learn what its model misses (``karma_fx.margin``), but it learns from the lower of two readings, and a
buffer late now and then is not learnt. So every plan counts them held all step: the full gradients of as
many of the largest units as reduce-scatter inputs are kept in flight, the largest unit once more per collective
worker thread, and its shard for an all-gather's copy-in.

What it gathers is counted where it lives (``gathered``): a unit's unsharded parameters in the footprints of the
runs that read them, one unit gathered ahead all step, and a unit's gradients as its shards.

Units are the modules ``fully_shard`` was applied to, each with the parameters under it that no inner unit
owns; a distributed tensor's ``numel`` is its full size. The modules are found through the registry FSDP2 (like
every composable API) records them in, as the compile doors see graphs, not the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.nn as nn


def _registry() -> Any:
    """The registry of modules composable APIs (``fully_shard``, ``replicate``) were applied to; None without
    torch.distributed."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # a build without torch.distributed
        return None
    return _module_state_mapping


def registered() -> int:
    """How many modules the registry holds now: cheap to read each step, and what changes when a model is
    sharded."""
    registry = _registry()
    return 0 if registry is None else len(registry)


def fsdp_units() -> list[nn.Module]:
    """The live modules ``fully_shard`` was applied to in this process (none without torch.distributed)."""
    registry = _registry()
    if registry is None:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in list(registry.keys()) if isinstance(m, FSDPModule)]


def _own_parameters(unit: nn.Module, units: set[int]) -> Iterator[nn.Parameter]:
    """The parameters of ``unit`` that no inner unit owns."""
    yield from unit.parameters(recurse=False)
    for child in unit.children():
        if id(child) not in units:
            yield from _own_parameters(child, units)


def _buffers_in_flight(units: list[nn.Module]) -> int:
    """How many reduce-scatter input buffers FSDP2 keeps in flight: one by default; the highest any unit asks
    for (torch 2.13 keeps one list of them for every unit, as many as the highest cap)."""
    cap = 1
    for unit in units:
        try:
            groups = unit._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator, attr-defined]
        except Exception:  # another torch's private layout: FSDP2's default
            continue
        for group in groups:
            cap = max(cap, int(getattr(group, "reduce_scatter_max_input_buffers", 1) or 1))
    return cap


def in_flight_bytes(units: list[nn.Module] | None = None) -> int:
    """The bytes of collective buffers FSDP2 may hold beyond what the step's trace shows: the full gradients of
    as many of the largest units as reduce-scatter inputs are kept in flight, the largest unit once more per
    thread that runs collectives, and its shard for an all-gather's copy-in; 0 where nothing is sharded."""
    units = fsdp_units() if units is None else units
    if not units:
        return 0
    ids = {id(u) for u in units}
    world, workers = _collectives()
    full = sorted((sum(p.numel() * p.element_size() for p in _own_parameters(u, ids) if p.requires_grad)
                   for u in units), reverse=True)
    return sum(full[:_buffers_in_flight(units)]) + full[0] * workers + full[0] // world


def _collectives() -> tuple[int, int]:
    """(the ranks, the threads that run collectives on a rank): gloo's worker threads (its default, two); one
    for any other backend; one rank where no process group is set up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 1
    if "gloo" not in str(dist.get_backend()):  # ("cpu:gloo,cuda:nccl": gloo's threads on a CPU)
        return dist.get_world_size(), 1
    options = getattr(dist.ProcessGroupGloo, "_Options", None)
    return dist.get_world_size(), max(1, int(getattr(options(), "_threads", 2))) if options else 2


@dataclass(frozen=True)
class Gathered:
    """How FSDP2 holds its parameters around a step, by the ids of the unsharded parameters it hands the runs.

    A unit that reshards after its forward (every unit but the root, by default) gathers its parameters for its
    forward, frees them after it, and gathers them again for its backward, one unit ahead of the backward
    (implicit prefetch). So the step does not hold them all through: a run holds its own unit's while it runs,
    and one unit more may be gathered beside it. Counting every unit's as held all step counted the whole
    unsharded model on each rank (the sharding undone, in the step's accounting). The gradients a unit's
    backward leaves are its shards (the full ones are reduce-scattered and freed as the backward ends)."""

    freed: frozenset[int] = frozenset()
    """ids of the unsharded parameters of units that free them after their forward."""
    shard_bytes: dict[int, int] = field(default_factory=dict)
    """id of an unsharded parameter -> the bytes of its shard on this rank (what its gradient leaves)."""
    ahead_bytes: int = 0
    """The largest such unit's unsharded bytes: what may be gathered ahead of the run that reads it."""


def gathered(units: list[nn.Module] | None = None) -> Gathered:
    """What FSDP2's units gathered so far (a unit's unsharded parameters exist from its first all-gather on),
    and the allowance for a unit gathered ahead; empty where nothing is sharded."""
    units = fsdp_units() if units is None else units
    freed: set[int] = set()
    shard_bytes: dict[int, int] = {}
    ahead = 0
    for unit in units:
        try:
            groups = unit._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator, attr-defined]
        except Exception:  # another torch's private layout: nothing known, every gathered weight held all step
            continue
        for group in groups:
            frees = getattr(group, "post_forward_mesh_info", None) is not None
            full = 0
            for param in getattr(group, "fsdp_params", ()):
                sharded = getattr(param, "sharded_param", None)
                if sharded is None:
                    continue
                full += sharded.numel() * sharded.element_size()  # a distributed tensor's numel: its full size
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is None:  # not gathered yet
                    continue
                local = getattr(sharded, "_local_tensor", sharded)
                shard_bytes[id(unsharded)] = local.numel() * local.element_size()
                if frees:
                    freed.add(id(unsharded))
            if frees:
                ahead = max(ahead, full)
    return Gathered(frozenset(freed), shard_bytes, ahead)
