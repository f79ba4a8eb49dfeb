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
runs that read them, one unit gathered ahead all step, and a unit's gradients as its shards; what it holds at a
step's start is read afresh each step (``held_now``).

Units are the modules ``fully_shard`` was applied to, each with the parameters under it that no inner unit
owns; a distributed tensor's ``numel`` is its full size. The modules are found through the registry FSDP2 (like
every composable API) records them in, as the compile doors see graphs, not the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
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
    (implicit prefetch). So the step does not hold them all through: a run that reads all of a unit's
    parameters holds them while it runs, and one unit more may be gathered beside it. Counting every unit's as
    held all step counted the whole unsharded model on each rank (the sharding undone, in the step's
    accounting). Only a unit that holds its parameters for its own forward alone is counted so: not the root
    (it keeps them from its forward to its backward, or frees them only after every other unit's forward), not
    a unit with units inside it (gathered through theirs), not one that keeps a part after its forward (an
    integer ``reshard_after_forward``); those count all step, from the first run that reads them."""

    per_run: frozenset[int] = frozenset()
    """ids of the unsharded parameters of units that free them after their own forward."""
    unit_of: dict[int, frozenset[int]] = field(default_factory=dict)
    """id of such a parameter -> the ids of its unit's: counted per run only where one run reads them all (a
    graph break inside a unit splits them: its first part's stay gathered through the second's run)."""
    shard_bytes: dict[int, int] = field(default_factory=dict)
    """id of an unsharded parameter -> the bytes of its shard on this rank: what its gradient leaves when its
    unit reduce-scatters as its backward ends (not under ``set_requires_gradient_sync(False)``: then the full
    gradient stays; not the root's, reduced only when the whole backward ends)."""
    ahead_bytes: int = 0
    """The largest unit counted per run, times the units its backward may gather ahead (one; more where explicit
    prefetch lists say so): what may be gathered beside the run that reads it."""


def _units_and_groups(units: list[nn.Module] | None) -> Iterator[tuple[nn.Module, Any, list[Any]]]:
    """(unit, its FSDP state, its parameter groups) of every unit whose private layout this torch has."""
    for unit in fsdp_units() if units is None else units:
        try:
            state = unit._get_fsdp_state()  # type: ignore[operator, attr-defined]
            groups = list(state._fsdp_param_groups)
        except Exception:  # another torch's private layout: nothing known, every gathered weight held all step
            continue
        yield unit, state, groups


def gathered(units: list[nn.Module] | None = None) -> Gathered:
    """What FSDP2's units gathered so far (a unit's unsharded parameters exist from its first all-gather on),
    and the allowance for units gathered ahead; empty where nothing is sharded."""
    listed = list(_units_and_groups(units))
    unit_ids = {id(u) for u, _, _ in listed}
    per_run: set[int] = set()
    unit_of: dict[int, frozenset[int]] = {}
    shard_bytes: dict[int, int] = {}
    largest, ahead_units = 0, 1
    for unit, state, groups in listed:
        nested = any(id(m) in unit_ids for m in unit.modules() if m is not unit)
        frees = (not nested and state._is_root is not True and bool(groups)
                 and all(getattr(g, "post_forward_mesh_info", None) is not None
                         and g.post_forward_mesh_info == g.mesh_info for g in groups))
        full, ids = 0, []
        for group in groups:
            for param in getattr(group, "fsdp_params", ()):
                sharded = getattr(param, "sharded_param", None)
                if sharded is None:
                    continue
                full += sharded.numel() * sharded.element_size()  # a distributed tensor's numel: its full size
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is None:  # not gathered yet
                    continue
                ids.append(id(unsharded))
                if getattr(group, "reduce_grads", True) and state._is_root is not True:  # (the root reduces its
                    # gradients in the backward's final callback: full until the whole backward ends)
                    local = getattr(sharded, "_local_tensor", sharded)
                    shard_bytes[id(unsharded)] = local.numel() * local.element_size()
        if frees:
            per_run.update(ids)
            members = frozenset(ids)
            unit_of.update((i, members) for i in ids)
            largest = max(largest, full)
            ahead_units = max(ahead_units, len(getattr(state, "_states_to_backward_prefetch", ())),
                              len(getattr(state, "_states_to_forward_prefetch", ())))
    return Gathered(frozenset(per_run), unit_of, shard_bytes, largest * ahead_units)


def held_now(units: list[nn.Module] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FSDP2's tensors on this rank at a step's start: (its shards and the gradients it holds, sharded or full
    under ``set_requires_gradient_sync(False)``; its unsharded parameters, gathered now or not). The session
    reads them afresh each step: which of them hold memory changes from step to step, and the raw backend sees
    only the unsharded parameters its runs read, never the shards."""
    held: list[torch.Tensor] = []
    unsharded: list[torch.Tensor] = []
    for _, _, groups in _units_and_groups(units):
        for group in groups:
            for param in getattr(group, "fsdp_params", ()):
                for t, into in ((getattr(param, "sharded_param", None), held),
                                (getattr(param, "_unsharded_param", None), unsharded)):
                    if isinstance(t, torch.Tensor):
                        into.append(t)
                        if t.grad is not None:
                            held.append(t.grad)
                extra = getattr(param, "unsharded_accumulated_grad", None)
                if isinstance(extra, torch.Tensor):
                    held.append(extra)
    return held, unsharded


def gathered_parameters(unit: nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters of ``unit`` that exist (from its first all-gather on)."""
    out: list[torch.Tensor] = []
    for _, _, groups in _units_and_groups([unit]):
        for group in groups:
            for param in getattr(group, "fsdp_params", ()):
                t = getattr(param, "_unsharded_param", None)
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out
