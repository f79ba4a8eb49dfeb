"""Data-parallel step time on many nodes: the single-device timeline plus gradient exchange and host update.

KARMA's multi-node scheme, as we model it: every GPU runs the same out-of-core step on its shard of the batch
(weak scaling). Gradients are grouped, in the order backward produces them, into buckets of
``bucket_bytes``; each bucket is all-reduced as soon as its last gradient exists, on the network, one bucket
after another, overlapping the rest of backward. With ``host_update`` (KARMA's default), each reduced bucket
is then copied to the host (in the idle gaps of the device-to-host copy engine that the activation offloads
leave), the optimizer updates its parameters there (``host_update_params_per_s``), and the updated weights go
back to the device (with weights out of core the plan already sends each gradient to the host, where it is
exchanged, and the next step streams the weights in anyway); only the last bucket — the first layers, which the next forward needs first — is waited
for, the rest lands while the next forward runs.

All-reduce time per bucket (hierarchical, as NCCL does across nodes): a ring inside the node over NVLink,
``2(G-1)/G · bytes / intra_node_bandwidth``, then a ring across nodes over the network,
``2(n-1)/n · bytes / network_bandwidth + latency`` — with one GPU per node this is the textbook ring
``2(N-1)/N · bytes / bandwidth + latency``.

Everything here is plain data over the ``Timeline`` that ``simulate`` returns: the one simulator still
decides the single-device step; this adds the resources that only exist with many nodes.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from karma_fx.costs import Costs
from karma_fx.errors import KarmaError
from karma_fx.problem import Problem
from karma_fx.simulate import Interval, Timeline

MiB = 1 << 20


@dataclass(frozen=True)
class Cluster:
    """The machines a data-parallel run spans. Defaults: ABCI-like nodes (4 V100 on NVLink, InfiniBand EDR)."""

    nodes: int = 1
    gpus_per_node: int = 1
    network_gbps: float = 100.0
    """Network bandwidth per node, Gbit/s (InfiniBand EDR: 100)."""
    network_latency_us: float = 10.0
    """Fixed cost of one bucket's all-reduce across nodes."""
    intra_node_gbps: float = 1200.0
    """GPU-to-GPU bandwidth inside a node, Gbit/s (V100 NVLink 2: 150 GB/s)."""
    bucket_bytes: int = 25 * MiB
    host_update: bool = True
    """Apply the optimizer on the host (KARMA); otherwise on the device, which we count as free."""
    host_update_params_per_s: float = 1.0e9
    """Host optimizer throughput, parameters per second (fused CPU AdamW on a two-socket server; measure
    yours with ``measure_host_update_rate``)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KarmaError(f"{name} must be a positive integer, got {value!r}")
        for name in ("network_gbps", "intra_node_gbps", "host_update_params_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise KarmaError(f"{name} must be a positive number, got {value!r}")
        if not 0 <= self.network_latency_us < math.inf:
            raise KarmaError(f"network_latency_us must be non-negative, got {self.network_latency_us!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def allreduce_us(self, size_bytes: int) -> float:
        """One bucket's all-reduce (see the module docstring); zero on a single GPU."""
        us = 0.0
        g, n = self.gpus_per_node, self.nodes
        if g > 1:
            us += 2 * (g - 1) / g * size_bytes / (self.intra_node_gbps * 1e9 / 8 / 1e6)
        if n > 1:
            us += 2 * (n - 1) / n * size_bytes / (self.network_gbps * 1e9 / 8 / 1e6) + self.network_latency_us
        return us


@dataclass(frozen=True)
class ParallelStep:
    """The predicted data-parallel step."""

    step_time_us: float
    single_step_us: float
    """The out-of-core step of one device alone (the timeline's makespan), no exchange, no host update."""
    compute_us: float
    copy_us: float
    """Busy time of the host<->device copy engines: activation swaps, gradients out, weights back."""
    allreduce_us: float
    host_update_us: float
    buckets: int
    allreduce: tuple[Interval, ...] = ()
    host: tuple[Interval, ...] = ()

    def share(self, busy_us: float) -> float:
        """``busy_us`` as a fraction of the step (resources overlap, so shares add up to more than 1)."""
        return busy_us / self.step_time_us if self.step_time_us > 0 else 0.0


def _gradient_ready_times(problem: Problem, timeline: Timeline) -> tuple[list[tuple[float, int]], bool]:
    """(time the gradient exists, bytes) for every parameter gradient, in production order, and whether the
    plan already sends them to the host (weights out of core: ready when that copy lands)."""
    end_of = {iv.label: iv.end_us for iv in timeline.compute if iv.kind == "op"}
    copied = {iv.label: iv.end_us for iv in timeline.d2h}
    grads = [s for s in problem.storages if s.kind == "gradient" and s.is_output and s.producer is not None]
    on_host = bool(grads) and all(s.name in copied for s in grads)
    ready = [(copied[s.name] if on_host else end_of[problem.ops[s.producer].name], s.size_bytes) for s in grads]
    return sorted(ready), on_host


def _in_gaps(busy: list[tuple[float, float]], earliest: float, duration: float) -> tuple[float, float]:
    """First interval of ``duration`` at or after ``earliest`` that overlaps none of ``busy`` (sorted, disjoint);
    the chosen interval is inserted into ``busy``."""
    start = earliest
    i = bisect.bisect_left(busy, (start, start))
    if i > 0 and busy[i - 1][1] > start:
        start = busy[i - 1][1]
    while i < len(busy) and busy[i][0] < start + duration:
        start = max(start, busy[i][1])
        i += 1
    busy.insert(i, (start, start + duration))
    return start, start + duration


def parallel_step(problem: Problem, timeline: Timeline, costs: Costs, cluster: Cluster) -> ParallelStep:
    """The data-parallel step time of ``timeline`` (one device's planned step) on ``cluster``."""
    grads, on_host = _gradient_ready_times(problem, timeline)
    buckets: list[tuple[float, int]] = []  # (ready time, bytes)
    ready, size = 0.0, 0
    for t, b in grads:
        ready, size = max(ready, t), size + b
        if size >= cluster.bucket_bytes:
            buckets.append((ready, size))
            ready, size = 0.0, 0
    if size:
        buckets.append((ready, size))

    d2h = sorted((iv.start_us, iv.end_us) for iv in timeline.d2h)
    h2d = sorted((iv.start_us, iv.end_us) for iv in timeline.h2d)
    copy_busy = sum(e - s for s, e in d2h + h2d)
    net_free = host_free = 0.0
    allreduce: list[Interval] = []
    host: list[Interval] = []
    end = timeline.makespan_us
    for k, (t, b) in enumerate(buckets):
        done = t
        ar = cluster.allreduce_us(b)
        if ar > 0:
            begin = max(t, net_free)
            net_free = done = begin + ar
            allreduce.append(Interval(f"bucket {k}", begin, done, "allreduce"))
        if not cluster.host_update:
            end = max(end, done)
            continue
        landed = done
        if not on_host:  # weights on the device: the reduced gradient goes out, the updated weights come back
            out = costs.copy_time_us(b, "d2h")
            _, landed = _in_gaps(d2h, done, out)
            copy_busy += out
        begin = max(landed, host_free)
        host_free = begin + (b / 4) / cluster.host_update_params_per_s * 1e6  # fp32 master weights
        host.append(Interval(f"bucket {k}", begin, host_free, "update"))
        ready_for_next = host_free
        if not on_host:
            back = costs.copy_time_us(b, "h2d")
            _, ready_for_next = _in_gaps(h2d, host_free, back)
            copy_busy += back
        if k == len(buckets) - 1:  # the first layers: the next forward starts with them
            end = max(end, ready_for_next)
    return ParallelStep(step_time_us=end, single_step_us=timeline.makespan_us,
                        compute_us=timeline.compute_us + timeline.recompute_us, copy_us=copy_busy,
                        allreduce_us=sum(iv.end_us - iv.start_us for iv in allreduce),
                        host_update_us=sum(iv.end_us - iv.start_us for iv in host), buckets=len(buckets),
                        allreduce=tuple(allreduce), host=tuple(host))


def weak_scaling_efficiency(problem: Problem, timeline: Timeline, costs: Costs, cluster: Cluster) -> float:
    """Step time on one GPU (same host update, no exchange) over the step time on ``cluster``."""
    one = Cluster(nodes=1, gpus_per_node=1, bucket_bytes=cluster.bucket_bytes, host_update=cluster.host_update,
                  host_update_params_per_s=cluster.host_update_params_per_s)
    return parallel_step(problem, timeline, costs, one).step_time_us / parallel_step(
        problem, timeline, costs, cluster).step_time_us


def measure_host_update_rate(params: int = 1 << 24, steps: int = 5) -> float:
    """This machine's host optimizer throughput (parameters per second) with PyTorch's fused CPU AdamW
    (``karma_fx.host.measure_host``)."""
    from karma_fx.host import measure_host

    return measure_host(params, repeats=steps).update_params_per_s
