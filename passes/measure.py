"""Measure: run a captured joint graph for real and count the bytes of live storages node by node.

This is the ground truth for the memory model. It shares nothing with the simulator but the execution order:
values are dropped after their last reader (as the partitioned graphs and the caching allocator would), and
the live bytes are read off the real tensors' storages, deduplicated by address, so views, multi-output ops
and storage sizes are exactly what PyTorch allocates. Tangents appear when the backward starts.

Example::

    step = capture(model, (x,))
    measured = measure_step(step, model, (x,))
    measured.peak_bytes
"""
from __future__ import annotations

import bisect
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from karma_fx.measure_run import event_device
from karma_fx.passes.capture import CapturedStep
from karma_fx.passes.fusible import CONVOLUTION_READS
from karma_fx.passes.liveness import execution_order, forward_node_count, tensors_of
from karma_fx.passes.op_tape import OpTape, TapeOp, op_tape, run_tape


@dataclass(frozen=True)
class Measurement:
    live_bytes: dict[str, int]
    """Node name → bytes of live storages while that node's outputs exist (before its dead inputs go)."""
    peak_bytes: int


def real_primals(step: CapturedStep, model: nn.Module, args: tuple, kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The real tensors behind the ``primals_*`` placeholders, in order."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    inputs = [leaf for leaf in pytree.tree_leaves((list(args), dict(kwargs or {}))) if isinstance(leaf, torch.Tensor)]
    out: list[torch.Tensor] = []
    for kind, name in zip(step.primal_kinds, step.primal_names):
        if kind == "param":
            out.append(params[name].detach())
        elif kind == "buffer":
            out.append(buffers[name].clone())  # the step updates buffers functionally; keep the model's intact
        else:
            out.append(inputs[int(name[len("input["):-1])].detach())
    return out


def measure_step(step: CapturedStep, model: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Measurement:
    """Execute ``step.joint`` on real tensors (small models, CPU) and record live storage bytes per node."""
    graph = step.joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals = real_primals(step, model, args, kwargs)
    order = execution_order(step)
    num_fwd = forward_node_count(step)
    position = {n: i for i, n in enumerate(order)}
    output = next(n for n in graph.nodes if n.op == "output")
    keep_to_end = set(output.all_input_nodes) | set(placeholders[: len(primals)])
    last_use: dict[fx.Node, int] = {}
    for node in order:
        for arg in node.all_input_nodes:
            last_use[arg] = max(last_use.get(arg, -1), position[node])
    dying: dict[int, list[fx.Node]] = {}
    for node, pos in last_use.items():
        if node not in keep_to_end:
            dying.setdefault(pos, []).append(node)
    for node in order:
        if node not in last_use and node not in keep_to_end:
            dying.setdefault(position[node], []).append(node)

    env: dict[fx.Node, Any] = dict(zip(placeholders, primals))
    env.update(graph_constants(step.joint))
    tangents = [p for p in placeholders[len(primals):]]
    live_bytes: dict[str, int] = {}
    peak = 0
    with torch.no_grad():
        for pos, node in enumerate(order):
            if pos == num_fwd:
                for ph in tangents:
                    val = ph.meta["val"]
                    env[ph] = torch.ones(val.shape, dtype=val.dtype)
            a, kw = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            env[node] = node.target(*a, **kw)
            live = _live_storage_bytes(env.values())
            live_bytes[node.name] = live
            peak = max(peak, live)
            for dead in dying.get(pos, ()):
                env.pop(dead, None)
            if pos >= num_fwd:
                for ph in tangents:
                    if ph in dying.get(pos, ()):
                        env.pop(ph, None)
    return Measurement(live_bytes=live_bytes, peak_bytes=peak)


def graph_constants(gm: fx.GraphModule) -> dict[fx.Node, Any]:
    """The values of ``gm``'s ``get_attr`` nodes: constants the trace lifted (HF T5 makes scalars and empty
    tensors in its forward, ``_tensor_constant0``...), which no placeholder carries."""
    out: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            out[node] = value
    return out


def _live_storage_bytes(values: Any) -> int:
    """Bytes of the distinct storages behind ``values``, less the host tier (``karma.offload`` outputs and
    their waited aliases): on a CPU the host and the "device" share one allocator, but the plan's budget is
    the device's."""
    from karma_fx.runtime import is_host_tier

    tensors = [t for value in values for t in tensors_of(value)]
    host = {t.untyped_storage().data_ptr() for t in tensors if is_host_tier(t)}
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in host:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


_NODE_TAG = "karma_fx.node:"
"""Prefix of the ``record_function`` range around each node, by which profiler events are tied to nodes."""


@dataclass(frozen=True)
class JointCosts:
    """What running a step for real on its device says about it, per node of the joint graph."""

    op_time_us: dict[str, float]
    """Each node's time: on a CPU its wall time, on CUDA the GPU time of the kernels it launched."""
    scratch_bytes: dict[str, int]
    """Bytes each node's kernels allocate beyond what the node leaves allocated (only nodes with some)."""
    split_costs: dict[str, tuple[tuple[int, int, float], ...]] = field(default_factory=dict)
    """For each node that may run a piece of the batch at a time: ``Op.split_costs`` as measured."""


def measure_joint(step: CapturedStep, primals: list[torch.Tensor], repeats: int = 1) -> JointCosts:
    """Run ``step.joint`` for real and return each node's time and scratch: what ``costs="measured"`` (the
    default where a step runs on the machine planning it) plans with.

    The first run records the device allocator's events (``scratch_bytes``) and warms up (first-touch memory,
    lazily built kernels, library handles); then ``repeats`` timed runs (``time_joint``), pooled by what each
    node does (``pooled``). So measuring costs two runs of the step, where timing it alone took four and its
    scratch one more. The RNG state is restored afterwards (no dropout mask of the training that follows
    changes); the joint graph is functional, so no parameter or buffer is updated."""
    scratch, split = scratch_and_split_costs(step, primals)
    return pooled(step, time_joint(step, primals, repeats=repeats, warm_up=False), scratch, split)


def pooled(step: CapturedStep, op_time_us: dict[str, float], scratch: dict[str, int],
           split: dict[str, tuple[tuple[int, int, float], ...]] | None = None) -> JointCosts:
    """Per-node measurements pooled over the nodes that do the same thing (one target on inputs of the same
    shapes, strides and dtypes, the same other arguments: a repeated layer's matmuls): each gets their median
    time and their largest scratch. A step with identical layers then gives each op as many samples as there
    are layers from one timed run, and a kernel that allocated more on its first call counts everywhere. Split
    costs are pooled the same way: per number of pieces, the largest scratch and the median time."""
    groups: dict[Any, list[str]] = {}
    for node in execution_order(step):
        groups.setdefault(op_signature(node), []).append(node.name)
    times: dict[str, float] = {}
    largest: dict[str, int] = {}
    split = split or {}
    split_costs: dict[str, tuple[tuple[int, int, float], ...]] = {}
    for names in groups.values():
        by_pieces: dict[int, list[tuple[int, float]]] = {}
        for n in names:
            for pieces, nbytes, ratio in split.get(n, ()):
                by_pieces.setdefault(pieces, []).append((nbytes, ratio))
        if by_pieces and all(n in split for n in names):  # offered only where every such node was measured
            pooled_costs = tuple((k, max(b for b, _ in v), statistics.median(r for _, r in v))
                                 for k, v in sorted(by_pieces.items()) if len(v) == len(names))
            split_costs.update((n, pooled_costs) for n in names)
        timed = [op_time_us[n] for n in names if n in op_time_us]
        if timed:
            median = statistics.median(timed)
            times.update((n, median) for n in names)
        most = max((scratch.get(n, 0) for n in names), default=0)
        if most > 0:
            largest.update((n, most) for n in names)
    return JointCosts(op_time_us=times, scratch_bytes=largest, split_costs=split_costs)


def op_signature(node: fx.Node) -> Any:
    """What a node computes, less its values: its target, and for each argument either the tensor's shape,
    strides, dtype and device or the argument itself (scalars, lists of ints, dtypes)."""
    def describe(value: Any) -> Any:
        if isinstance(value, fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("tensor", tuple(val.shape), tuple(val.stride()), val.dtype, val.device.type)
            return ("node", value.name)  # a non-tensor value (a tuple to unpack): tie it to its node
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, describe(v)) for k, v in value.items()))
        return repr(value)
    return (str(node.target), describe(node.args), describe(node.kwargs))


def _is_tensor(described: Any) -> bool:
    """Whether a piece of an ``op_signature`` describes a tensor: ``("tensor", shape, strides, dtype, device)``."""
    return isinstance(described, tuple) and len(described) == 5 and described[0] == "tensor"


def signature_layout(signature: Any) -> Any:
    """``op_signature`` with each tensor cut to its rank, dtype and device: the signatures ``batch_change``
    may relate share one."""
    def cut(value: Any) -> Any:
        if _is_tensor(value):
            return ("tensor", len(value[1]), value[3], value[4])
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value
    return cut(signature)


def batch_change(new: Any, old: Any) -> tuple[int, int] | None:
    """``(new batch, old batch)`` where two ``op_signature``s are the same op on another batch: every tensor the
    same but for its leading size, and every leading size that differs changed from one same old size to one
    same new size (a convolution's input and gradient do, its weight does not); None where they differ
    otherwise (another argument, another inner size)."""
    change: list[tuple[int, int]] = []

    def same(a: Any, b: Any) -> bool:
        if _is_tensor(a):
            if not _is_tensor(b) or a[3:] != b[3:]:
                return False
            if a[1] == b[1]:
                return True
            if len(a[1]) != len(b[1]) or not a[1] or a[1][1:] != b[1][1:] or not a[1][0] or not b[1][0]:
                return False
            change.append((a[1][0], b[1][0]))
            return change[0] == change[-1]
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    return change[0] if same(new, old) and change else None


def time_joint(step: CapturedStep, primals: list[torch.Tensor], repeats: int = 3,
               warm_up: bool = True) -> dict[str, float]:
    """Run ``step.joint`` for real ``repeats`` times and return each node's time in µs: on a CPU its median
    wall time, on CUDA the GPU time of the kernels it launched (``_cuda_kernel_times``, which says why).
    ``warm_up``: one untimed run first (skip it when the step has just run, as in ``measure_joint``).

    The RNG state is restored afterwards, so timing a step changes no dropout mask of the training that
    follows; the joint graph is functional, so no parameter or buffer is updated."""
    if any(t.is_cuda for t in primals):
        return _cuda_kernel_times(step, primals, repeats, warm_up)
    return tape_times(op_tape(step), primals, repeats, warm_up)


def tape_times(tape: OpTape, primals: list[torch.Tensor], repeats: int = 3, warm_up: bool = True
               ) -> dict[str, float]:
    """``time_joint`` on a CPU, of a step written as a tape (``passes.op_tape``)."""
    import gc
    import time

    samples: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def timed(node: TapeOp) -> Iterator[None]:
        begin = time.perf_counter()
        yield
        samples.setdefault(node.name, []).append((time.perf_counter() - begin) * 1e6)

    # No cyclic garbage collection while timing: right after a capture the heap is full of graph objects, and
    # a collection inside a node's interval is charged to that node. Timed runs of a 4-layer d=512 GPT took
    # 829-1230 ms with collection on and 784-946 ms with it paused, for a step that runs in about 780 ms.
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.random.fork_rng(devices=[]):
            if warm_up:
                run_tape(tape, primals, lambda node: contextlib.nullcontext())
            for _ in range(repeats):
                run_tape(tape, primals, timed)
    finally:
        if enabled:
            gc.enable()
    return {name: statistics.median(values) for name, values in samples.items()}


def _cuda_kernel_times(step: CapturedStep, primals: list[torch.Tensor], repeats: int,
                       warm_up: bool = True) -> dict[str, float]:
    """Each node's GPU time in µs: the summed durations of the kernels and copies it launched (CUPTI, through
    torch.profiler), averaged over ``repeats`` runs. Each GPU activity is tied to the aten op that launched it
    (its ``linked_correlation_id``), and that op to the node whose ``record_function`` range it ran in.

    Why not host timers or events around each node: this runner interprets the graph node by node in Python,
    far slower than the compiled step dispatches, so the GPU waits for it between nodes and any interval
    around a node measures the interpreter. Kernel durations do not depend on how fast they were launched.
    The cost model thereby assumes the host keeps ahead of the GPU, as it does in a GPU-bound step."""
    from torch.profiler import record_function

    from karma_fx.measure_run import allocator_events

    tape = op_tape(step)
    with torch.random.fork_rng(devices=[t.device for t in primals if t.is_cuda][:1]):
        if warm_up:  # handles, autotuning
            run_tape(tape, primals, lambda node: contextlib.nullcontext(), spill=True)
        torch.cuda.synchronize()
        with allocator_events() as prof:
            for _ in range(repeats):
                run_tape(tape, primals, lambda node: record_function(_NODE_TAG + node.name), spill=True)
            torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    ranges = sorted((e.start_ns(), e.end_ns(), e.name()[len(_NODE_TAG):]) for e in events
                    if e.name().startswith(_NODE_TAG) and event_device(e) == "CPU")
    starts = [r[0] for r in ranges]
    launched_at = {e.correlation_id(): e.start_ns() for e in events if event_device(e) == "CPU"
                   and e.linked_correlation_id() == 0 and not e.name().startswith(_NODE_TAG)}
    total: dict[str, float] = {name: 0.0 for _, _, name in ranges}
    for e in events:
        if event_device(e) != "CUDA" or e.name() == "[memory]":
            continue
        at = launched_at.get(e.linked_correlation_id())
        i = bisect.bisect_right(starts, at) - 1 if at is not None else -1
        if i >= 0 and at <= ranges[i][1]:
            total[ranges[i][2]] += e.duration_ns() / 1e3
    return {name: t / repeats for name, t in total.items()}


def scratch_bytes(step: CapturedStep, primals: list[torch.Tensor]) -> dict[str, int]:
    """``scratch_and_split_costs``' scratch alone."""
    return scratch_and_split_costs(step, primals)[0]


def scratch_and_split_costs(step: CapturedStep, primals: list[torch.Tensor], *, pieces: bool = True,
                            instead: dict[Any, Callable] | None = None, apart: Callable | None = None
                            ) -> tuple[dict[str, int], dict[str, tuple[tuple[int, int, float], ...]]]:
    """Run ``step.joint`` for real once, node by node, and return for each node the bytes its kernel
    allocates beyond what it leaves allocated: its scratch (a mask cast to the data's dtype in dropout's
    backward, softmax's row buffers, a convolution's reordered weights). Only nodes with some are listed.

    Read off the device allocator's own events (torch.profiler memory records of the primals' device,
    bracketed by a ``record_function`` per node): storage liveness cannot see an allocation that never becomes
    a tensor the graph holds. The RNG state is restored afterwards, as in ``time_joint``.

    Second, each node that may run a piece of the batch at a time (``karma_fx.split_ops``) with scratch is run
    again on the same tensors in each number of pieces the planner may choose (``karma_fx.split.SPLIT_CHUNKS``),
    its scratch measured the same way (a piece's output before it is put in place counts, and whatever part of
    the scratch does not shrink with the batch) and, on a CPU, its wall time against the whole op's, so that a
    split is priced as measured, never assumed (not with ``pieces=False``). ``instead``: as ``run_tape``'s.

    ``apart(tape, primals, pieces, instead)``, where given: how to measure where a torch.profiler session of
    someone else's already runs in this process on a CPU (``karma_fx.measure_apart``: in another process);
    without it, ``ProfilerBusy`` is raised there."""
    from karma_fx.measure_run import profiler_running

    tape = op_tape(step)
    if apart is not None and profiler_running() and not any(t.is_cuda for t in primals):
        return apart(tape, primals, pieces, instead)
    return tape_scratch_and_split_costs(tape, primals, pieces=pieces, instead=instead)


def tape_scratch_and_split_costs(tape: OpTape, primals: list[torch.Tensor], *, pieces: bool = True,
                                 instead: dict[Any, Callable] | None = None
                                 ) -> tuple[dict[str, int], dict[str, tuple[tuple[int, int, float], ...]]]:
    """``scratch_and_split_costs`` of a step written as a tape (``passes.op_tape``)."""
    from torch.profiler import record_function

    from karma_fx.measure_run import allocator_events
    from karma_fx.split import SPLIT_CHUNKS
    from karma_fx.split_ops import SPLIT_OPS

    cuda = any(t.is_cuda for t in primals)
    ratios: dict[str, dict[int, float]] = {}

    def try_pieces(node: TapeOp, args: tuple, kwargs: dict) -> None:
        if node.split_batch <= 1:
            return
        whole = _wall_us(lambda: node.target(*args, **kwargs), cuda)
        for pieces in (k for k in SPLIT_CHUNKS if k <= node.split_batch):
            op = SPLIT_OPS[node.target]
            with record_function(f"{_SPLIT_TAG}{pieces}:{node.name}"):
                out = op(*args, **kwargs, chunks=pieces)
            del out
            took = _wall_us(lambda: op(*args, **kwargs, chunks=pieces), cuda)
            ratios.setdefault(node.name, {})[pieces] = took / whole if whole and took else 0.0

    with torch.random.fork_rng(devices=[t.device for t in primals if t.is_cuda][:1]):
        with allocator_events() as prof:
            run_tape(tape, primals, lambda node: record_function(_NODE_TAG + node.name), spill=cuda,
                     after=try_pieces if pieces else None, instead=instead)
    events = prof.profiler.kineto_results.events()
    device = "CUDA" if cuda else "CPU"
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and event_device(e) == device)
    times = [t for t, _ in memory]
    running, total = [], 0
    for _, nbytes in memory:
        total += nbytes
        running.append(total)

    def transient(e: Any) -> int | None:
        """The range's peak above what it leaves allocated."""
        i, j = bisect.bisect_left(times, e.start_ns()), bisect.bisect_right(times, e.end_ns())
        return max(running[i:j]) - running[j - 1] if j > i else None

    scratch: dict[str, int] = {}
    split_scratch: dict[str, dict[int, int]] = {}
    for e in events:
        if e.name().startswith(_NODE_TAG):
            found = transient(e)
            if found:
                scratch[e.name()[len(_NODE_TAG):]] = found
        elif e.name().startswith(_SPLIT_TAG):
            pieces, name = e.name()[len(_SPLIT_TAG):].split(":", 1)
            found = transient(e)
            if found is not None:
                split_scratch.setdefault(name, {})[int(pieces)] = found
    split: dict[str, tuple[tuple[int, int, float], ...]] = {}
    for name, by_pieces in split_scratch.items():
        lower = tuple((k, b, 0.0 if cuda else ratios.get(name, {}).get(k, 0.0))
                      for k, b in sorted(by_pieces.items()) if b < scratch.get(name, 0))
        if lower:
            split[name] = lower
    return scratch, split


_RESHAPES: dict[Any, Callable] = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                                  torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


def channels_last_scratch(step: CapturedStep, primals: list[torch.Tensor], apart: Callable | None = None
                          ) -> dict[str, int]:
    """Each convolution's scratch (forward and backward, 0 where it has none) with the step run channels-last,
    as Inductor's layout optimization runs it (``passes.fusible.with_channels_last_copies``): the inputs the
    convolutions read are given channels-last, and every activation after follows. It is not the scratch of
    the traced layout: on a CPU, oneDNN reorders a channels-first activation (a small CNN's convolutions
    allocate less channels-last) but a channels-last weight's gradient (ResNet-50 at tiny size: 0.42 MiB
    channels-last against 0.14 MiB for its widest 3x3 convolution's backward, where its step as written
    peaks). Views are run as reshapes (a flatten of a channels-last activation is no view); empty where the
    step cannot run so. ``apart``: as ``scratch_and_split_costs``'."""
    placeholders = [n for n in step.joint.graph.nodes if n.op == "placeholder"]
    forward = torch.ops.aten.convolution.default
    read = {node.args[i] for node in step.joint.graph.nodes if node.target is forward
            for i in CONVOLUTION_READS[forward] if isinstance(node.args[i], fx.Node)}
    given = [t.contiguous(memory_format=torch.channels_last)
             if ph in read and isinstance(t, torch.Tensor) and t.dim() == 4 else t
             for ph, t in zip(placeholders, primals)]
    try:
        scratch, _ = scratch_and_split_costs(step, given, pieces=False, instead=_RESHAPES, apart=apart)
    except RuntimeError:  # a view of a channels-first layout: the convolutions' traced scratch is all there is
        return {}
    return {n.name: scratch.get(n.name, 0) for n in step.joint.graph.nodes if n.target in CONVOLUTION_READS}


_SPLIT_TAG = "karma_fx.split:"
"""Prefix of the ``record_function`` range around a node run again in pieces (``pieces:name`` follows)."""


def _wall_us(fn: Callable[[], Any], cuda: bool) -> float:
    """Wall time of one call of ``fn`` in µs (0.0 on CUDA, where it would time the launch, not the kernels)."""
    if cuda:
        return 0.0
    t0 = time.perf_counter()
    out = fn()
    took = (time.perf_counter() - t0) * 1e6
    del out
    return took
