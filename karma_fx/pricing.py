"""Pricing: what a captured step costs in memory and time, built in one place for every door.

``karma_fx.plan`` / ``prepare``, ``karma_fx.compile``, ``backend="karma"`` and the CLI all hand a captured step
here and get back the ``Problem`` the planner counts bytes on and the ``Costs`` it times with, so a plan printed
is priced as the plan run. Two questions decide how (``Pricing``):

* **Memory.** Where the step runs on the machine planning it (its weights are real tensors on a device), its
  kernels' scratch is measured there (``karma_fx.passes.measure``: the allocator's own events around each
  node, the bytes a kernel allocates beyond what it leaves: a CPU convolution's unfolded input, softmax's row
  buffers, cuDNN / cuBLAS workspace) and counted while the op, or a recompute of it, runs; on CUDA each storage
  is counted at the caching allocator's granularity. A model planned for a device it is not on (built on
  ``meta``) has no scratch to measure: its plan counts tensors only, and says so.
* **Time.** ``"measured"`` times the step's ops on that device and measures its copy ops; ``"roofline"`` prices
  them from FLOPs and bytes on a ``DeviceSpec`` preset. By default (``costs=None``) time is measured where
  memory is, unless a preset was named (``device="h100"``: plan that device, not this one).

The compiler then reshapes both: ``compiler="inductor"`` fuses pointwise chains, whose intermediates are never
allocated and whose ops run as one kernel (``karma_fx.fusion.inductor_model``).
"""
from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch

from karma_fx.costs import Costs, estimate_costs
from karma_fx.device import DeviceSpec, get_device
from karma_fx.errors import KarmaError
from karma_fx.problem import Problem, with_scratch, with_split_costs

log = logging.getLogger("karma_fx.pricing")
COST_MODELS = ("roofline", "measured")
CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator hands out multiples of 512 bytes (``torch.cuda.max_memory_allocated`` counts
those), so a 4-byte tensor holds 512 bytes of the device."""


@dataclass(frozen=True)
class Pricing:
    """How one step is priced: ``time`` ``"measured"`` or ``"roofline"`` (on ``device``), ``memory``
    ``"measured"`` (kernel scratch from the device the step runs on), ``"estimated"`` (under someone's
    profiler: the scratch the same ops had at other shapes, ``borrowed_scratch``) or ``"tensors"`` (storages
    only)."""

    time: str
    memory: str
    device: DeviceSpec
    compiler: str = "eager"

    def describe(self, where: str) -> str:
        """For plans and tables: what the costs are, e.g. ``"cpu: measured times and scratch"``; a preset's
        name alone where nothing was measured (a plan for a device one does not have)."""
        if self.time == "measured":
            return (f"{where}: measured times and scratch" if self.memory == "measured" else
                    f"{where}: measured times, scratch estimated from other shapes" if self.memory == "estimated"
                    else f"{where}: measured times, scratch not measured")
        if self.memory == "measured":
            return f"{self.device.name} roofline times, scratch measured on {where}"
        return self.device.name


def choose(costs: str | None, device: Any, runs_here: bool, compiler: str = "eager") -> Pricing:
    """The pricing for a step: ``costs`` as asked (``None``: measured where the step runs here and no preset
    was named, else roofline); ``device`` a preset name or ``DeviceSpec`` (``None``: none named); ``runs_here``
    whether the step's tensors are real, on the machine planning it."""
    if costs is not None and costs not in COST_MODELS:
        raise KarmaError(f"costs must be one of {COST_MODELS} or None (the default), got {costs!r}")
    if costs == "measured" and not runs_here:
        raise KarmaError('costs="measured" times the step for real: build the model on a real device, not on meta')
    time = costs or ("measured" if runs_here and device is None else "roofline")
    return Pricing(time=time, memory="measured" if runs_here else "tensors", device=get_device(device),
                   compiler=compiler)


MeasuredOps = dict
"""What running steps measured, by what each node computes (``passes.measure.op_signature``): ``(time in µs or
None where not timed, scratch bytes, split costs)``. A session keeps one across its traces (``price``'s
``known``)."""


def price(step: Any, problem: Problem, pricing: Pricing, primals: list[torch.Tensor] | None = None,
          known: MeasuredOps | None = None) -> tuple[Problem, Costs, Pricing]:
    """``problem`` as the device allocates it, its ``Costs``, and the pricing they really had (what could not
    be measured falls back: see ``_measure``), priced as ``pricing`` asks; ``primals`` are the real tensors
    behind the step's placeholders (needed where anything is measured). ``known``: what earlier traces
    measured (read and added to): a step whose every node was measured before is not run again."""
    measured: Any = None
    where = "cpu"
    if pricing.memory == "measured" or pricing.time == "measured":
        if not primals:
            raise KarmaError("measuring a step needs its real tensors")
        device = next(t.device for t in primals if isinstance(t, torch.Tensor))
        where = str(device)
        measured, memory, timed = _measure(step, primals, time=pricing.time == "measured", known=known)
        if device.type == "cuda":
            problem = allocator_sizes(problem, CUDA_BLOCK_BYTES)
        pricing = replace(pricing, memory=memory, time="measured" if timed else "roofline")
    if pricing.memory in ("measured", "estimated"):
        scratch = measured.scratch_bytes
        if pricing.compiler == "inductor":  # measured op by op under eager: a loop Inductor generates has none
            from karma_fx.passes.fusible import SEEDED_LOOP_OPS, fusible_ops

            graph = step.joint.graph
            # its random draws too: eager runs the prims' decomposition, which allocated 8 MiB per attention
            # dropout of a 4-layer GPT that Inductor's generated draws never allocate
            loops = fusible_ops(graph) | {n.name for n in graph.nodes if str(n.target) in SEEDED_LOOP_OPS}
            scratch = {name: b for name, b in scratch.items() if name not in loops}
        problem = with_scratch(problem, scratch)
        # a split's time measured on this machine means nothing for a preset's roofline: modelled there
        problem = with_split_costs(problem, measured.split_costs, timed=pricing.time == "measured")
    if pricing.time == "measured":
        costs = _measured_costs(problem, measured.op_time_us, primals or [])
    else:
        costs = estimate_costs(problem, pricing.device)
    costs = replace(costs, device=pricing.describe(where))
    if pricing.compiler == "inductor":
        from karma_fx.fusion import inductor_model
        from karma_fx.passes.fusible import addmm_adds, fusible_ops, inlined_ops, inlined_past_views

        graph = step.joint.graph
        problem, costs = inductor_model(problem, costs, fusible_ops(graph), inlined_ops(graph), pricing.device,
                                        measured=pricing.time == "measured", past_views=inlined_past_views(graph),
                                        addmm_adds=addmm_adds(graph))
        from karma_fx.rebuild_price import with_rebuild_shares

        costs = with_rebuild_shares(problem, costs)  # a rebuild the backward's loops join costs less
    return problem, costs, pricing


def shared_op_times(base: Problem, base_costs: Costs, other: Problem, other_costs: Costs) -> Costs:
    """``other_costs`` with each op that ``other`` shares with ``base`` timed as in ``base``: the two traces of
    one step (its loss head as written and chunked, ``Prepared.twins``) are planned side by side and the faster
    plan runs, so what they share must cost the same in both. Timed apart, it did not: the same dropout ops of a
    4-layer GPT took 16.1, 18.7 and 32.1 ms a piece in three captures, and whether a plan chunked the head
    followed that noise (runs of one bench cell 0.99-1.30x PyTorch's step).

    Ops are matched in order by what they compute and the sizes they write (their measured scratch aside), not
    by name (the chunked trace numbers its nodes otherwise after the head) nor by what they read (under
    Inductor an op reads what its fused chain reads, which reaches into the head): the common start and end
    first, in linear time, then ``difflib``'s matching blocks over what lies between (the head, where the
    traces differ), which on repeated layers would grow with the square of the graph."""
    import difflib

    def signature(problem: Problem) -> list[tuple]:
        return [(op.target, op.phase, tuple(problem.storage(n).size_bytes for n in op.outputs
                                            if not n.endswith(":scratch"))) for op in problem.ops]

    a, b = signature(base), signature(other)
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    times = list(other_costs.op_time_us)
    times[:start] = base_costs.op_time_us[:start]
    if end:
        times[len(b) - end:] = base_costs.op_time_us[len(a) - end:]
    matcher = difflib.SequenceMatcher(None, a[start:len(a) - end], b[start:len(b) - end], autojunk=False)
    for block in matcher.get_matching_blocks():
        times[start + block.b:start + block.b + block.size] = \
            base_costs.op_time_us[start + block.a:start + block.a + block.size]
    return replace(other_costs, op_time_us=tuple(times))


def allocator_sizes(problem: Problem, block_bytes: int) -> Problem:
    """``problem`` with every storage's size rounded up to the allocator's block (a CUDA device's 512 bytes)."""
    def rounded(n: int) -> int:
        return -(-n // block_bytes) * block_bytes if n > 0 else 0
    storages = tuple(replace(s, size_bytes=rounded(s.size_bytes)) for s in problem.storages)
    return replace(problem, storages=storages, _index={}, _op_index={})


def _measure(step: Any, primals: list[torch.Tensor], *, time: bool, known: MeasuredOps | None = None
             ) -> tuple[Any, str, bool]:
    """Run the step for real on ``primals`` (on real memory even inside the partitioner's fake mode): its
    per-node scratch and, when ``time``, its times; how the scratch is known (``Pricing.memory``) and whether
    the times were measured. Neither can be in this process under a torch.profiler session already running
    (sessions do not nest: a second one would empty it). On a CPU both are then measured in another process
    (``karma_fx.measure_apart``); where that fails, and on a GPU, the scratch is what ``known`` says of the
    same ops at other shapes (``borrowed_scratch``, ``"estimated"``), or none (``"tensors"``), a GPU's times
    fall back to the roofline, and the session measures again at the region's first run outside the profiler
    (``Session.run``).

    ``known``: where every node of the step was measured before (a region traced again with an output
    detached, ``karma_fx.unused_grads``: the same ops, fewer of them), the step is not run: a measuring run
    on a CPU holds the step as written, op by op, and would break a budget below it in the step that traces
    again; on a GPU it spills every value to the host and back, seconds at real size. Complete measurements
    are added to ``known``."""
    from torch.utils._python_dispatch import _disable_current_modes

    from karma_fx.measure_apart import measured_apart
    from karma_fx.measure_run import ProfilerBusy, profiler_running
    from karma_fx.passes.liveness import aliased_base
    from karma_fx.passes.measure import JointCosts, op_signature, pooled, scratch_and_split_costs, time_joint
    from karma_fx.passes.op_tape import op_tape

    nodes = [node for node in step.joint.graph.nodes if node.op == "call_function"]
    signatures = {node.name: op_signature(node) for node in nodes}
    if known is not None and signatures:
        # a view computes nothing, nor does unpacking a result: one not seen before (the detached output
        # itself; a result's unpacking, named after the node it unpacks) needs no measuring
        views = {node.name: (0.0, 0, ()) for node in nodes
                 if aliased_base(node) is not None or node.target is operator.getitem}
        found = {n: known[sig] if sig in known and (known[sig][0] is not None or not time) else views.get(n)
                 for n, sig in signatures.items()}
        if all(v is not None for v in found.values()):
            return JointCosts(op_time_us={n: v[0] for n, v in found.items()} if time else {},
                              scratch_bytes={n: v[1] for n, v in found.items() if v[1]},
                              split_costs={n: v[2] for n, v in found.items() if v[2]}), "measured", time

    scratch: dict[str, int] = {}
    split: dict[str, tuple[tuple[int, int, float], ...]] = {}
    times: dict[str, float] = {}
    timed = time
    with _disable_current_modes():
        try:
            if profiler_running() and not any(t.is_cuda for t in primals):
                # someone's profiler: in another process, where the times carry no profiler's overhead either
                scratch, split, times = measured_apart(op_tape(step), primals, repeats=1 if time else 0)
                return _known_now(step, signatures, known, times, scratch, split, time), "measured", time
            scratch, split = scratch_and_split_costs(step, primals)
            scratch_known = True
        except ProfilerBusy as busy:
            scratch_known = False
            scratch, split = borrowed_scratch(signatures, known)
            log.warning("karma_fx: %s; so this plan counts %s until the step first runs outside the profiler, "
                        "where it is measured and planned again", busy,
                        "the scratch its ops had at the shapes measured before" if scratch else "tensors only")
        if time:
            try:
                times = time_joint(step, primals, repeats=1, warm_up=not scratch_known)
            except ProfilerBusy:  # a GPU's kernels are timed through the profiler
                timed = False
    if not scratch_known:
        return pooled(step, times, scratch, split), "estimated" if scratch else "tensors", timed
    return _known_now(step, signatures, known, times, scratch, split, timed), "measured", timed


def _known_now(step: Any, signatures: dict[str, Any], known: MeasuredOps | None, times: dict[str, float],
               scratch: dict[str, int], split: dict[str, tuple[tuple[int, int, float], ...]], timed: bool) -> Any:
    """The step's costs pooled (``passes.measure.pooled``), and what each of its ops measured added to
    ``known``."""
    from karma_fx.passes.measure import pooled

    measured = pooled(step, times, scratch, split)
    if known is not None:
        for name, sig in signatures.items():
            t = measured.op_time_us.get(name) if timed else None
            if timed and t is None:
                continue  # (a node the timed run did not reach: not known)
            # the latest measurement: a trace priced again then costs what the last trace measured (a region as
            # written is measured after its chunked-head twin; the larger of the two, a cold first run's, put a
            # tiny GPT-2's retrace above the budget its first step fitted under)
            known[sig] = (t, measured.scratch_bytes.get(name, 0), measured.split_costs.get(name, ()))
    return measured


def borrowed_scratch(signatures: dict[str, Any], known: MeasuredOps | None
                     ) -> tuple[dict[str, int], dict[str, tuple[tuple[int, int, float], ...]]]:
    """Per node, the scratch and split costs ``known`` holds for what it computes (``signatures``:
    ``op_signature`` by node): exactly where the same op was measured at the same shapes, else those of the
    same op measured on another batch (``passes.measure.batch_change``: the nearest batch at least as large,
    else the largest), in proportion to the batch; a split's likewise, with its relative time as it was, where
    its pieces are equal at both batches.

    Why: a step that compiles while someone's torch.profiler runs (a loop profiling every step, the last
    batch of an epoch smaller) cannot measure its kernels' scratch (``ProfilerBusy``), and planned with none a
    small CNN's steps ran 9% over their budget, every step, until one ran outside the profiler. A convolution's
    buffers grow with its batch: kept at the larger batch's size they put the same CNN's floor at 4.48 MiB, and
    without its splits at 3.98, where the step measured at its smaller batch plans under 3.64. Uneven pieces
    are another kernel's: a batch of 12 in 8 pieces (of 2 and of 1) measured 585 KiB of scratch in one
    convolution's backward where 16 in 8 measured 294. The session still measures again at the first run
    outside a profiler."""
    scratch: dict[str, int] = {}
    split: dict[str, tuple[tuple[int, int, float], ...]] = {}
    if not known:
        return scratch, split
    from karma_fx.passes.measure import batch_change, signature_layout

    seen: dict[Any, list[tuple[Any, tuple]]] = {}
    for sig, value in known.items():
        if isinstance(value, tuple) and not (sig and sig[0] == "channels_last"):
            seen.setdefault(signature_layout(sig), []).append((sig, value))
    for name, sig in signatures.items():
        value = known.get(sig)
        if isinstance(value, tuple):
            found, pieces = value[1], value[2]
        else:
            found, pieces, nearest = 0, (), None
            for old_sig, old in seen.get(signature_layout(sig), ()):
                change = batch_change(sig, old_sig)
                if change is None:
                    continue
                new_batch, old_batch = change
                # the nearest batch at least as large, else the largest: a kernel's scratch per sample shrinks as
                # its batch grows (a CPU convolution's at batch 1 is 4.5 times its share at 12), so scaling up from
                # a small batch over-counts: with batch 1 measured too, a CNN at 12 was refused below a floor of
                # 9.26 MiB where, measured, its plan peaks at 3.96
                rank = (old_batch < new_batch, abs(old_batch - new_batch))
                if nearest is None or rank < nearest:
                    nearest = rank
                    found = old[1] * new_batch // old_batch
                    pieces = tuple((k, b * new_batch // old_batch, t) for k, b, t in old[2]
                                   if new_batch % k == 0 and old_batch % k == 0)
        if found:
            scratch[name] = found
        if pieces:
            split[name] = pieces
    return scratch, split


def as_written(step: Any, pricing: Pricing, primals: list[torch.Tensor] | None, known: MeasuredOps | None = None
               ) -> Any:
    """What the step as written (Inductor's own partition) holds above the partition planned
    (``passes.partition.KeepAllExcess``), its convolutions' scratch measured as they run there, channels-last,
    where the step's scratch is measured: the same for every door (``karma_fx.plan`` and ``compile``), or a plan
    printed is not the plan run (a tiny ResNet-50's step as written was priced 9% lower by ``plan``, which
    counted its convolutions' scratch as traced). None where the step has none (the eager compiler) or it
    cannot be priced: the step as written is then the partition planned."""
    from dataclasses import replace

    if step.keep_all_excess is None:
        return None
    try:
        excess = step.keep_all_excess()
    except Exception:  # noqa: BLE001 - the step as written is then the partition planned
        log.debug("Inductor's own partition not priced; a plan that moves nothing keeps the one planned where "
                  "min-cut peaks higher", exc_info=True)
        return None
    if excess.channels_last and pricing.memory == "measured" and primals is not None:
        try:
            scratch = channels_last_scratch(step, primals, known=known)
        except Exception:  # noqa: BLE001 - priced with the convolutions' scratch as traced
            log.debug("the convolutions' channels-last scratch not measured", exc_info=True)
            return excess
        excess = replace(excess, scratch=tuple(sorted(scratch.items())))
    return excess


def channels_last_scratch(step: Any, primals: list[torch.Tensor], known: MeasuredOps | None = None
                          ) -> dict[str, int]:
    """The convolutions' scratch of ``step`` run channels-last (``passes.measure.channels_last_scratch``), on
    real memory even inside the partitioner's fake mode: empty where it cannot be measured. ``known``: as
    ``price``'s (under ``("channels_last", signature)``): where every convolution was measured so before,
    the step is not run again."""
    from torch.utils._python_dispatch import _disable_current_modes

    from karma_fx.measure_apart import scratch_apart
    from karma_fx.passes.fusible import CONVOLUTION_READS
    from karma_fx.passes.measure import channels_last_scratch as measure, op_signature

    keys = {n.name: ("channels_last", op_signature(n)) for n in step.joint.graph.nodes
            if n.target in CONVOLUTION_READS}
    if known is not None and keys and all(k in known for k in keys.values()):
        return {name: known[k] for name, k in keys.items()}
    with _disable_current_modes():
        scratch = measure(step, primals, apart=scratch_apart)
    if known is not None and scratch:
        for name, k in keys.items():
            known[k] = scratch.get(name, 0)
    return scratch


def _measured_costs(problem: Problem, op_time_us: dict[str, float], primals: list[torch.Tensor]) -> Costs:
    """Measured op times with the copy ops' speed measured on the same device."""
    from karma_fx.costs import measured_costs
    from karma_fx.runtime import cpu_copies_are_synchronous

    device = next((t.device for t in primals if isinstance(t, torch.Tensor)), torch.device("cpu"))
    blocking = device.type == "cpu" and cpu_copies_are_synchronous()
    issue_us, d2h, h2d, latency = copy_speed(str(device), blocking)
    return measured_costs(problem, op_time_us, d2h_bytes_per_us=d2h, h2d_bytes_per_us=h2d, copy_latency_us=latency,
                          device=f"measured on {device}", copies_block_compute=blocking, copy_issue_us=issue_us)


@functools.lru_cache(maxsize=None)
def copy_speed(device: str, blocking: bool) -> tuple[float, float, float, float]:
    """(issue µs, D2H bytes/µs, H2D bytes/µs, latency µs) of the karma copy ops on ``device``, measured once a
    process per device and copy mode (``blocking``: a CPU copying on the compute thread): they are the
    device's, not the step's, and each measurement moves 16 MiB through memory the step could use."""
    from torch.utils._python_dispatch import _disable_current_modes

    from karma_fx.device import measure_copy_issue_us, measure_copy_speed

    # The compile path measures inside the partitioner, under its fake mode: the copy ops must be timed on
    # real memory (under it they copied nothing, and read as 381 GB/s on a CPU that copies 8 to 18).
    with _disable_current_modes():
        issue_us = measure_copy_issue_us(torch.device(device))
        d2h, h2d, latency = measure_copy_speed(torch.device(device))
    return issue_us, d2h, h2d, latency
