"""Recomputations joined by the backward's loops that read what they read, so that Inductor fuses them.

Under ``compiler="inductor"`` a recompute chain runs just before the first backward op that reads what it
rebuilds, often an extern kernel: a two-pass MLP's rebuilt GELU is read first by its weight's gradient
matmul. The GELU's own backward, which reads the same pre-activation, comes after that matmul, and since
a planned graph never fuses across an extern kernel (``karma_fx.inductor.PlanOrder``), the rebuild and the
backward ran as two kernels, each computing the same ``erf`` over 4 MiB: the plan of PyTorch's recompute set
at its r=0.5 point ran 1.07x PyTorch's step on a CPU, with 37 kernels where PyTorch runs 28.

``joined_ops`` names the backward loop ops after such an anchor that can run with the chain, before the
anchor: each reads what the chain reads or makes (or what another joined op makes), and reads nothing made
at or after the anchor by an op not joined. A ``Recompute`` carries them as ``joins``: the rewrite moves them
to just after the chain, which ends its function after them (``passes.rewrite``), and the simulator allocates
their outputs where the function starts and holds what the function reads and writes until its last joined op
(``karma_fx.simulate``): what a function of loops holds on a CPU, counted at least where it runs.

``with_joins`` adds them to a plan's recomputes where the plan still fits: a join allocates its outputs
earlier, which may raise the peak. Only on the step Inductor runs (a problem with ``loop_ops``); op by op
nothing fuses and a plan is left as it is.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable

from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Decision, GradToHost, Offload, Recompute, StreamWeight
from karma_fx.problem import Op, Problem

__all__ = ["JOIN_ALLOWANCE", "check_joins", "joined_ops", "last_stretch", "read_for_value", "unshared_share",
           "with_joins"]


_MATMULS = ("aten.mm.default", "aten.bmm.default")
"""Among ``Problem.loop_ops``, a matmul is one Inductor runs where its product is added (``addmm``): an extern
kernel all the same, later."""


def _named_ops(decisions: Iterable[Decision]) -> set[str]:
    """Ops a decision anchors something to (a copy, a wait, a free, a chain): they stay where they are."""
    named: set[str] = set()
    for d in decisions:
        if isinstance(d, Offload):
            named.update((d.offload_after, d.free_after, d.prefetch_at, d.reload_before))
            if d.release_before is not None:
                named.add(d.release_before)
        elif isinstance(d, Recompute):
            named.update(d.ops)
            named.add(d.reload_before)
        elif isinstance(d, StreamWeight):
            for w in d.windows:
                named.update((w.prefetch_at, w.reload_before, w.free_after))
        elif isinstance(d, GradToHost) and d.release_before is not None:
            named.add(d.release_before)
    return named


def _moved_tensors(decisions: Iterable[Decision]) -> set[str]:
    moved: set[str] = set()
    for d in decisions:
        if isinstance(d, Recompute):
            moved.update(d.tensors)
        elif isinstance(d, (Offload, StreamWeight, GradToHost)):
            moved.add(d.tensor)
    return moved


def joined_ops(problem: Problem, chain: Recompute, decisions: Iterable[Decision] = ()) -> tuple[str, ...]:
    """The backward loop ops that may run with ``chain`` (the module docstring's rule), in graph order.

    The chain's last op must be a loop op and its anchor (``reload_before``) an extern kernel: a chain read
    first by loops is followed by them already (``passes.rewrite`` ends its function before them, which the
    simulator counts). The ops looked at are the loop ops after the anchor up to the second extern kernel
    from the anchor on (the anchor, or where a matmul anchor runs as Inductor's ``addmm``, is the first). An op
    joins when it is of the backward, neither random nor mutating, makes one tensor, is not named by any of
    ``decisions`` (a copy or another chain is anchored there), reads no tensor another decision moves, and
    reads only what exists before the anchor or is made by the chain or by an op already joined, at least one
    of them shared with the chain or made by a joined op. And what it makes is stored, or read by joined ops
    only: a value Inductor computes inside its readers (0 bytes, read by loops only) read past the run would
    be pinned there, stored where the problem counts nothing."""
    loops = problem.loop_ops
    if not loops or chain.ops[-1] not in loops:
        return ()
    decisions = tuple(decisions)
    a = problem.op_index(chain.reload_before)
    anchor = problem.ops[a]
    if a < problem.num_fwd_ops or anchor.name in loops and anchor.target not in _MATMULS:
        return ()
    named = _named_ops(decisions)
    moved = _moved_tensors(d for d in decisions if d != chain)
    made = {s for name in chain.ops for s in problem.ops[problem.op_index(name)].outputs}
    shared = made | {s for name in chain.ops for s in problem.ops[problem.op_index(name)].inputs}
    candidates: list[int] = []
    externs = 0 if anchor.name in loops else 1  # a matmul run late as an ``addmm`` is among the loop ops
    for j in range(a + 1, len(problem.ops)):
        op = problem.ops[j]
        if op.name not in loops:
            externs += 1
            if externs == 2:
                break
            continue
        if not (op.random or op.mutates or op.name in named or len(op.outputs) != 1
                or any(s in moved for s in read_for_value(problem, op))):
            candidates.append(j)
    banned: set[int] = set()
    while True:
        joined = _closure(problem, candidates, banned, a, made, shared)
        names = {problem.ops[j].name for j in joined}
        unstored = {j for j in joined for s in problem.ops[j].outputs if _inlined(problem, s)
                    and any(problem.ops[u].name not in names for u in problem.storage(s).users)}
        if not unstored:
            return tuple(problem.ops[j].name for j in joined)
        banned |= unstored


def _inlined(problem: Problem, name: str) -> bool:
    """Whether a storage is one Inductor computes inside its readers: 0 bytes, and only loop ops read it (a
    0-byte storage an extern kernel reads is stored, written over a buffer it outlives)."""
    s = problem.storage(name)
    return s.size_bytes == 0 and all(problem.ops[u].name in problem.loop_ops for u in s.users)


def read_for_value(problem: Problem, op: Op) -> tuple[str, ...]:
    """What ``op`` reads for its value: a run's outputs its last op reads only to hold them are left out."""
    return tuple(s for s in op.inputs if (op.name, s) not in problem.held_by_runs)


def _ready(problem: Problem, reads: Iterable[str], made: set[str], a: int) -> bool:
    """Whether each of ``reads`` is in ``made`` (by the chain or the ops joined so far) or exists before op ``a``."""
    return all(s in made or (maker := problem.storage(s).producer) is None or maker < a for s in reads)


def _closure(problem: Problem, candidates: list[int], banned: set[int], a: int, made: set[str],
             shared: set[str]) -> list[int]:
    """The candidates (op indices after the anchor ``a``, in order) that join, ``banned`` left out: each reads
    only what exists before ``a``, what the chain makes, or what a joined op makes, and shares something."""
    joined: list[int] = []
    joined_out: set[str] = set()
    for j in candidates:
        if j in banned:
            continue
        reads = read_for_value(problem, problem.ops[j])
        if _ready(problem, reads, made | joined_out, a) and any(s in shared or s in joined_out for s in reads):
            joined.append(j)
            joined_out.update(problem.ops[j].outputs)
    return joined


def last_stretch(problem: Problem, chain: tuple[str, ...]) -> tuple[str, ...]:
    """The chain's ops from its last extern kernel on: the loops that run in one kernel with the ones joined
    (an extern kernel before them runs alone)."""
    start = len(chain)
    while start > 0 and chain[start - 1] in problem.loop_ops:
        start -= 1
    return chain[start:]


def unshared_share(problem: Problem, stretch: Iterable[str], joined: Iterable[str]) -> float:
    """The share of a stretch of loops' traffic that the ops ``joined`` with it do not read: what it stores,
    and what it reads that none of them reads (each storage read or written counted once, at its size). Fused
    with them, that is what the stretch costs (``karma_fx.rebuild_price``)."""
    ops = [problem.ops[problem.op_index(name)] for name in stretch]
    made = {s for op in ops for s in op.outputs}
    reads = {s for op in ops for s in read_for_value(problem, op)} - made
    stored = {s for s in made if not s.endswith(":scratch")}
    also_read = {s for name in joined for s in read_for_value(problem, problem.ops[problem.op_index(name)])}
    total = sum(problem.storage(s).size_bytes for s in reads | stored)
    if total <= 0:
        return 1.0
    return sum(problem.storage(s).size_bytes for s in (reads - also_read) | stored) / total


def check_joins(problem: Problem, decisions: tuple[Decision, ...]) -> None:
    """Refuse joins a plan may not have: an op that may not join its chain (``joined_ops``), one whose inputs
    are made after the anchor by an op not in the same joins, or one in two chains' joins."""
    seen: set[str] = set()
    for d in decisions:
        if not isinstance(d, Recompute) or not d.joins:
            continue
        allowed = set(joined_ops(problem, d, decisions))
        a = problem.op_index(d.reload_before)
        ready = {s for name in d.ops for s in problem.ops[problem.op_index(name)].outputs}
        for name in d.joins:
            op = problem.ops[problem.op_index(name)] if name in allowed else None
            if op is None or name in seen or not _ready(problem, read_for_value(problem, op), ready, a):
                raise InvalidPlanError(
                    f"{name} cannot run with the recompute before {d.reload_before}: only backward loop ops that "
                    "read what it reads, and nothing made from there on but by the ops joined with it, join it, "
                    "each to one chain (on the step Inductor runs)")
            seen.add(name)
            ready.update(op.outputs)


JOIN_ALLOWANCE = 0.01
"""The most a plan's peak may rise (as a fraction of it) for its joins. The simulator counts a joined run as one
function of loops, allocated at its start and held to its end; Inductor may write it as several (a wait
ending the run splits it where its loops did not fuse), which hold less. A 2-layer GPT checkpointed at 0.9,
its joins taken while within the budget, was predicted at 15.8 MB and measured 13.5."""


MAX_TRIES = 12
"""Replays ``with_joins`` spends at most on one plan (a GPT's plan may rebuild a chain per layer)."""


def with_joins(problem: Problem, decisions: tuple[Decision, ...], budget_bytes: int,
               peak: Callable[[tuple[Decision, ...]], int]) -> tuple[Decision, ...]:
    """``decisions`` with each recompute chain joined by its ``joined_ops`` where the plan's peak (``peak``: the
    simulator's) stays within ``budget_bytes`` (or within its peak without joins, for a plan over the budget)
    and rises by at most ``JOIN_ALLOWANCE``: all chains at once, else each half of them in turn, and so on down
    to single chains, each group kept if the peak still holds (at most ``MAX_TRIES`` replays)."""
    if not problem.loop_ops or not any(isinstance(d, Recompute) for d in decisions):
        return decisions
    options: dict[int, tuple[str, ...]] = {}
    claimed: set[str] = {name for d in decisions if isinstance(d, Recompute) for name in d.joins}
    for i, d in enumerate(decisions):  # an op joins one chain at most
        if isinstance(d, Recompute) and not d.joins:
            ops = joined_ops(problem, d, decisions)
            if ops and not claimed & set(ops):  # two chains before one stretch of loops: the first takes it
                options[i] = ops
                claimed.update(ops)
    if not options:
        return decisions
    alone = peak(decisions)
    limit = min(max(budget_bytes, alone), alone + alone * JOIN_ALLOWANCE)

    def joining(chosen: dict[int, tuple[str, ...]]) -> tuple[Decision, ...]:
        return tuple(replace(d, joins=chosen[i]) if i in chosen else d for i, d in enumerate(decisions))

    chosen: dict[int, tuple[str, ...]] = {}
    tries = [MAX_TRIES]

    def take(group: list[int]) -> None:  # the whole group if it fits, else each half in turn
        if not group or tries[0] <= 0:
            return
        tries[0] -= 1
        trial = {**chosen, **{i: options[i] for i in group}}
        if peak(joining(trial)) <= limit:
            chosen.update(trial)
        elif len(group) > 1:
            take(group[:len(group) // 2])
            take(group[len(group) // 2:])

    take(list(options))
    return joining(chosen)
