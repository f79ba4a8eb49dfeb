"""Time of every op and of every host↔device copy, as plain numbers the simulator and solvers read.

The model is a roofline: an op is bound either by arithmetic or by memory traffic, plus a fixed launch cost.
It is deliberately simple — the planner needs relative costs that are right to within tens of percent (is
recomputing this layer cheaper than reloading its output?), not a kernel-level performance model — and it is
deterministic, so a plan made twice is the same plan.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Literal, Union

from karma_fx.device import DeviceSpec, get_device
from karma_fx.problem import Problem

__all__ = ["Costs", "estimate_costs", "measured_costs", "op_time_us"]

Direction = Literal["d2h", "h2d"]


@dataclass(frozen=True)
class Costs:
    """Per-op compute times (µs, aligned with ``Problem.ops``) and the copy-engine model of one device."""

    op_time_us: tuple[float, ...]
    d2h_bytes_per_us: float
    h2d_bytes_per_us: float
    copy_latency_us: float
    device: str
    allow_offload: bool = True
    """False: no host link to use (recompute-only planning, Checkmate's problem). Every strategy then plans
    keep / recompute only, and the lower bound (``strategies/cpsat/bound.py``) leaves copies out of its relaxation."""
    copies_block_compute: bool = False
    """True where a copy runs on the compute thread itself (a CPU copying synchronously, the default there):
    compute waits for each copy as it is issued, instead of overlapping it on a copy stream."""
    copy_issue_us: float = 0.0
    """Compute time each copy costs the thread that issues it (the copy op's call and the wait for it), µs:
    on a CPU with threaded copies, the runtime's own Python; 0 where the host issues copies ahead of the
    kernels (a GPU) or a copy's latency already holds it (a CPU copying synchronously)."""
    rebuild_shares: tuple[tuple[str, float], ...] = ()
    """(op name, share of its time) for ops whose recomputation Inductor fuses with the backward's loops that
    read what it reads (``karma_fx.joins``): rebuilt there, such an op reads nothing the joined loops do not read
    anyway, so it costs the share of its time the rest of its traffic takes (``karma_fx.rebuild_price``). Ops
    not named cost their whole time when rebuilt. The strategies price every chain at these shares (a lower
    bound stays one); the simulator charges a chain the plan joins the share of the joins it has, never less."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "op_time_us", tuple(float(t) for t in self.op_time_us))
        bad = [t for t in self.op_time_us if not (0 <= t < math.inf)]
        if bad:
            raise ValueError(f"op times must be finite and non-negative, got {bad[:3]}")
        for attr in ("d2h_bytes_per_us", "h2d_bytes_per_us"):
            value = getattr(self, attr)
            if not value > 0:  # inf is allowed: copies that cost only their latency
                raise ValueError(f"{attr} must be positive, got {value!r}")
        if not 0 <= self.copy_latency_us < math.inf:
            raise ValueError(f"copy_latency_us must be non-negative and finite, got {self.copy_latency_us!r}")
        shares = self.rebuild_shares.items() if isinstance(self.rebuild_shares, dict) else self.rebuild_shares
        object.__setattr__(self, "rebuild_shares", tuple((str(name), float(x)) for name, x in shares))
        bad_shares = [(name, x) for name, x in self.rebuild_shares if not 0 <= x <= 1]
        if bad_shares:
            raise ValueError(f"rebuild shares must lie in [0, 1], got {bad_shares[:3]}")
        if not 0 <= self.copy_issue_us < math.inf:
            raise ValueError(f"copy_issue_us must be non-negative and finite, got {self.copy_issue_us!r}")

    @functools.cached_property
    def share_of(self) -> dict[str, float]:
        """``rebuild_shares`` as a mapping, made once: the ops it names are the ones a join makes cheaper."""
        return dict(self.rebuild_shares)

    def rebuild_us(self, problem: Problem, k: int) -> float:
        """What op ``k`` of ``problem`` costs rebuilt in a recompute chain the backward's loops join: its time,
        times its share where ``rebuild_shares`` names it."""
        t = self.op_time_us[k]
        if not self.rebuild_shares:
            return t
        return t * self.share_of.get(problem.ops[k].name, 1.0)

    def copy_time_us(self, size_bytes: int, direction: Direction) -> float:
        """Time to move ``size_bytes`` one way: latency + size / bandwidth; nothing to move costs nothing."""
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be non-negative, got {size_bytes}")
        if direction == "d2h":
            bandwidth = self.d2h_bytes_per_us
        elif direction == "h2d":
            bandwidth = self.h2d_bytes_per_us
        else:
            raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
        if size_bytes == 0:
            return 0.0
        return self.copy_latency_us + size_bytes / bandwidth

    def op_starts_us(self) -> list[float]:
        """When each op starts with nothing offloaded or recomputed, and (the last entry) when the step ends."""
        return [0.0, *itertools.accumulate(self.op_time_us)]

    @property
    def compute_time_us(self) -> float:
        """Step time with nothing offloaded or recomputed: every op once, back to back."""
        return math.fsum(self.op_time_us)


def op_time_us(flops: int, bytes_accessed: int, dtype: str, device: DeviceSpec) -> float:
    """Roofline time of one op in µs: launch overhead + max(compute time, memory time).

    An op with neither FLOPs nor bytes (a folded view) is free: it launches no kernel.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(f"flops and bytes_accessed must be non-negative, got {flops}, {bytes_accessed}")
    if flops == 0 and bytes_accessed == 0:
        return 0.0
    compute_s = flops / (device.flops_for(dtype) * device.efficiency)
    memory_s = bytes_accessed / device.hbm_bytes_per_s
    return device.kernel_overhead_us + 1e6 * max(compute_s, memory_s)


def estimate_costs(problem: Problem, device: Union[DeviceSpec, str, None] = None, *,
                   allow_offload: bool = True) -> Costs:
    """Costs of ``problem`` on ``device`` (a preset name, a ``DeviceSpec``, or ``None`` for the default h100);
    ``allow_offload=False`` plans as if the device had no host link (recompute only)."""
    spec = get_device(device)
    times = tuple(op_time_us(op.flops, op.bytes_accessed, op.dtype, spec) for op in problem.ops)
    return Costs(
        op_time_us=times,
        d2h_bytes_per_us=spec.d2h_bytes_per_s / 1e6,
        h2d_bytes_per_us=spec.h2d_bytes_per_s / 1e6,
        copy_latency_us=spec.copy_latency_us,
        device=spec.name,
        allow_offload=allow_offload,
    )


def measured_costs(problem: Problem, node_time_us: dict[str, float], *, d2h_bytes_per_us: float,
                   h2d_bytes_per_us: float, copy_latency_us: float, device: str,
                   allow_offload: bool = True, copies_block_compute: bool = False,
                   copy_issue_us: float = 0.0) -> Costs:
    """Costs from times measured on the device at hand (``karma_fx.passes.measure.time_joint``) and its
    measured copy bandwidth: what ``costs="measured"`` plans with. An op not timed (none in practice) costs 0."""
    return Costs(op_time_us=tuple(node_time_us.get(op.name, 0.0) for op in problem.ops),
                 d2h_bytes_per_us=d2h_bytes_per_us, h2d_bytes_per_us=h2d_bytes_per_us,
                 copy_latency_us=copy_latency_us, device=device, allow_offload=allow_offload,
                 copies_block_compute=copies_block_compute, copy_issue_us=copy_issue_us)
