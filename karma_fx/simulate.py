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

It shares no arithmetic with any strategy or solver, so it is the like-for-like judge for all of them. It also
validates the plan (a tensor read while off the device, a recompute input missing, …) and says what is wrong.

Example::

    timeline = simulate(problem, plan, costs)
    timeline.peak_bytes, timeline.makespan_us
"""
from __future__ import annotations

import bisect
import gc
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from karma_fx.costs import Costs
from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Decision, GradToHost, Offload, Plan, Recompute, ScheduleRow, StreamWeight
from karma_fx.problem import Problem


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


@dataclass(slots=True)
class _Item:
    op: int
    recompute: Recompute | None = None
    reads: list[int] = field(default_factory=list)  # instance ids
    writes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _WindowLoad:
    """One window of a streamed weight, shaped like an ``Offload`` for the prefetch/wait/free machinery (its
    host copy always exists: no device-to-host copy precedes it)."""

    tensor: str
    prefetch_at: str
    reload_before: str
    free_after: str
    index: int


@dataclass(slots=True)
class _Instance:
    storage: str
    size: int
    alloc: int  # item index
    end: int = -1  # last item index at which it is resident
    copy_end_us: float = 0.0  # an offload's D2H completion: resident until then too


def simulate(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs, *, detail: bool = True) -> Timeline:
    """Replay ``plan`` over ``problem`` with ``costs``; raises ``InvalidPlanError`` for an invalid plan.

    ``detail=False`` leaves out the schedule rows and what is resident at the peak (``rows``,
    ``peak_storages``): a strategy probing hundreds of plans needs only the figures.

    Python's cyclic garbage collector is paused meanwhile: a replay allocates tens of thousands of small
    objects (none in a reference cycle), and each collection it triggers walks the whole problem; on
    ResNet-1001 that was half of the 0.3 s a replay takes."""
    with paused_gc():
        return _replay(problem, plan, costs, detail)


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


def _replay(problem: Problem, plan: Plan | Iterable[Decision], costs: Costs, detail: bool) -> Timeline:
    """The replay, phase by phase: check the decisions, lay out the compute sequence, place each decision's
    events on it, follow every storage's stays on the device, time the three streams, count the memory."""
    decisions = tuple(plan.decisions if isinstance(plan, Plan) else plan)
    if len(costs.op_time_us) != len(problem.ops):
        raise InvalidPlanError(f"costs describe {len(costs.op_time_us)} ops, the problem has {len(problem.ops)}")
    _check_decisions(problem, decisions)
    seq = _sequence(problem, [d for d in decisions if isinstance(d, Recompute)])
    events = _events(problem, decisions, seq)
    stays = _stays(problem, decisions, seq, events)
    streams = _timing(problem, costs, seq, events, stays)
    return _timeline(problem, costs, seq, events, stays, streams, detail)


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


# ---- 1. the compute sequence: recompute chains just before the op they serve ----------------------------
@dataclass
class _Sequence:
    items: list[_Item]
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
    items: list[_Item] = []
    first_item = [0] * n_ops
    op_item = [0] * n_ops
    for i in range(n_ops):
        first_item[i] = len(items)
        for r in chains_before.get(i, ()):
            for name in r.ops:
                j = _op_at(problem, name, "recompute op")
                if not ops[j].recomputable:
                    raise InvalidPlanError(f"{name} is {'random' if ops[j].random else 'mutating'}: never recomputed")
                items.append(_Item(op=j, recompute=r))
        op_item[i] = len(items)
        items.append(_Item(op=i))
    group_of = [0] * len(items)
    for i in range(n_ops):
        for k in range(first_item[i], op_item[i] + 1):
            group_of[k] = i
    return _Sequence(items, first_item, op_item, group_of, chains_before)


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
    return _Events(prefetch_item, offload_after_op, wait_before_item, release_before_item, free_after_item,
                   {d.tensor for d in streamed})


# ---- 3. instances (one per stay on the device) and the reads of each -------------------------------------
@dataclass
class _Stays:
    instances: list[_Instance]
    offload_instance: dict[int, int]  # id(offload) → the instance its copy reads
    prefetched_instance: dict[int, int]  # id(offload) → the instance its prefetch writes
    grad_copy_after: dict[int, list[int]]  # op → gradient instances copied out after it
    recompute_frees: dict[int, list[str]]  # op → tensors dropped after it for a recompute


def _stays(problem: Problem, decisions: tuple[Decision, ...], seq: _Sequence, events: _Events) -> _Stays:
    ops = problem.ops
    n_ops = len(ops)
    items, first_item, op_item, group_of = seq.items, seq.first_item, seq.op_item, seq.group_of
    n_items = len(items)
    grads_out = {d.tensor for d in decisions if isinstance(d, GradToHost)}
    instances: list[_Instance] = []
    reads_of: dict[int, list[int]] = defaultdict(list)
    current: dict[str, int | None] = {}
    arrivals: dict[int, list[str]] = defaultdict(list)
    for st in problem.storages:
        if st.producer is None and n_ops and st.name not in events.streamed_names:
            arrivals[first_item[min(st.arrives_at, n_ops - 1)]].append(st.name)

    size_of = {st.name: st.size_bytes for st in problem.storages}  # a plain dict: faster than storage() here

    def new_instance(name: str, k: int) -> int:
        instances.append(_Instance(name, size_of[name], k))
        return len(instances) - 1

    def leave(sname: str, k: int) -> int | None:
        inst = current.get(sname)
        if inst is not None:
            instances[inst].end = k
            current[sname] = None
        return inst

    offload_instance: dict[int, int] = {}
    grad_copy_after: dict[int, list[int]] = defaultdict(list)
    recompute_frees: dict[int, list[str]] = defaultdict(list)
    made: dict[str, int] = {}
    waited_from: dict[int, tuple[int, Offload]] = {}  # prefetched instance → (item of its wait, decision)
    prefetched_instance: dict[int, int] = {}
    for k, item in enumerate(items):
        for name in arrivals.get(k, ()):
            current[name] = new_instance(name, k)
        r = item.recompute
        if r is not None and (k == 0 or items[k - 1].recompute is not r):
            made = {}
            for t in r.tensors:  # dropped after their last read before this chain
                inst = current.get(t)
                if inst is not None:
                    last = max(reads_of[inst], default=instances[inst].alloc)
                    leave(t, last)
                    recompute_frees[group_of[last]].append(t)
        for d in events.prefetch_item.get(k, ()):
            if current.get(d.tensor) is not None:
                raise InvalidPlanError(f"{d.tensor} is prefetched at {d.prefetch_at} while still on the device")
            current[d.tensor] = new_instance(d.tensor, k)
            prefetched_instance[id(d)] = current[d.tensor]
            waited_from[current[d.tensor]] = (first_item[_op_at(problem, d.reload_before, "reload_before")], d)
        op = ops[item.op]
        for sname in op.inputs:
            inst = made.get(sname) if r is not None else None
            if inst is None:
                inst = current.get(sname)
            if inst is None:
                where = f"recomputing {op.name} before {r.reload_before}" if r is not None else op.name
                raise InvalidPlanError(f"{sname} is read by {where} while it is not on the device")
            if inst in waited_from and k < waited_from[inst][0]:
                d = waited_from[inst][1]
                raise InvalidPlanError(f"{sname} is read by {op.name} before {d.reload_before}, where compute waits "
                                       "for its prefetch: reload_before must be its first read after the gap")
            item.reads.append(inst)
            reads_of[inst].append(k)
        for sname in op.outputs:
            inst = new_instance(sname, k)
            item.writes.append(inst)
            if r is None and sname in grads_out:
                instances[inst].end = k  # leaves for the host right away (until its copy lands)
                grad_copy_after[item.op].append(inst)
                continue
            if r is None:
                current[sname] = inst
                continue
            made[sname] = inst
            if sname in r.tensors:
                if current.get(sname) is not None:
                    raise InvalidPlanError(f"{sname} is recomputed before {r.reload_before} while still on the device")
                current[sname] = inst
        if r is None:
            for d in events.free_after_item.get(k, ()):
                if current.get(d.tensor) is None:
                    raise InvalidPlanError(f"{d.tensor} is freed after {d.free_after} but is not on the device")
                offload_instance[id(d)] = leave(d.tensor, k)  # type: ignore[assignment]
        elif k + 1 == n_items or items[k + 1].recompute is not r:
            for sname, inst in made.items():  # chain temporaries die with the chain
                if sname not in r.tensors:
                    instances[inst].end = max(reads_of[inst], default=instances[inst].alloc)
    for sname, inst in current.items():
        if inst is not None:
            lives = problem.storage(sname).lives_to_end
            instances[inst].end = n_items - 1 if lives else max(reads_of[inst], default=instances[inst].alloc)
    for inst_id, inst in enumerate(instances):
        if inst.end < 0:
            inst.end = max(reads_of[inst_id], default=inst.alloc)
    for d in decisions:  # the D2H copy must read an instance that exists when it is issued
        if not isinstance(d, Offload):
            continue
        inst_id = offload_instance.get(id(d))
        if inst_id is None or instances[inst_id].alloc > op_item[_op_at(problem, d.offload_after, "offload_after")]:
            raise InvalidPlanError(f"{d.tensor} is not on the device when its offload is issued")
    return _Stays(instances, offload_instance, prefetched_instance, grad_copy_after, recompute_frees)


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


def _timing(problem: Problem, costs: Costs, seq: _Sequence, events: _Events, stays: _Stays) -> _Streams:
    ops, items, instances = problem.ops, seq.items, stays.instances
    compute: list[Interval] = []
    d2h: list[Interval] = []
    h2d: list[Interval] = []
    h2d_end: dict[int, float] = {}
    d2h_end: dict[int, float] = {}
    start_us = [0.0] * len(items)
    t = d2h_free = h2d_free = 0.0
    stall_total = recompute_total = 0.0
    stall_at_op = [0.0] * len(ops)
    host_events: list[tuple[float, int]] = []
    for k, item in enumerate(items):
        for d in events.prefetch_item.get(k, ()):
            size = problem.storage(d.tensor).size_bytes
            begin = max(t, h2d_free, d2h_end.get(id(d), 0.0))  # the host copy must have landed
            h2d_free = begin + costs.copy_time_us(size, "h2d")
            h2d_end[id(d)] = h2d_free
            target = instances[stays.prefetched_instance[id(d)]]  # written until the copy lands
            target.copy_end_us = max(target.copy_end_us, h2d_free)
            h2d.append(Interval(d.tensor, begin, h2d_free, "prefetch"))
            if not isinstance(d, _WindowLoad):  # a streamed weight's host copy stays
                host_events.append((h2d_free, -size))
            if costs.copies_block_compute:
                t, waited = _blocked(compute, f"copy {d.tensor}", t, h2d_free)
                stall_total += waited
                stall_at_op[seq.group_of[k]] += waited
        ready = max([h2d_end[id(d)] for d in events.wait_before_item.get(k, ())]
                    + [d2h_end[id(d)] for d in events.release_before_item.get(k, ())], default=t)
        if ready > t:
            compute.append(Interval(f"wait {ops[item.op].name}", t, ready, "stall"))
            stall_total += ready - t
            stall_at_op[seq.group_of[k]] += ready - t
            t = ready
        start_us[k] = t
        duration = costs.op_time_us[item.op]
        kind = "recompute" if item.recompute is not None else "op"
        compute.append(Interval(ops[item.op].name, t, t + duration, kind))
        if item.recompute is not None:
            recompute_total += duration
        t += duration
        if item.recompute is None:
            for inst_id in stays.grad_copy_after.get(item.op, ()):
                inst = instances[inst_id]
                begin = max(t, d2h_free)
                d2h_free = begin + costs.copy_time_us(inst.size, "d2h")
                d2h.append(Interval(inst.storage, begin, d2h_free, "offload"))
                host_events.append((begin, inst.size))
                inst.copy_end_us = max(inst.copy_end_us, d2h_free)
                if costs.copies_block_compute:
                    t, waited = _blocked(compute, f"copy {inst.storage}", t, d2h_free)
                    stall_total += waited
                    stall_at_op[seq.group_of[k]] += waited
            for d in events.offload_after_op.get(item.op, ()):
                size = problem.storage(d.tensor).size_bytes
                begin = max(t, d2h_free)
                d2h_free = begin + costs.copy_time_us(size, "d2h")
                d2h.append(Interval(d.tensor, begin, d2h_free, "offload"))
                d2h_end[id(d)] = d2h_free
                host_events.append((begin, size))
                inst = instances[stays.offload_instance[id(d)]]
                inst.copy_end_us = max(inst.copy_end_us, d2h_free)
                if costs.copies_block_compute:
                    t, waited = _blocked(compute, f"copy {d.tensor}", t, d2h_free)
                    stall_total += waited
                    stall_at_op[seq.group_of[k]] += waited
    return _Streams(compute, d2h, h2d, start_us, stall_at_op, stall_total, recompute_total, host_events,
                    max(t, d2h_free, h2d_free))


def _blocked(compute: list[Interval], label: str, t: float, until: float) -> tuple[float, float]:
    """Compute waits for a copy on its own thread (``Costs.copies_block_compute``) until ``until``: the new
    compute time and how long it waited (shown, and counted, as a stall)."""
    if until <= t:
        return t, 0.0
    compute.append(Interval(label, t, until, "stall"))
    return until, until - t


# ---- 5. memory at every compute step --------------------------------------------------------------------
def _timeline(problem: Problem, costs: Costs, seq: _Sequence, events: _Events, stays: _Stays, streams: _Streams,
              detail: bool) -> Timeline:
    items, start_us = seq.items, streams.start_us
    n_items = len(items)
    delta = [0] * (n_items + 1)
    for inst in stays.instances:
        end = inst.end
        if inst.copy_end_us > 0:
            end = max(end, bisect.bisect_left(start_us, inst.copy_end_us) - 1)
        delta[inst.alloc] += inst.size
        delta[end + 1] -= inst.size
    memory: list[tuple[float, int]] = []
    live = 0
    for k in range(n_items):
        live += delta[k]
        memory.append((start_us[k], live))
    peak = max((m for _, m in memory), default=0)
    peak_item = next((k for k, (_, m) in enumerate(memory) if m == peak), 0)
    at_peak = []
    for inst in stays.instances if detail else ():
        end = inst.end
        if inst.copy_end_us > 0:
            end = max(end, bisect.bisect_left(start_us, inst.copy_end_us) - 1)
        if inst.alloc <= peak_item <= end:
            at_peak.append((inst.storage, inst.size))
    at_peak.sort(key=lambda e: (-e[1], e[0]))
    peak_op = ""
    if items:
        peak_op = problem.ops[items[peak_item].op].name
        if items[peak_item].recompute is not None:
            peak_op = f"recompute {peak_op} before {items[peak_item].recompute.reload_before}"
    host_peak = live_host = 0
    for _, change in sorted(streams.host_events, key=lambda e: (e[0], e[1])):
        live_host += change
        host_peak = max(host_peak, live_host)

    rows = _schedule_rows(problem, items, seq.op_item, memory, streams.stall_at_op, events.offload_after_op,
                          events.prefetch_item, seq.first_item, seq.chains_before, events.free_after_item,
                          stays.recompute_frees) if detail else ()
    return Timeline(compute=tuple(streams.compute), d2h=tuple(streams.d2h), h2d=tuple(streams.h2d),
                    memory=tuple(memory), peak_bytes=peak, makespan_us=streams.makespan_us,
                    compute_us=sum(costs.op_time_us), recompute_us=streams.recompute_us, stall_us=streams.stall_us,
                    host_peak_bytes=host_peak, rows=rows, peak_op=peak_op, peak_storages=tuple(at_peak))


def _schedule_rows(problem: Problem, items: list[_Item], op_item: list[int], memory: list[tuple[float, int]],
                   stall_at_op: list[float], offload_after_op: dict[int, list[Offload]],
                   prefetch_item: dict[int, list[Offload]], first_item: list[int],
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
                                    device_bytes=device_bytes, stall_us=round(stall_at_op[i], 3)))
    return tuple(rows)
