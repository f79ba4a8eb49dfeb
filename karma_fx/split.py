"""Kernels split along the batch, as a plan's choice: what the step looks like to the simulator then.

Some kernels allocate scratch that grows with the batch (a convolution's, measured on the device the step runs
on). Where that scratch sets the step's floor, no offload or recompute lowers it: it exists only while its op
runs. Running the op on ``k`` pieces of the batch, one after another (``karma_fx.split_ops``), makes it a
``k``-th, at the price of ``k`` kernel calls instead of one. A plan says which ops it splits and into how many
pieces (``Plan.splits``); ``split_problem`` is the step so run, which is what every strategy plans and the
simulator replays for such a plan.

The model of a split op: its scratch is ``ceil(scratch / k)`` plus what one piece allocates before it is put in
place (a ``k``-th of each output that has the batch in it, the whole of a weight's or bias's gradient, which
pieces sum into); its time is its own plus ``SPLIT_OVERHEAD`` of it per extra piece (on this project's 2-core
CPU, splitting a 16x16x32x32 convolution's backward in 2-8 pieces was 0.6-0.8x as long as the whole; a 3-channel
one 1.1-2.1x: the overhead is kept so that a plan splits only where memory asks for it).
"""
from __future__ import annotations

import math
from dataclasses import replace

from karma_fx.costs import Costs
from karma_fx.problem import Op, Problem

SPLIT_CHUNKS = (2, 4, 8)
"""The pieces a planner tries, fewest first (an op with a smaller batch is split into its batch)."""
SPLIT_OVERHEAD = 0.05
"""Extra time per extra piece, as a fraction of the op's own."""
MIN_SCRATCH_SHARE = 1 / 64
"""Ops whose scratch is under this share of the unplanned peak are not worth splitting."""

Splits = tuple[tuple[str, int], ...]


def scratch_of(problem: Problem, op: Op) -> int:
    """The bytes of ``op``'s kernel scratch (``karma_fx.problem.with_scratch``), 0 where none was measured."""
    name = f"{op.name}:scratch"
    return problem.storage(name).size_bytes if name in op.outputs else 0


def splittable(problem: Problem, min_scratch: int = 1) -> tuple[Op, ...]:
    """The ops a plan may split: a batch to split along and at least ``min_scratch`` bytes of scratch."""
    return tuple(op for op in problem.ops if op.split > 1 and scratch_of(problem, op) >= max(1, min_scratch))


def split_all(problem: Problem, chunks: int, min_scratch: int = 1) -> Splits:
    """Every splittable op in ``chunks`` pieces (or its batch, where that is fewer)."""
    return tuple((op.name, min(chunks, op.split)) for op in splittable(problem, min_scratch))


def split_problem(problem: Problem, costs: Costs, splits: Splits) -> tuple[Problem, Costs]:
    """``problem`` and ``costs`` as the step runs with ``splits``: each split op's scratch the size of one
    piece's (see the module's docstring), its time raised by ``SPLIT_OVERHEAD`` per extra piece. Raises
    ``ValueError`` for an op that is not in ``problem`` or may not be split so."""
    if not splits:
        return problem, costs
    sizes = {s.name: s.size_bytes for s in problem.storages}
    new_size: dict[str, int] = {}
    times = list(costs.op_time_us)
    for name, chunks in splits:
        try:
            i = problem.op_index(name)
        except KeyError:
            raise ValueError(f"the plan splits {name!r}, which is not an op of {problem.name}") from None
        op = problem.ops[i]
        if not 1 <= chunks <= op.split or f"{name}:scratch" not in op.outputs:
            raise ValueError(f"{name} cannot run in {chunks} pieces (its batch allows {op.split}, "
                             f"and only an op with measured scratch is split)")
        if chunks == 1:
            continue
        piece = sum(_piece_bytes(problem, op, s, sizes[s], chunks) for s in op.outputs
                    if not s.endswith(":scratch"))
        new_size[f"{name}:scratch"] = math.ceil(sizes[f"{name}:scratch"] / chunks) + piece
        times[i] *= 1 + SPLIT_OVERHEAD * (chunks - 1)
    if not new_size:
        return problem, costs
    storages = tuple(replace(s, size_bytes=new_size[s.name]) if s.name in new_size else s for s in problem.storages)
    return replace(problem, storages=storages, _index={}, _op_index={}), replace(costs, op_time_us=tuple(times))


def _piece_bytes(problem: Problem, op: Op, output: str, size: int, chunks: int) -> int:
    """What one piece allocates of ``output`` before it is copied or summed into it: a ``chunks``-th of an
    output with the batch in it (the size of a batch-led input: the activation or its gradient), all of a
    weight's or bias's gradient (smaller than any batch-led tensor, so told apart by size)."""
    batch_led = {problem.storage(s).size_bytes for s in op.inputs[:2]}
    if op.phase == "fwd" or size in batch_led:
        return math.ceil(size / chunks)
    return size


def describe_splits(splits: Splits) -> str:
    """``"convolution_backward_1 in 4, convolution_2 in 2"``: for notes and tables."""
    return ", ".join(f"{name} in {chunks}" for name, chunks in splits)
