"""Op tape: a captured step's joint graph as plain, picklable data, and the one loop that runs it for real.

Every run of a step for measuring (its kernels' scratch, their times) goes through ``run_tape``: the nodes in
the order the step runs them (the forward, then the backward), each value dropped after its last reader as
the step itself frees it, tangents made when the backward begins.

Why a tape and not the graph: the allocator's events the scratch is read from come through a torch.profiler
session, and a caller profiling the step already runs one, which a second session in the same process would
break (they do not nest; one started on another thread crashes the process). Written as data, with ops named
rather than held (an ``OpOverload`` does not pickle), the step can be run and measured in another process
(``karma_fx.measure_apart``), with no ``torch.fx`` and no module of the caller's in it.

Example::

    tape = op_tape(step)
    run_tape(tape, primals, lambda op: record_function(op.name))
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from karma_fx.passes.capture import CapturedStep
from karma_fx.passes.liveness import execution_order, forward_node_count, is_mutating


@dataclass(frozen=True)
class Slot:
    """A value of the tape, by position: the placeholders first, then the constants, then each op's result."""

    index: int


@dataclass(frozen=True)
class OpName:
    """An aten (or other ``torch.ops``) overload by its qualified name, ``"aten.add.Tensor"``: what a tape holds
    in place of the op where it must cross to another process."""

    qualified: str

    def resolve(self) -> Callable:
        namespace, packet, overload = self.qualified.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


@dataclass(frozen=True)
class TapeOp:
    """One node of the joint graph: ``target(*args, **kwargs)`` with ``Slot``s for the values it reads."""

    name: str
    target: Any
    args: tuple
    kwargs: dict
    frees: tuple[int, ...]
    """Slots no later op reads, dropped once this op has run (its own result too where nothing reads it)."""
    split_batch: int
    """The most pieces its kernel may be split into (``karma_fx.split_ops.split_limit``); 1 for most ops."""


@dataclass(frozen=True)
class OpTape:
    """A joint graph as ``run_tape`` runs it; ``portable`` makes it picklable."""

    placeholders: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
    """``(shape, dtype)`` of each placeholder (slots ``0..``): those past the primals a run is given are the
    tangents, made (ones) when the backward begins."""
    written: frozenset[int]
    """Placeholder slots the step writes into (a BatchNorm's running statistics): a run writes into copies."""
    constants: dict[int, Any]
    """Slot → value of each ``get_attr`` node (constants the trace lifted)."""
    forward_ops: int
    ops: tuple[TapeOp, ...]


def op_tape(step: CapturedStep) -> OpTape:
    """``step.joint`` as a tape, in execution order."""
    from karma_fx.passes.measure import graph_constants
    from karma_fx.split_ops import split_limit

    graph = step.joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    constants = graph_constants(step.joint)
    order = execution_order(step)
    slot = {node: i for i, node in enumerate([*placeholders, *constants, *order])}
    last_read: dict[fx.Node, int] = {}
    for pos, node in enumerate(order):
        for arg in node.all_input_nodes:
            last_read[arg] = pos
    frees: dict[int, list[int]] = {}
    for node, pos in last_read.items():
        frees.setdefault(pos, []).append(slot[node])
    for pos, node in enumerate(order):
        if node not in last_read:
            frees.setdefault(pos, []).append(slot[node])

    def slotted(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return Slot(slot[value])
        if isinstance(value, list):  # (an fx ``immutable_list`` too)
            return [slotted(v) for v in value]
        if isinstance(value, tuple):
            return tuple(slotted(v) for v in value)
        if isinstance(value, dict):
            return {k: slotted(v) for k, v in value.items()}
        return value

    written = frozenset(slot[ph] for ph in placeholders for user in ph.users
                        if is_mutating(user) and user.args and user.args[0] is ph)
    specs = tuple((tuple(v.shape), v.dtype) if isinstance(v := ph.meta.get("val"), torch.Tensor) else None
                  for ph in placeholders)
    ops = tuple(TapeOp(node.name, node.target, slotted(node.args), slotted(dict(node.kwargs)),
                       tuple(frees.get(pos, ())), split_limit(node)) for pos, node in enumerate(order))
    return OpTape(placeholders=specs, written=written, constants={slot[n]: v for n, v in constants.items()},
                  forward_ops=forward_node_count(step), ops=ops)


def portable(tape: OpTape) -> OpTape:
    """``tape`` with each ``torch.ops`` overload written as an ``OpName``, so that it pickles."""
    return replace(tape, ops=tuple(replace(op, target=op_name(op.target)) for op in tape.ops))


def resolved(tape: OpTape) -> OpTape:
    """A ``portable`` tape with its ops again."""
    return replace(tape, ops=tuple(replace(op, target=op.target.resolve() if isinstance(op.target, OpName)
                                           else op.target) for op in tape.ops))


def op_name(target: Any) -> Any:
    """An ``OpName`` for a ``torch.ops`` overload; anything else (``operator.getitem``) as it is."""
    if isinstance(target, torch._ops.OpOverload):
        return OpName(f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}")
    return target


def run_tape(tape: OpTape, primals: list[Any], around: Callable[[TapeOp], Any], *, spill: bool = False,
             after: Callable[[TapeOp, tuple, dict], None] | None = None,
             instead: dict[Any, Callable] | None = None) -> None:
    """Run ``tape`` once for real on ``primals``, each op inside the context manager ``around(op)``.

    ``spill`` (a step on a GPU): every value lives in host memory between the ops, and each op's inputs are
    copied to the device just before it runs (outside ``around``), its outputs back just after. The device then
    holds the weights and one op's inputs, outputs and scratch at a time, not the unplanned step, which is what
    a budget is set below: measuring a step that does not fit must not need the memory it does not have.

    ``after(op, args, kwargs)``, where given, is called once each op has run (outside ``around``), with the
    tensors it read, to measure something else on them. ``instead``: ops run in place of others (a reshape for
    a view, on tensors laid out otherwise than traced)."""
    from torch.utils._python_dispatch import _disable_current_modes

    device, host = primals[0].device if primals else torch.device("cpu"), torch.device("cpu")
    swap = instead or {}

    def filled(value: Any, env: dict[int, Any]) -> Any:
        if isinstance(value, Slot):
            return env[value.index]
        if isinstance(value, (list, tuple)):
            return type(value)(filled(v, env) for v in value)
        if isinstance(value, dict):
            return {k: filled(v, env) for k, v in value.items()}
        return value

    with _disable_current_modes(), torch.no_grad():
        env: dict[int, Any] = {i: t.clone() if i in tape.written and isinstance(t, torch.Tensor) else t
                               for i, t in enumerate(primals)}
        env.update(tape.constants)
        first = len(tape.placeholders) + len(tape.constants)
        for pos, op in enumerate(tape.ops):
            if pos == tape.forward_ops:
                for i in range(len(primals), len(tape.placeholders)):
                    shape, dtype = tape.placeholders[i]  # type: ignore[misc]
                    env[i] = torch.ones(shape, dtype=dtype, device=host if spill else device)
            a, kw = filled(op.args, env), filled(op.kwargs, env)
            if spill:
                a, kw = pytree.tree_map(lambda v: _moved(v, device), (a, kw))
            with around(op):
                out = swap.get(op.target, op.target)(*a, **kw)
            if after is not None:
                after(op, a, kw)
            del a, kw
            env[first + pos] = pytree.tree_map(lambda v: _moved(v, host), out) if spill else out
            del out
            for i in op.frees:
                env.pop(i, None)


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` on ``device`` if it is a tensor elsewhere (a weight already there stays itself)."""
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value
