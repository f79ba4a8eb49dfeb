"""What the runs of a training step's compiled regions hold, phase by phase, and how they share the budget.

A graph-broken model is several compiled regions, and one region may run many times in a step (a block
compiled once and called for each of six layers). Each region's plan is made on its own problem, which counts
its weights, its inputs and its outputs for the whole run; the step holds more and less than that:

* run ``k``'s **forward** happens while the earlier runs keep what their backwards read; tensors that cross a
  graph break are one tensor, counted once (an input of run ``k`` an earlier run also keeps, an output a later
  run reads);
* the code **between** the runs (the eager code at a break, the loss head after the last run) allocates too:
  measured per gap (``gap_bytes``), guessed until then;
* run ``k``'s **backward** happens after every later run's backward: what they kept is gone, their parameters'
  new gradients are not (unless they were added into gradients held from an earlier micro-batch), and of run
  ``k``'s own inputs and outputs only those its backward reads are still there.

``Footprint`` is what one plan of a region means in those terms, read off its problem and its simulated
memory; ``Run`` is one run of the step with the identities of the tensors it shares with other runs;
``step_peak`` walks the phases of a sequence of runs and returns the device bytes at the highest one. Every
budget question is asked of it: does this run's plan fit with the runs before it and the leanest plans of the
runs known to follow (``admits``), what is the unplanned step's peak (what a fraction is of), what is the
smallest budget under which every run fits with its leanest plan (the total an ``InfeasibleBudgetError``
names: the same arithmetic as the check, so the total is tight). All of it is plain data and integers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Hashable, Mapping, Sequence

from karma_fx.plan import GradToHost, Offload, Plan, Recompute
from karma_fx.problem import Problem, with_outputs_released
from karma_fx.simulate import Timeline
from karma_fx.wire import as_run

TensorId = Hashable
"""A tensor that crosses a graph break, named structurally so that the next step's runs name it the same way:
``("out", j, o)`` is output ``o`` of the step's run ``j``; ``("arg", k, i)`` a tensor first seen as input ``i``
of run ``k`` that no run made (eager code at a break made it)."""


@dataclass(frozen=True)
class Boundary:
    """Which storages of a region's problem cross its edges, by position: its tensor inputs (one entry per
    primal, ``None`` for non-tensors) and its forward outputs (after the buffers it updates, as its run
    returns them), and the storages of its parameters' gradients."""

    inputs: tuple[str | None, ...] = ()
    outputs: tuple[str | None, ...] = ()
    param_grads: frozenset[str] | None = None
    """``None``: not known, every gradient output counts."""


@dataclass(frozen=True)
class Footprint:
    """Device bytes of one plan of a region, in the region's own terms."""

    fwd_peak_bytes: int
    """Highest bytes over its forward: its weights, inputs and what it makes, as its problem counts them."""
    bwd_peak_bytes: int
    """Highest bytes over its backward (recomputes included), as its problem counts them: every input and
    every output still counted, read or not (``Run`` takes off what the step no longer holds)."""
    own_bytes: int
    """Its parameters and buffers (buffers only when weights are streamed): on the device all step long."""
    internal_held_bytes: int
    """What its forward makes and keeps for its backward, its outputs aside, as the plan leaves it."""
    inputs: tuple[tuple[int, bool], ...] = ()
    """Per tensor input (``Boundary.inputs`` order): bytes as its problem counts them, and whether its backward
    reads it."""
    outputs: tuple[tuple[int, bool], ...] = ()
    """Per forward output (``Boundary.outputs`` order): bytes, and whether its backward reads it."""
    grad_bytes: int = 0
    """Its parameters' gradients, alive from its backward to the end of the step."""
    bwd_peak_released_bytes: int | None = None
    """Highest bytes over its backward where the caller has let go of every output before the backward began
    (``released_outputs``): an output its backward reads is then freed after its last reader, as a compiled
    backward frees the tensors it saved. ``None``: as ``bwd_peak_bytes``."""

    def bwd_peak_of(self, released: bool) -> int:
        """The backward's peak, with the outputs released or held by the caller through it."""
        if released and self.bwd_peak_released_bytes is not None:
            return self.bwd_peak_released_bytes
        return self.bwd_peak_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.fwd_peak_bytes, self.bwd_peak_bytes)

    @property
    def held_bytes(self) -> int:
        """What it keeps from the end of its forward to its backward (its weights aside)."""
        return (self.internal_held_bytes + sum(b for b, saved in self.inputs if saved)
                + sum(b for b, saved in self.outputs if saved))


def released_outputs(problem: Problem, boundary: Boundary) -> Problem | None:
    """``problem`` with the region's outputs its backward reads released by the caller
    (``problem.with_outputs_released``), for ``footprint``'s ``released``; ``None`` where it has none."""
    names = {name for name in boundary.outputs if name is not None and name not in boundary.inputs}
    return with_outputs_released(problem, names)


def footprint(problem: Problem, timeline: Timeline, plan: Plan, *, offload_weights: bool = False,
              boundary: Boundary = Boundary(), released: Timeline | None = None) -> Footprint:
    """The footprint of ``plan`` on ``problem`` (``timeline`` is its simulation; ``released``, where given,
    its simulation on ``released_outputs(problem, boundary)``)."""
    problem = as_run(problem, plan.decisions)  # weights' casts and widened gradients made on the host
    own_kinds = ("buffer",) if offload_weights else ("param", "buffer")
    own = sum(s.size_bytes for s in problem.storages if s.kind in own_kinds)
    n = problem.num_fwd_ops
    moved = {d.tensor for d in plan.decisions if isinstance(d, Offload)}
    moved |= {t for d in plan.decisions if isinstance(d, Recompute) for t in d.tensors}
    replayed: set[str] = set()  # what the recompute chains read from the forward (not what they make)
    for d in plan.decisions:
        if isinstance(d, Recompute):
            ops = [problem.ops[problem.op_index(name)] for name in d.ops]
            made = {s for op in ops for s in op.outputs}
            replayed.update(s for op in ops for s in op.inputs if s not in made)
    edges = {name for name in boundary.inputs + boundary.outputs if name is not None}

    def read_by_backward(name: str) -> bool:
        st = problem.storage(name)
        return name not in moved and (name in replayed or any(u >= n for u in st.users))

    internal = sum(st.size_bytes for st in problem.storages
                   if st.kind not in ("param", "buffer", "tangent", "gradient", "input") and st.name not in edges
                   and st.producer is not None and st.producer < n and read_by_backward(st.name))

    def edge(name: str | None, counted: bool = True) -> tuple[int, bool]:
        if name is None or not problem.has_storage(name) or not counted:
            return (0, False)
        return (problem.storage(name).size_bytes, read_by_backward(name))

    inputs = tuple(edge(name, problem.has_storage(name) and problem.storage(name).kind not in ("param", "buffer"))
                   if name is not None else (0, False) for name in boundary.inputs)
    seen: set[str] = set()
    outputs = []
    for name in boundary.outputs:  # one storage returned twice (an alias) is one tensor
        outputs.append(edge(name, name not in seen and name not in boundary.inputs))
        if name is not None:
            seen.add(name)
    to_host = {d.tensor for d in plan.decisions if isinstance(d, GradToHost)}
    grads = sum(s.size_bytes for s in problem.storages
                if s.kind == "gradient" and s.is_output and s.name not in to_host
                and (boundary.param_grads is None or s.name in boundary.param_grads))
    memory = [b for _, b in timeline.memory]
    split = timeline.forward_items if timeline.memory else 0
    fwd = max(memory[:split], default=0)
    bwd = max(memory[split:], default=0)
    bwd_released = None
    if released is not None and released.memory:
        bwd_released = min(bwd, max((b for _, b in released.memory[released.forward_items:]), default=0))
    return Footprint(fwd_peak_bytes=fwd, bwd_peak_bytes=bwd, own_bytes=own, internal_held_bytes=internal,
                     inputs=inputs, outputs=tuple(outputs), grad_bytes=grads, bwd_peak_released_bytes=bwd_released)


@dataclass(frozen=True)
class Run:
    """One run of a region as the step sees it."""

    fp: Footprint
    own_bytes: int
    """The persistent bytes among its inputs (weights, buffers, the batch): counted once for the step."""
    reads: tuple[tuple[TensorId, int, bool], ...] = ()
    """The inputs no run owns for the step (made by earlier runs or by eager code between them): identity,
    bytes, whether its backward reads it."""
    makes: tuple[tuple[TensorId, int, bool], ...] = ()
    """Its forward outputs: identity, bytes, whether its backward reads it."""
    new_grad_bytes: int = 0
    """Gradients its backward leaves that the step did not hold before (with gradients held from an earlier
    micro-batch the new ones are added into them and go)."""
    grad_ids: frozenset[Hashable] | None = None
    """The parameters whose gradients those are, where known (``grad_sizes`` their bytes). Several runs of a
    step may read one parameter (a model called on two views of a batch before one backward): the gradient is
    left by the backward of the last of them, which runs first, and each earlier run's backward makes another
    that is added into it. ``None``: ``new_grad_bytes`` counted at this run's backward, as they are."""
    grad_sizes: Mapping[Hashable, int] | None = field(default=None, compare=False, repr=False)
    region: int = -1
    """Which region this is a run of (for messages)."""
    caller_keeps: frozenset[int] | None = None
    """Which of its outputs the caller still held when the step's backward began, where this run ended the
    step's forward and that was seen (``None``: not known, all of them)."""
    read_positions: tuple[int, ...] = ()
    """Per entry of ``reads``: which of the region's inputs it is (``Footprint.inputs``), for ``with_fp``."""

    def with_fp(self, fp: Footprint) -> "Run":
        """This run under another plan of its region (footprint ``fp``), its inputs and outputs read by the
        backward as that plan saves them. A plan may save what another does not: Inductor's own partition saves
        a language model's logits, a plan with the loss head chunked does not. Kept from the plan the run was
        first seen with, a chunked plan's backward counted the logits the caller had let go held through it
        (a small LM head's planned step: 20% over the allocator's peak)."""
        reads = self.reads
        if len(self.read_positions) == len(reads):
            reads = tuple((i, b, fp.inputs[k][1] if k < len(fp.inputs) else saved)
                          for (i, b, saved), k in zip(reads, self.read_positions))
        makes = self.makes
        if len(makes) == len(fp.outputs):
            makes = tuple((i, b, fp.outputs[o][1]) for o, (i, b, _) in enumerate(makes))
        return replace(self, fp=fp, reads=reads, makes=makes)

    def kept_by_caller(self, position: int) -> bool:
        return self.caller_keeps is None or position in self.caller_keeps

    def held(self) -> dict[TensorId, int]:
        """Crossing tensors it keeps for its backward."""
        return {i: b for i, b, saved in self.reads + self.makes if saved}


@dataclass(frozen=True)
class Phase:
    """One moment of the step: which run (``-1``: between runs), forward or backward, and its device bytes."""

    run: int
    stage: str
    """``"forward"``, ``"after"`` (the code after run ``run``'s forward: a break's eager code, the loss head)
    or ``"backward"``."""
    device_bytes: int


@dataclass(frozen=True)
class Step:
    """A training step as a sequence of runs."""

    persistent_bytes: int
    """Weights, buffers, gradients held, the batch: on the device all step."""
    runs: tuple[Run, ...]
    gap_bytes: tuple[int, ...] = ()
    """Per run: what the code after its forward allocates above what it starts with (the last run's: the loss
    head). Missing entries count 0."""
    last_outputs_held: bool = True
    """Whether the caller holds the last run's outputs through the backward (a returned loss or logits)."""
    phases: list[Phase] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.phases.extend(_phases(self))

    @property
    def peak_bytes(self) -> int:
        return max((p.device_bytes for p in self.phases), default=self.persistent_bytes)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.device_bytes)


def _phases(step: Step) -> list[Phase]:
    runs, base = step.runs, step.persistent_bytes
    out: list[Phase] = []
    read_later: dict[TensorId, int] = {}  # tensor -> the last run that takes it as an input
    for k, r in enumerate(runs):
        for i, _, _ in r.reads:
            read_later[i] = k
    sizes: dict[TensorId, int] = {}
    for r in runs:
        for i, b, _ in r.reads + r.makes:
            sizes.setdefault(i, b)
    # forward, in order
    held: dict[TensorId, int] = {}
    internal = 0
    made: set[TensorId] = set()
    for k, r in enumerate(runs):
        args = {i for i, _, _ in r.reads}
        waiting = sum(sizes[i] for i in made if i not in held and i not in args and read_later.get(i, -1) > k)
        context = base - r.own_bytes + internal + sum(b for i, b in held.items() if i not in args) + waiting
        out.append(Phase(k, "forward", context + r.fp.fwd_peak_bytes))
        held.update(r.held())
        internal += r.fp.internal_held_bytes
        made.update(i for i, _, _ in r.makes)
        gap = step.gap_bytes[k] if k < len(step.gap_bytes) else 0
        after = base + internal + sum(held.values()) + gap
        after += sum(b for i, b, _ in r.makes if i not in held and (read_later.get(i, -1) > k or k == len(runs) - 1))
        after += sum(sizes[i] for i in made if i not in held and read_later.get(i, -1) > k
                     and i not in {m for m, _, _ in r.makes})
        out.append(Phase(k, "after", after))
    # backward, in reverse
    last = len(runs) - 1
    # the last run's outputs the caller holds, through the earlier runs' backwards (those its own backward read too)
    last_out = sum(b for o, (i, b, saved) in enumerate(runs[last].makes)
                   if runs[last].kept_by_caller(o)) if runs and step.last_outputs_held else 0
    new_grads_after = 0
    left: set[Hashable] = set()  # parameters whose gradients the backwards so far have left
    for k in range(last, -1, -1):
        r = runs[k]
        before_held: dict[TensorId, int] = {}
        before_internal = 0
        for j in range(k):
            before_held.update(runs[j].held())
            before_internal += runs[j].fp.internal_held_bytes
        own_held = set(r.held())
        context = (base - r.own_bytes + before_internal + new_grads_after
                   + sum(b for i, b in before_held.items() if i not in own_held)
                   + (last_out if k < last else 0))
        # of its own edges the step still holds only what its backward reads (the last run's outputs: the caller)
        gone = sum(b for _, b, saved in r.reads if not saved)
        released = False
        if k < last or not step.last_outputs_held:
            gone += sum(b for _, b, saved in r.makes if not saved)
        else:  # the last run's outputs the caller let go before the backward: those it reads, after it reads them
            gone += sum(b for o, (_, b, saved) in enumerate(r.makes) if not saved and not r.kept_by_caller(o))
            released = r.caller_keeps is not None and not any(
                saved and b and r.kept_by_caller(o) for o, (_, b, saved) in enumerate(r.makes))
        out.append(Phase(k, "backward", context + r.fp.bwd_peak_of(released) - gone))
        if r.grad_ids is None or not left or r.grad_ids.isdisjoint(left):
            new_grads_after += r.new_grad_bytes
        else:  # only those no later run's backward left already (the others are added into them)
            assert r.grad_sizes is not None
            new_grads_after += sum(r.grad_sizes[i] for i in r.grad_ids - left)
        if r.grad_ids:
            left |= r.grad_ids
    return out


def step_peak(persistent_bytes: int, runs: Sequence[Run], gap_bytes: Sequence[int] = ()) -> int:
    """The device peak of a step that runs ``runs`` (see ``Step``)."""
    return Step(persistent_bytes, tuple(runs), tuple(gap_bytes)).peak_bytes


def pinned_by_breaks(runs: Sequence[Run]) -> list[int]:
    """Per run: the bytes of tensors crossing into it from earlier runs (its inputs no run owns) that some
    backward reads: no plan can move them, since each region's plan sees them as inputs or outputs."""
    held_anywhere: set[TensorId] = set()
    for r in runs:
        held_anywhere.update(r.held())
    return [sum(b for i, b, _ in r.reads if i in held_anywhere) for r in runs]
