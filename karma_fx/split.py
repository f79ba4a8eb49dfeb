"""Kernels split along the batch, as a plan's choice: what the step looks like to the simulator then.

Some kernels allocate scratch that grows with the batch (a convolution's, measured on the device the step runs
on). Where that scratch sets the step's floor, no offload or recompute lowers it: it exists only while its op
runs. Running the op on ``k`` pieces of the batch, one after another (``karma_fx.split_ops``), shrinks it, at the
price of ``k`` kernel calls instead of one. A plan says which ops it splits and into how many pieces
(``Plan.splits``); ``split_problem`` is the step so run, which is what every strategy plans and the simulator
replays for such a plan.

What a split costs is measured where the step is priced, with the op's own tensors
(``karma_fx.passes.measure.scratch_and_split_costs``, kept in ``Op.split_costs``): the split op's scratch, which
counts a piece's output before it is put in place, the larger piece where the batch does not divide evenly, and
whatever part of the scratch does not shrink with the batch (a CPU convolution's weight-sized buffers); and, on a
CPU, its time against the whole op's. Only pieces that lower the scratch are offered. Where the time could not be
measured (a GPU, or a step priced on a preset's roofline), a split is taken to cost ``SPLIT_OVERHEAD`` of the op
per extra piece.
"""
from __future__ import annotations

from dataclasses import replace

from karma_fx.costs import Costs
from karma_fx.problem import Op, Problem

SPLIT_CHUNKS = (2, 4, 8)
"""The pieces measured and tried, fewest first."""
SPLIT_OVERHEAD = 0.05
"""Extra time per extra piece, as a fraction of the op's own, where the split's time was not measured."""
MIN_SCRATCH_SHARE = 1 / 64
"""Ops whose scratch is under this share of the unplanned peak are not worth splitting."""

Splits = tuple[tuple[str, int], ...]


def scratch_of(problem: Problem, op: Op) -> int:
    """The bytes of ``op``'s kernel scratch (``karma_fx.problem.with_scratch``), 0 where none was measured."""
    name = f"{op.name}:scratch"
    return problem.storage(name).size_bytes if name in op.outputs else 0


def splittable(problem: Problem, min_scratch: int = 1) -> tuple[Op, ...]:
    """The ops a plan may split: measured split costs, and at least ``min_scratch`` bytes of scratch."""
    return tuple(op for op in problem.ops if op.split_costs and scratch_of(problem, op) >= max(1, min_scratch))


def split_all(problem: Problem, chunks: int, min_scratch: int = 1) -> Splits:
    """Every splittable op in the most pieces measured up to ``chunks`` (fewer where its batch is smaller)."""
    out = []
    for op in splittable(problem, min_scratch):
        offered = [k for k, _, _ in op.split_costs if k <= chunks]
        if offered:
            out.append((op.name, max(offered)))
    return tuple(out)


def split_problem(problem: Problem, costs: Costs, splits: Splits) -> tuple[Problem, Costs]:
    """``problem`` and ``costs`` as the step runs with ``splits``: each split op's scratch and time as measured
    for that many pieces (see the module's docstring). Raises ``ValueError`` for an op that is not in
    ``problem``, named twice, or not measured in that many pieces."""
    if not splits:
        return problem, costs
    names = [name for name, _ in splits]
    if len(set(names)) != len(names):
        raise ValueError(f"the plan splits an op twice: {sorted({n for n in names if names.count(n) > 1})[:3]}")
    new_size: dict[str, int] = {}
    times = list(costs.op_time_us)
    for name, chunks in splits:
        try:
            i = problem.op_index(name)
        except KeyError:
            raise ValueError(f"the plan splits {name!r}, which is not an op of {problem.name}") from None
        op = problem.ops[i]
        measured = {k: (b, ratio) for k, b, ratio in op.split_costs}
        if chunks not in measured or f"{name}:scratch" not in op.outputs:
            raise ValueError(f"{name} cannot run in {chunks} pieces: pieces measured to lower its scratch are "
                             f"{sorted(measured) or 'none'}")
        nbytes, ratio = measured[chunks]
        new_size[f"{name}:scratch"] = nbytes
        times[i] *= ratio if ratio > 0 else 1 + SPLIT_OVERHEAD * (chunks - 1)
    storages = tuple(replace(s, size_bytes=new_size[s.name]) if s.name in new_size else s for s in problem.storages)
    return replace(problem, storages=storages, _index={}, _op_index={}), replace(costs, op_time_us=tuple(times))


def describe_splits(splits: Splits) -> str:
    """``"convolution_backward_1 in 4, convolution_2 in 2"``: for notes and tables."""
    return ", ".join(f"{name} in {chunks}" for name, chunks in splits)
