"""The simulator: the single oracle that judges every plan, ours and the baselines'.

It replays a plan over the problem on three streams — compute, device→host (D2H) and host→device (H2D) — the
way the runtime issues work:

* compute runs the ops in order; a recompute chain runs just before the op it serves; before an op that
  needs a prefetched tensor, compute waits for that copy, and before an offload's ``release_before`` op it
  waits for the offload to land (each wait is a *stall*);
* an offload is issued on the D2H stream when compute finishes ``offload_after``; a prefetch is issued on the
  H2D stream when compute reaches ``prefetch_at`` and starts no earlier than its own offload has landed; each
  copy stream is FIFO in issue order;
* device bytes are counted per storage at every compute step (while the step's outputs are being written):
  a storage lives from its allocation to its last read, an offloaded one also until its D2H copy has landed,
  and a prefetched one from the moment its H2D copy is issued.

It is the like-for-like judge for every strategy and solver: they read the same ``Costs`` (a recompute chain
the backward's loops join is charged the share of its traffic those loops do not read, never below the price the
strategies give it, ``Costs.rebuild_us``), but none of their models. It also
validates the plan (a tensor read while off the device, a recompute input missing, …) and says what is wrong.

Example::

    timeline = simulate(problem, plan, costs)
    timeline.peak_bytes, timeline.makespan_us
"""
from __future__ import annotations

import bisect
import gc
import itertools
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator

from karma_fx.costs import Costs
from karma_fx.errors import InvalidPlanError
from karma_fx.joins import check_joins, last_stretch, unshared_share, with_joins
from karma_fx.plan import Decision, GradToHost, Offload, Plan, Recompute, ScheduleRow, StreamWeight
from karma_fx.problem import Problem
from karma_fx.split import split_problem
from karma_fx.wire import as_run_with_costs


@dataclass(frozen=True)
class Interval:
    """Work on one stream: an op, a recompute, a stall, or a copy of one tensor."""

    label: str
    start_us: float
    end_us: float
    kind: str


@dataclass(frozen=True)
class Timeline:
    """What the step looks like under a plan."""

    compute: tuple[Interval, ...]
    d2h: tuple[Interval, ...]
    h2d: tuple[Interval, ...]
    memory: tuple[tuple[float, int], ...]
    """(time µs, device bytes) at every compute step."""
    peak_bytes: int
    makespan_us: float
    compute_us: float
    recompute_us: float
    stall_us: float
    host_peak_bytes: int
    rows: tuple[ScheduleRow, ...] = field(default=())
    peak_op: str = ""
    """The op (or recompute of it) during which the peak occurs."""
    peak_storages: tuple[tuple[str, int], ...] = ()
    """(storage, bytes) resident at the peak, largest first: what a better plan would have to move."""
    issue_us: float = 0.0
    """Compute time spent issuing copies and waiting on them (``Costs.copy_issue_us``)."""
    forward_items: int = 0
    """How many leading entries of ``memory`` belong to the forward (the rest, recomputes included, to the
    backward): a region run of a graph-broken step sees other runs' tensors in each phase differently."""


@dataclass(frozen=True)
class _WindowLoad:
    """One window of a streamed weight, shaped like an ``Offload`` for the prefetch/wait/free machinery (its
    host copy always exists: no device-to-host copy precedes it)."""

    tensor: str
    prefetch_at: str
    reload_before: str
    free_after: str
    index: int


class _Static:
    """What a replay needs from the problem alone, as plain lists and dicts: built once per problem and kept
    while the problem lives (``_static``).

    Why: a strategy replays hundreds of plans over one problem, and on ResNet-1001 (7678 ops, 24k storages)
    rebuilding these per replay, and looking storages up through ``Problem.storage`` in the loops, was a
    third of each replay."""

    __slots__ = ("inputs", "outputs", "size_of", "lives", "arrivals", "names", "in_loops", "chain_inputs",
                 "read_in_backward", "num_fwd_ops", "forward_temps")

    def __init__(self, problem: Problem) -> None:
        self.inputs = [op.inputs for op in problem.ops]
        self.in_loops = [op.name in problem.loop_ops for op in problem.ops] if problem.loop_ops else None
        nf = problem.num_fwd_ops
        self.read_in_backward = ({s.name for s in problem.storages if s.users and s.users[-1] >= nf}
                                 if problem.loop_ops else set())
        held = problem.held_by_runs
        # what an op reads when a recompute chain runs it: its functions hold the rest (``_held_by_functions``)
        self.chain_inputs = [tuple(s for s in op.inputs if (op.name, s) not in held)
                             for op in problem.ops] if held else self.inputs
        self.outputs = [op.outputs for op in problem.ops]
        self.size_of = {st.name: st.size_bytes for st in problem.storages}
        self.lives = {st.name for st in problem.storages if st.lives_to_end}
        self.arrivals = [(st.arrives_at, st.name) for st in problem.storages if st.producer is None]
        self.names = [op.name for op in problem.ops]
        self.num_fwd_ops = nf
        # made and read in the forward only (no plan moves them): a forward function of loops holds them to its end
        self.forward_temps = {st.name for st in problem.storages if problem.loop_ops and st.size_bytes > 0 and
                              st.kind in ("temp", "activation") and st.producer is not None and
                              st.producer < nf and st.users and st.users[-1] < nf}


_STATIC: dict[int, _Static] = {}


def _static(problem: Problem) -> _Static:
    """The problem's ``_Static``, cached by identity (a ``Problem`` is frozen, and ``dataclasses.replace``
    makes a new object) and dropped when the problem is collected, so an id is never reused stale."""
    key = id(problem)
    found = _STATIC.get(key)
    if found is None:
        found = _Static(problem)
        try:
            weakref.finalize(problem, _STATIC.pop, key, None)
        except TypeError:  # not weak-referenceable: do not cache
            return found
        _STATIC[key] = found
    return found


def simulate(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs, *, detail: bool = True) -> Timeline:
    """Replay ``plan`` over ``problem`` with ``costs``; raises ``InvalidPlanError`` for an invalid plan.

    ``detail=False`` leaves out the schedule rows and what is resident at the peak (``rows``,
    ``peak_storages``): a strategy probing hundreds of plans needs only the figures.

    Python's cyclic garbage collector is paused meanwhile: a replay allocates tens of thousands of small
    objects (none in a reference cycle), and each collection it triggers walks the whole problem; on
    ResNet-1001 that was half of the 0.3 s a replay takes."""
    with paused_gc():
        return _replay(problem, plan, costs, detail)


def peak_and_makespan(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs) -> tuple[int, float]:
    """``(peak_bytes, makespan_us)`` of ``simulate(problem, plan, costs)``, the same numbers, the same checks
    (``InvalidPlanError``), without building the per-op intervals and memory profile a ``Timeline`` holds.

    Why: a heuristic's probes (greedy's bisections, the block pass's copies) only ask "does it fit, how fast";
    the intervals were a fifth of a replay on ResNet-1001."""
    with paused_gc():
        return _replay(problem, plan, costs, False, figures_only=True)


def wait_where_copies_land(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs) -> tuple[Decision, ...]:
    """The plan's decisions, each offload's ``release_before`` moved to the first op that the replay starts
    once its device→host copy has landed (or set there, where it had none), if that op is earlier than the
    one it had and no later than its prefetch.

    Why: the replay frees a swapped-out tensor when its copy lands, but a real copy engine can run late (a
    copy thread sharing the cores, a slower link than the cost model's), and compute that runs ahead of it
    allocates on top of a source the copy still holds: the measured peak passes the plan's. Waiting where the
    replay already has the copy done costs nothing when copies run as modelled (the replay, schedule rows
    included, is unchanged), and turns a late copy into a stall instead of memory over the plan. Within a run
    of recompute items the wait goes before the next op: a copy late by more than those items can still add
    its bytes there."""
    decisions = tuple(plan.decisions if isinstance(plan, Plan) else plan)
    if not any(isinstance(d, (Offload, GradToHost)) for d in decisions):
        return decisions
    problem, costs = _as_split(problem, plan, costs)
    problem, costs = as_run_with_costs(problem, decisions, costs)
    with paused_gc():
        seq, _, _, streams = _phases(problem, decisions, costs, intervals=False)
    out: list[Decision] = []

    def landing_op(d: Decision) -> int | None:
        """The first op the replay starts once ``d``'s device→host copy has landed (within a run of recompute
        items, the next op); ``None`` when it lands after the last one (waited for at the step's end)."""
        landed = bisect.bisect_left(streams.start_us, streams.d2h_end[id(d)])
        if landed >= len(seq.item_op):
            return None
        op = seq.group_of[landed]
        return op + 1 if seq.first_item[op] != landed else op  # mid-way through a recompute chain: the next op

    for d in decisions:
        if isinstance(d, Offload):
            op = landing_op(d)
            if op is not None:
                op = max(op, problem.op_index(d.free_after) + 1)
                latest = problem.op_index(d.prefetch_at if d.release_before is None else d.release_before)
                if op < latest or (op == latest and d.release_before is None):
                    d = replace(d, release_before=problem.ops[op].name)
        elif isinstance(d, GradToHost) and d.release_before is None and id(d) in streams.d2h_end:
            op, producer = landing_op(d), problem.storage(d.tensor).producer
            if op is not None and producer is not None and op < len(problem.ops):
                d = replace(d, release_before=problem.ops[max(op, producer + 1)].name)
        out.append(d)
    return tuple(out)


def decisions_as_run(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs, budget_bytes: int,
                     peak: Callable[[tuple[Decision, ...]], int] | None = None) -> tuple[Decision, ...]:
    """The plan's decisions as the rewrite runs them: each swap-out waited for where the replay has it landed
    (``wait_where_copies_land``), then each recompute chain joined by the backward loops Inductor fuses with it
    where the plan still fits (``karma_fx.joins.with_joins``; ``peak``: the replay's peak of some decisions, by
    default this plan's, kernel splits included). ``Prepared.judge`` runs a plan so, and the planner compares
    its candidates so (``strategies.base.judged_figures``)."""
    waited = wait_where_copies_land(problem, plan, costs)
    if peak is None:
        def peak(ds: tuple[Decision, ...]) -> int:
            return peak_and_makespan(problem, plan.replace(decisions=ds) if isinstance(plan, Plan) else ds, costs)[0]
    return with_joins(problem, waited, budget_bytes, peak)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (reference counting still frees everything acyclic): for
    planning code that allocates many small objects over a large problem."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _replay(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs, detail: bool, *,
            figures_only: bool = False):
    """The replay, phase by phase: check the decisions, lay out the compute sequence, place each decision's
    events on it, follow every storage's stays on the device, time the three streams, count the memory."""
    decisions = tuple(plan.decisions if isinstance(plan, Plan) else plan)
    problem, costs = _as_split(problem, plan, costs)
    problem, costs = as_run_with_costs(problem, decisions, costs)
    seq, events, stays, streams = _phases(problem, decisions, costs, intervals=not figures_only)
    if figures_only:
        live = _live_bytes(seq, stays, streams)
        return max(live, default=0), streams.makespan_us
    return _timeline(problem, costs, seq, events, stays, streams, detail)


def _as_split(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs) -> tuple[Problem, Costs]:
    """The step as a plan with ``splits`` runs it (``karma_fx.split``); bare decisions split nothing."""
    if not isinstance(plan, Plan) or not plan.splits:
        return problem, costs
    try:
        return split_problem(problem, costs, plan.splits)
    except ValueError as exc:
        raise InvalidPlanError(str(exc)) from None


def _phases(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs, *, intervals: bool
            ) -> tuple["_Sequence", "_Events", "_Stays", "_Streams"]:
    """Phases 0-4 of the replay (everything but counting the memory), for ``_replay`` and for the questions
    asked of the timing itself (``wait_where_copies_land``)."""
    decisions = tuple(plan.decisions if isinstance(plan, Plan) else plan)
    if len(costs.op_time_us) != len(problem.ops):
        raise InvalidPlanError(f"costs describe {len(costs.op_time_us)} ops, the problem has {len(problem.ops)}")
    _check_decisions(problem, decisions)
    static = _static(problem)
    seq = _sequence(problem, [d for d in decisions if isinstance(d, Recompute)])
    events = _events(problem, decisions, seq)
    stays = _stays(problem, decisions, seq, events, static)
    return seq, events, stays, _timing(problem, costs, seq, events, stays, static, intervals=intervals)


def _op_at(problem: Problem, name: str, what: str) -> int:
    try:
        return problem.op_index(name)
    except KeyError:
        raise InvalidPlanError(f"{what}: no op named {name!r} in {problem.name}") from None


# ---- 0. the decisions themselves ------------------------------------------------------------------------
def _check_decisions(problem: Problem, decisions: tuple[Decision, ...]) -> None:
    """What a decision says on its own must hold: the tensors exist and may move the way it moves them."""
    ops = problem.ops
    for d in decisions:
        if isinstance(d, StreamWeight):
            if problem.has_storage(d.tensor) and problem.storage(d.tensor).kind != "param":
                raise InvalidPlanError(f"{d.tensor} is not a parameter: only weights are streamed from the host")
            if not d.windows and problem.has_storage(d.tensor) and problem.storage(d.tensor).users:
                raise InvalidPlanError(f"{d.tensor} is streamed but has no window on the device")
        if isinstance(d, GradToHost) and problem.has_storage(d.tensor):
            st = problem.storage(d.tensor)
            if st.kind != "gradient" or not st.is_output or st.producer is None:
                raise InvalidPlanError(f"{d.tensor} is not a parameter gradient returned by the step")
    for d in decisions:
        for t in (d.tensors if isinstance(d, Recompute) else (d.tensor,)):
            if not problem.has_storage(t):
                raise InvalidPlanError(f"plan names tensor {t!r}, which is not a storage of {problem.name}")
        if isinstance(d, Offload) and problem.storage(d.tensor).is_output:
            raise InvalidPlanError(f"{d.tensor} is returned by the step: its device copy cannot be dropped")
        if isinstance(d, Recompute):
            if not d.ops or not d.tensors:
                raise InvalidPlanError(f"a recompute before {d.reload_before} must name its tensors and ops")
            made = {s for name in d.ops for s in ops[_op_at(problem, name, "recompute op")].outputs}
            for t in d.tensors:
                st = problem.storage(t)
                if t not in made or st.producer is None or st.lives_to_end:
                    raise InvalidPlanError(f"{t} cannot be dropped and rebuilt by recomputing {list(d.ops)}: "
                                           + ("it is an input or output of the step" if st.producer is None
                                              or st.lives_to_end else "none of those ops makes it"))
    if any(isinstance(d, Recompute) and d.joins for d in decisions):
        check_joins(problem, decisions)


# ---- 1. the compute sequence: recompute chains just before the op they serve ----------------------------
@dataclass
class _Sequence:
    item_op: list[int]
    """item → the op it runs (an op of the step, or a step of a recompute chain)."""
    item_rc: list[Recompute | None]
    """item → the recompute it belongs to (``None``: the op itself)."""
    first_item: list[int]
    """op → its first item (the first step of a recompute chain before it, or the op itself)."""
    op_item: list[int]
    """op → the item that runs the op itself."""
    group_of: list[int]
    """item → the op it runs for (a recompute step counts at the op it serves)."""
    chains_before: dict[int, list[Recompute]]


def _sequence(problem: Problem, recomputes: list[Recompute]) -> _Sequence:
    ops = problem.ops
    n_ops = len(ops)
    chains_before: dict[int, list[Recompute]] = defaultdict(list)
    for r in recomputes:
        chains_before[_op_at(problem, r.reload_before, "recompute reload_before")].append(r)
    if not chains_before:  # one item per op
        return _Sequence(list(range(n_ops)), [None] * n_ops, list(range(n_ops)), list(range(n_ops)),
                         list(range(n_ops)), chains_before)
    item_op: list[int] = []
    item_rc: list[Recompute | None] = []
    group_of: list[int] = []
    first_item = [0] * n_ops
    op_item = [0] * n_ops
    for i in range(n_ops):
        first_item[i] = len(item_op)
        chains = chains_before.get(i)
        if chains:
            for r in chains:
                for name in r.ops:
                    j = _op_at(problem, name, "recompute op")
                    if not ops[j].recomputable:
                        raise InvalidPlanError(f"{name} is {'random' if ops[j].random else 'mutating'}: never "
                                               "recomputed")
                    item_op.append(j)
                    item_rc.append(r)
                    group_of.append(i)
        op_item[i] = len(item_op)
        item_op.append(i)
        item_rc.append(None)
        group_of.append(i)
    return _Sequence(item_op, item_rc, first_item, op_item, group_of, chains_before)


# ---- 2. gaps: where each storage leaves the device and where it comes back -------------------------------
@dataclass
class _Events:
    """Each copy, wait and free of the plan, at the item (or op) where it happens."""

    prefetch_item: dict[int, list[Offload]]  # item → prefetches (and weight windows) issued there
    offload_after_op: dict[int, list[Offload]]  # op → offloads issued after it
    wait_before_item: dict[int, list[Offload]]  # item → prefetches compute waits for before it
    release_before_item: dict[int, list[Offload]]  # item → offloads compute waits for before it
    free_after_item: dict[int, list[Offload]]  # item → device copies dropped after it
    streamed_names: set[str]
    grads_out: dict[str, GradToHost]  # gradient → its copy to the host


def _events(problem: Problem, decisions: tuple[Decision, ...], seq: _Sequence) -> _Events:
    first_item, op_item = seq.first_item, seq.op_item

    def op_at(name: str, what: str) -> int:
        return _op_at(problem, name, what)

    # gap = (free_after item, reload item, decision); the reload item is where the new instance starts.
    gaps: dict[str, list[tuple[int, int, Decision]]] = defaultdict(list)
    prefetch_item: dict[int, list[Offload]] = defaultdict(list)
    offload_after_op: dict[int, list[Offload]] = defaultdict(list)
    wait_before_item: dict[int, list[Offload]] = defaultdict(list)
    release_before_item: dict[int, list[Offload]] = defaultdict(list)
    for d in decisions:
        if not isinstance(d, Offload):
            continue
        s = problem.storage(d.tensor)
        i_off, i_free = op_at(d.offload_after, "offload_after"), op_at(d.free_after, "free_after")
        i_pf, i_rl = op_at(d.prefetch_at, "prefetch_at"), op_at(d.reload_before, "reload_before")
        if s.producer is not None and i_off < s.producer:
            raise InvalidPlanError(f"{d.tensor} is offloaded after {d.offload_after}, before it is produced")
        if not (i_off <= i_free < i_pf <= i_rl):
            raise InvalidPlanError(f"{d.tensor}: need offload_after ≤ free_after < prefetch_at ≤ reload_before, got "
                                   f"{d.offload_after}, {d.free_after}, {d.prefetch_at}, {d.reload_before}")
        if d.release_before is not None:
            i_rel = op_at(d.release_before, "release_before")
            if not (i_free < i_rel <= i_pf):
                raise InvalidPlanError(f"{d.tensor}: need free_after < release_before ≤ prefetch_at, got "
                                       f"{d.free_after}, {d.release_before}, {d.prefetch_at}")
            release_before_item[first_item[i_rel]].append(d)
        gaps[d.tensor].append((op_item[i_free], first_item[i_rl], d))
        prefetch_item[first_item[i_pf]].append(d)
        offload_after_op[i_off].append(d)
        wait_before_item[first_item[i_rl]].append(d)

    window_loads: list[_WindowLoad] = []
    streamed = [d for d in decisions if isinstance(d, StreamWeight)]
    for d in streamed:
        last_free = -1
        for n, w in enumerate(d.windows):
            i_pf, i_rl = op_at(w.prefetch_at, "window prefetch_at"), op_at(w.reload_before, "window reload_before")
            i_fr = op_at(w.free_after, "window free_after")
            if not (last_free < i_pf <= i_rl <= i_fr):
                raise InvalidPlanError(f"{d.tensor}: windows need previous free_after < prefetch_at ≤ reload_before "
                                       f"≤ free_after, got {w.prefetch_at}, {w.reload_before}, {w.free_after}")
            last_free = i_fr
            load = _WindowLoad(d.tensor, w.prefetch_at, w.reload_before, w.free_after, n)
            window_loads.append(load)
            prefetch_item[first_item[i_pf]].append(load)  # type: ignore[arg-type]
            wait_before_item[first_item[i_rl]].append(load)  # type: ignore[arg-type]

    free_after_item: dict[int, list[Offload]] = defaultdict(list)
    for load in window_loads:
        free_after_item[op_item[op_at(load.free_after, "window free_after")]].append(load)  # type: ignore[arg-type]
    for sname, gs in gaps.items():
        gs.sort(key=lambda g: g[0])
        for a, b in zip(gs, gs[1:]):
            if b[0] < a[1]:  # the next gap may only start once the tensor is back and waited for
                raise InvalidPlanError(f"{sname} has overlapping off-device gaps")
        for free_item, _, d in gs:
            free_after_item[free_item].append(d)  # type: ignore[arg-type]
    grads_out = {d.tensor: d for d in decisions if isinstance(d, GradToHost)}
    for d in grads_out.values():
        if d.release_before is not None:
            i_rel, made = op_at(d.release_before, "release_before"), problem.storage(d.tensor).producer
            if made is None or i_rel <= made:
                raise InvalidPlanError(f"{d.tensor}: its copy to the host is waited for before {d.release_before}, "
                                       "which runs before the gradient is made")
            release_before_item[first_item[i_rel]].append(d)  # type: ignore[arg-type]
    return _Events(prefetch_item, offload_after_op, wait_before_item, release_before_item, free_after_item,
                   {d.tensor for d in streamed}, grads_out)


# ---- 3. instances (one per stay on the device) and the reads of each -------------------------------------
@dataclass
class _Stays:
    """One instance per stay of a storage on the device, as parallel lists indexed by instance id (plain
    lists: a replay of ResNet-1001 makes ~24k of them)."""

    storage: list[str]
    size: list[int]
    alloc: list[int]
    """item index where it is allocated."""
    end: list[int]
    """last item index at which it is resident."""
    copy_end_us: list[float]
    """an offload's D2H completion (or a prefetch's H2D one): resident until then too (filled by ``_timing``)."""
    offload_instance: dict[int, int]  # id(offload) → the instance its copy reads
    prefetched_instance: dict[int, int]  # id(offload) → the instance its prefetch writes
    grad_copy_after: dict[int, list[int]]  # op → gradient instances copied out after it
    recompute_frees: dict[int, list[str]]  # op → tensors dropped after it for a recompute


def _stays(problem: Problem, decisions: tuple[Decision, ...], seq: _Sequence, events: _Events,
           static: _Static) -> _Stays:
    ops = problem.ops
    n_ops = len(ops)
    item_op, item_rc, first_item, op_item, group_of = (seq.item_op, seq.item_rc, seq.first_item, seq.op_item,
                                                       seq.group_of)
    n_items = len(item_op)
    inputs, outputs, size_of, in_loops = static.inputs, static.outputs, static.size_of, static.in_loops
    chain_inputs, read_in_backward = static.chain_inputs, static.read_in_backward
    nf, forward_temps = static.num_fwd_ops, static.forward_temps
    forward_reads: list[tuple[int, int]] = []  # (item, instance of a forward temporary) a forward loop op reads
    grads_out = {d.tensor for d in decisions if isinstance(d, GradToHost)}
    chain_reads: list[tuple[int, int]] = []  # (item, instance) a recompute chain's ops read or write
    chain_ends: set[int] = set()  # items of the chain that rebuild one of its tensors
    early_alloc: dict[int, int] = {}  # a chain's joined op → the item where its function starts
    held_until: dict[int, int] = {}  # instance a joined function reads or writes → its last joined item
    # Instances: parallel lists. ``last`` is the last item reading the instance, or its allocation when none
    # does (reads come in item order, so the latest read is the last one).
    i_name: list[str] = []
    i_size: list[int] = []
    i_alloc: list[int] = []
    i_end: list[int] = []
    i_last: list[int] = []
    current: dict[str, int | None] = {}
    arrivals: dict[int, list[str]] = defaultdict(list)
    if n_ops:
        streamed = events.streamed_names
        for at, name in static.arrivals:
            if name not in streamed:
                arrivals[first_item[min(at, n_ops - 1)]].append(name)

    def new_instance(name: str, k: int) -> int:
        i_name.append(name)
        i_size.append(size_of[name])
        i_alloc.append(k)
        i_end.append(-1)
        i_last.append(k)
        return len(i_name) - 1

    offload_instance: dict[int, int] = {}
    grad_copy_after: dict[int, list[int]] = defaultdict(list)
    recompute_frees: dict[int, list[str]] = defaultdict(list)
    made: dict[str, int] = {}
    waited_from: dict[int, tuple[int, Offload]] = {}  # prefetched instance → (item of its wait, decision)
    prefetched_instance: dict[int, int] = {}
    prefetch_item, free_after_item = events.prefetch_item, events.free_after_item

    def check_wait(inst: int, k: int, sname: str, op: int) -> None:
        if k < waited_from[inst][0]:
            d = waited_from[inst][1]
            raise InvalidPlanError(f"{sname} is read by {ops[op].name} before {d.reload_before}, where compute "
                                   "waits for its prefetch: reload_before must be its first read after the gap")

    for k in range(n_items):
        arrived = arrivals.get(k)
        if arrived:
            for name in arrived:
                current[name] = new_instance(name, k)
        r = item_rc[k]
        if r is not None and (k == 0 or item_rc[k - 1] is not r):
            made = {}
            chain_reads = []
            chain_ends = set()
            for t in r.tensors:  # dropped after their last read before this chain
                inst = current.get(t)
                if inst is not None:
                    last = i_last[inst]
                    i_end[inst] = last
                    current[t] = None
                    recompute_frees[group_of[last]].append(t)
        issued = prefetch_item.get(k)
        if issued:
            for d in issued:
                if current.get(d.tensor) is not None:
                    raise InvalidPlanError(f"{d.tensor} is prefetched at {d.prefetch_at} while still on the device")
                inst = current[d.tensor] = new_instance(d.tensor, k)
                prefetched_instance[id(d)] = inst
                waited_from[inst] = (first_item[_op_at(problem, d.reload_before, "reload_before")], d)
        op = item_op[k]
        if r is None:
            held_by_function = in_loops is not None and op < nf and in_loops[op]
            for sname in inputs[op]:
                inst = current.get(sname)
                if inst is None:
                    raise InvalidPlanError(f"{sname} is read by {ops[op].name} while it is not on the device")
                if inst in waited_from:
                    check_wait(inst, k, sname, op)
                i_last[inst] = k
                if held_by_function and sname in forward_temps:
                    forward_reads.append((k, inst))
            for sname in outputs[op]:
                i_name.append(sname)
                i_size.append(size_of[sname])
                i_alloc.append(early_alloc.get(op, k))  # a joined op's function allocates it at its start
                i_last.append(k)
                inst = len(i_name) - 1
                if sname in grads_out:
                    i_end.append(k)  # leaves for the host right away (until its copy lands)
                    grad_copy_after[op].append(inst)
                    continue
                i_end.append(-1)
                current[sname] = inst
            freed = free_after_item.get(k)
            if freed:
                for d in freed:
                    inst = current.get(d.tensor)
                    if inst is None:
                        raise InvalidPlanError(f"{d.tensor} is freed after {d.free_after} but is not on the device")
                    i_end[inst] = k
                    current[d.tensor] = None
                    offload_instance[id(d)] = inst
            continue
        for sname in chain_inputs[op]:
            inst = made.get(sname)
            if inst is None:
                inst = current.get(sname)
            if inst is None:
                raise InvalidPlanError(f"{sname} is read by recomputing {ops[op].name} before {r.reload_before} "
                                       "while it is not on the device")
            if inst in waited_from:
                check_wait(inst, k, sname, op)
            i_last[inst] = k
            chain_reads.append((k, inst))
        for sname in outputs[op]:
            inst = new_instance(sname, k)
            made[sname] = inst
            chain_reads.append((k, inst))
            if sname in r.tensors:
                if sname in read_in_backward:  # the rewrite pins it there
                    chain_ends.add(k)
                if current.get(sname) is not None:
                    raise InvalidPlanError(f"{sname} is recomputed before {r.reload_before} while still on the device")
                current[sname] = inst
        if k + 1 == n_items or item_rc[k + 1] is not r:
            joined_until = -1
            if in_loops is not None:
                if r.joins:  # one function from the chain's last loops to its last joined op
                    start = k
                    while start > 0 and item_rc[start - 1] is r and in_loops[item_op[start - 1]]:
                        start -= 1
                    joined = [_op_at(problem, name, "recompute joins") for name in r.joins]
                    joined_until = max(op_item[j] for j in joined)
                    for j in joined:
                        early_alloc[j] = start
                    for t, inst in chain_reads:
                        if t >= start:
                            held_until[inst] = max(held_until.get(inst, -1), joined_until)
                    chain_ends = {t for t in chain_ends if t < start}  # pinned after the run instead
                _held_by_functions(chain_reads, chain_ends | {k}, item_op, in_loops, i_last)
            for sname, inst in made.items():  # chain temporaries die with the chain
                if sname not in r.tensors:
                    i_end[inst] = max(i_last[inst], held_until.get(inst, -1))
    if forward_reads:
        _held_by_functions(forward_reads, _forward_function_ends(events, seq, nf), item_op, in_loops, i_last)
    for inst, until in held_until.items():  # what a joined function reads or writes lives until it returns
        i_last[inst] = max(i_last[inst], until)
        if 0 <= i_end[inst] < until:
            i_end[inst] = until
    lives = static.lives
    for sname, inst in current.items():
        if inst is not None:
            i_end[inst] = n_items - 1 if sname in lives else i_last[inst]
    for inst, end in enumerate(i_end):
        if end < 0:
            i_end[inst] = i_last[inst]
    for d in decisions:  # the D2H copy must read an instance that exists when it is issued
        if not isinstance(d, Offload):
            continue
        inst_id = offload_instance.get(id(d))
        if inst_id is None or i_alloc[inst_id] > op_item[_op_at(problem, d.offload_after, "offload_after")]:
            raise InvalidPlanError(f"{d.tensor} is not on the device when its offload is issued")
    return _Stays(i_name, i_size, i_alloc, i_end, [0.0] * len(i_name), offload_instance, prefetched_instance,
                  grad_copy_after, recompute_frees)


def _held_by_functions(chain_reads: list[tuple[int, int]], ends: set[int], item_op: list[int],
                       in_loops: list[bool], i_last: list[int]) -> None:
    """On the step Inductor runs, a recompute chain's loop ops are compiled into functions of loops: each
    stretch of consecutive loop items of the chain is one, ended where the chain rebuilds a tensor the backward
    reads (``ends``: those items and the chain's last), where the rewrite passes it through ``karma.wait``
    (``passes.rewrite.recomputations_end_their_functions``), so the backward's loops start a function of their
    own. A function allocates every buffer it writes before it runs and frees what it read only when it
    returns, so each instance a chain's loop op reads or writes (``chain_reads``: item, instance, in item order)
    lives to its function's last item. Counted as dying at its last read, a rebuilt matmul's output was freed
    before the rebuilt tensors were written (``tests/test_simulate.py``). The forward's functions of loops hold
    what they read of its temporaries the same way (``_forward_function_ends``)."""
    end = -1
    for t, inst in chain_reads:
        if not in_loops[item_op[t]]:
            continue
        if t > end:  # a new function: find where it ends
            end = t
            while end not in ends and in_loops[item_op[end + 1]]:
                end += 1
        if i_last[inst] < end:
            i_last[inst] = end


def _forward_function_ends(events: _Events, seq: _Sequence, nf: int) -> set[int]:
    """The items where, on the step Inductor runs, a function of the forward's loops ends besides an extern
    kernel: after an op the plan issues an offload after, before one it issues a prefetch or waits for a copy
    before, and at the forward's last item. A function allocates every buffer it writes before it runs, so a
    forward temporary its loops read lives to its end (``_held_by_functions``). Freed at its last read, an
    attention's 8 MiB scores were gone before the softmax kernel that reads them wrote its two 8 MiB outputs: a
    2-layer GPT (d=128, S=256, 8 heads) planned at 0.7 of its peak peaked 14.7% above its plan, past its budget.
    Held to the problem's run of loops instead, which no plan cuts, the leanest plan of a 1-layer one counted
    19.32 MiB, above its unplanned peak of 16.75."""
    ends = {seq.op_item[op] for op in events.offload_after_op}
    ends.update(k - 1 for k in (*events.prefetch_item, *events.wait_before_item, *events.release_before_item) if k)
    ends.add((seq.first_item[nf] if nf < len(seq.first_item) else len(seq.item_op)) - 1)
    return ends


# ---- 4. timing ------------------------------------------------------------------------------------------
@dataclass
class _Streams:
    compute: list[Interval]
    d2h: list[Interval]
    h2d: list[Interval]
    start_us: list[float]  # item → when compute starts it
    stall_at_op: list[float]
    stall_us: float
    recompute_us: float
    host_events: list[tuple[float, int]]  # (time, bytes arriving on the host (+) or leaving it (-))
    makespan_us: float
    d2h_end: dict[int, float]  # id(offload decision) → when its copy has landed


def _timing(problem: Problem, costs: Costs, seq: _Sequence, events: _Events, stays: _Stays, static: _Static, *,
            intervals: bool = True) -> _Streams:
    """Time the three streams. ``intervals=False`` skips the compute stream's intervals (the figures only)."""
    names, size_of = static.names, static.size_of
    item_op, item_rc, group_of = seq.item_op, seq.item_rc, seq.group_of
    copy_end = stays.copy_end_us
    op_time = costs.op_time_us
    copy_time = costs.copy_time_us
    blocking = costs.copies_block_compute
    issue = costs.copy_issue_us
    prefetch_item, wait_before_item = events.prefetch_item, events.wait_before_item
    release_before_item, offload_after_op = events.release_before_item, events.offload_after_op
    grad_copy_after = stays.grad_copy_after
    compute: list[Interval] = []
    d2h: list[Interval] = []
    h2d: list[Interval] = []
    h2d_end: dict[int, float] = {}
    d2h_end: dict[int, float] = {}
    n_items = len(item_op)
    start_us = [0.0] * n_items
    t = d2h_free = h2d_free = 0.0
    stall_total = recompute_total = 0.0
    stall_at_op = [0.0] * len(problem.ops)
    host_events: list[tuple[float, int]] = []
    joined_share: dict[int, tuple[frozenset[str], float]] = {}  # a joined chain -> (its last loops, their share)
    for k in range(n_items):
        issued = prefetch_item.get(k)
        if issued:
            for d in issued:
                size = size_of[d.tensor]
                if issue:
                    t = _issuing(compute, d.tensor, t, issue, intervals)
                begin = max(t, h2d_free, d2h_end.get(id(d), 0.0))  # the host copy must have landed
                h2d_free = begin + copy_time(size, "h2d")
                h2d_end[id(d)] = h2d_free
                target = stays.prefetched_instance[id(d)]  # written until the copy lands
                copy_end[target] = max(copy_end[target], h2d_free)
                h2d.append(Interval(d.tensor, begin, h2d_free, "prefetch"))
                if not isinstance(d, _WindowLoad):  # a streamed weight's host copy stays
                    host_events.append((h2d_free, -size))
                if blocking:
                    t, waited = _blocked(compute, f"copy {d.tensor}", t, h2d_free)
                    stall_total += waited
                    stall_at_op[group_of[k]] += waited
        waits, releases = wait_before_item.get(k), release_before_item.get(k)
        if waits or releases:
            ready = max([h2d_end[id(d)] for d in waits or ()] + [d2h_end[id(d)] for d in releases or ()],
                        default=t)
            if ready > t:
                compute.append(Interval(f"wait {names[item_op[k]]}", t, ready, "stall"))
                stall_total += ready - t
                stall_at_op[group_of[k]] += ready - t
                t = ready
        start_us[k] = t
        op = item_op[k]
        rc = item_rc[k]
        duration = op_time[op]
        if rc is not None and rc.joins:  # inside its joins' kernel: the share of its traffic they do not read
            share = joined_share.get(id(rc))
            if share is None:
                stretch = last_stretch(problem, rc.ops)
                share = joined_share[id(rc)] = (frozenset(stretch), unshared_share(problem, stretch, rc.joins))
            if names[op] in share[0]:  # never below the price the strategies and the bound give it
                duration = max(duration * share[1], costs.rebuild_us(problem, op))
        if rc is not None:
            if intervals:
                compute.append(Interval(names[op], t, t + duration, "recompute"))
            recompute_total += duration
            t += duration
            continue
        if intervals:
            compute.append(Interval(names[op], t, t + duration, "op"))
        t += duration
        grads = grad_copy_after.get(op)
        if grads:
            for inst in grads:
                size = stays.size[inst]
                if issue:
                    t = _issuing(compute, stays.storage[inst], t, issue, intervals)
                begin = max(t, d2h_free)
                d2h_free = begin + copy_time(size, "d2h")
                d2h.append(Interval(stays.storage[inst], begin, d2h_free, "offload"))
                host_events.append((begin, size))
                copy_end[inst] = max(copy_end[inst], d2h_free)
                d2h_end[id(events.grads_out[stays.storage[inst]])] = d2h_free
                if blocking:
                    t, waited = _blocked(compute, f"copy {stays.storage[inst]}", t, d2h_free)
                    stall_total += waited
                    stall_at_op[group_of[k]] += waited
        offloads = offload_after_op.get(op)
        if offloads:
            for d in offloads:
                size = size_of[d.tensor]
                if issue:
                    t = _issuing(compute, d.tensor, t, issue, intervals)
                begin = max(t, d2h_free)
                d2h_free = begin + copy_time(size, "d2h")
                d2h.append(Interval(d.tensor, begin, d2h_free, "offload"))
                d2h_end[id(d)] = d2h_free
                host_events.append((begin, size))
                inst = stays.offload_instance[id(d)]
                copy_end[inst] = max(copy_end[inst], d2h_free)
                if blocking:
                    t, waited = _blocked(compute, f"copy {d.tensor}", t, d2h_free)
                    stall_total += waited
                    stall_at_op[group_of[k]] += waited
    return _Streams(compute, d2h, h2d, start_us, stall_at_op, stall_total, recompute_total, host_events,
                    max(t, d2h_free, h2d_free), d2h_end)


def _issuing(compute: list[Interval], tensor: str, t: float, issue: float, intervals: bool) -> float:
    """Compute issues a copy of ``tensor`` (and, in the same charge, waits on it later): ``Costs.copy_issue_us``
    of its own time. Returns when compute is free again."""
    if intervals:
        compute.append(Interval(f"copy op {tensor}", t, t + issue, "issue"))
    return t + issue


def _blocked(compute: list[Interval], label: str, t: float, until: float) -> tuple[float, float]:
    """Compute waits for a copy on its own thread (``Costs.copies_block_compute``) until ``until``: the new
    compute time and how long it waited (shown, and counted, as a stall)."""
    if until <= t:
        return t, 0.0
    compute.append(Interval(label, t, until, "stall"))
    return until, until - t


# ---- 5. memory at every compute step --------------------------------------------------------------------
def _resident_until(stays: _Stays, start_us: list[float]) -> list[int]:
    """Each instance's last resident item: its end, or later while a copy of it is still running."""
    ends = list(stays.end)
    for inst, copy_end in enumerate(stays.copy_end_us):
        if copy_end > 0:
            ends[inst] = max(ends[inst], bisect.bisect_left(start_us, copy_end) - 1)
    return ends


def _live_bytes(seq: _Sequence, stays: _Stays, streams: _Streams) -> list[int]:
    """Device bytes at every item."""
    n_items = len(seq.item_op)
    delta = [0] * (n_items + 1)
    for alloc, end, size in zip(stays.alloc, _resident_until(stays, streams.start_us), stays.size):
        delta[alloc] += size
        delta[end + 1] -= size
    delta.pop()
    return list(itertools.accumulate(delta))


def _timeline(problem: Problem, costs: Costs, seq: _Sequence, events: _Events, stays: _Stays, streams: _Streams,
              detail: bool) -> Timeline:
    start_us = streams.start_us
    live = _live_bytes(seq, stays, streams)
    memory = list(zip(start_us, live))
    peak = max(live, default=0)
    peak_item = live.index(peak) if live else 0
    at_peak = []
    if detail:
        for inst, end in enumerate(_resident_until(stays, start_us)):
            if stays.alloc[inst] <= peak_item <= end:
                at_peak.append((stays.storage[inst], stays.size[inst]))
    at_peak.sort(key=lambda e: (-e[1], e[0]))
    peak_op = ""
    if live:
        peak_op = problem.ops[seq.item_op[peak_item]].name
        if seq.item_rc[peak_item] is not None:
            peak_op = f"recompute {peak_op} before {seq.item_rc[peak_item].reload_before}"
    host_peak = live_host = 0
    for _, change in sorted(streams.host_events, key=lambda e: (e[0], e[1])):
        live_host += change
        host_peak = max(host_peak, live_host)

    rows = _schedule_rows(problem, memory, streams.stall_at_op, events.offload_after_op,
                          events.prefetch_item, seq.first_item, seq.op_item, seq.chains_before, events.free_after_item,
                          stays.recompute_frees) if detail else ()
    return Timeline(compute=tuple(streams.compute), d2h=tuple(streams.d2h), h2d=tuple(streams.h2d),
                    memory=tuple(memory), peak_bytes=peak, makespan_us=streams.makespan_us,
                    compute_us=sum(costs.op_time_us), recompute_us=streams.recompute_us, stall_us=streams.stall_us,
                    host_peak_bytes=host_peak, rows=rows, peak_op=peak_op, peak_storages=tuple(at_peak),
                    issue_us=costs.copy_issue_us * (len(streams.d2h) + len(streams.h2d)),  # one charge a copy
                    forward_items=(seq.first_item[problem.num_fwd_ops] if problem.num_fwd_ops < len(problem.ops)
                                   else len(live)))


def _schedule_rows(problem: Problem, memory: list[tuple[float, int]],
                   stall_at_op: list[float], offload_after_op: dict[int, list[Offload]],
                   prefetch_item: dict[int, list[Offload]], first_item: list[int], op_item: list[int],
                   chains_before: dict[int, list[Recompute]], free_after_item: dict[int, list[Offload]],
                   recompute_frees: dict[int, list[str]]) -> tuple[ScheduleRow, ...]:
    """One row per op at which something is issued, freed, recomputed or waited for."""
    rows: list[ScheduleRow] = []
    for i, op in enumerate(problem.ops):
        offload = tuple(d.tensor for d in offload_after_op.get(i, ()))
        prefetch = tuple(d.tensor for d in prefetch_item.get(first_item[i], ()))
        recompute = tuple(t for r in chains_before.get(i, ()) for t in r.tensors)
        free = tuple(d.tensor for d in free_after_item.get(op_item[i], ())) + tuple(recompute_frees.get(i, ()))
        if offload or prefetch or recompute or free or stall_at_op[i] > 0:
            device_bytes = max(m for _, m in memory[first_item[i]: op_item[i] + 1])
            rows.append(ScheduleRow(op=op.name, offload=offload, prefetch=prefetch, recompute=recompute, free=free,
                                    device_bytes=device_bytes, stall_us=round(stall_at_op[i], 3), module=op.module))
    return tuple(rows)
