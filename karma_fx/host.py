"""The host's share of a step whose weights live in host memory: the optimizer's update, and the casts of bf16
on the wire (``karma_fx.wire``), measured on the machine that runs them.

Why measured: with weights out of core every parameter is updated on the host every step, so a step can never be
faster than the host's update, whatever the device and the link do. How fast that is depends on the cores the
host gives the optimizer, and users see host optimizers fall far behind where ranks share a few cores; a
planner that assumed a server's rate would promise a step the host cannot keep up with. So the plan is told
this host's rate (``this_host``, measured once a process) and says when the host is the bottleneck.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["HostSpec", "best_seconds", "host_step_us", "measure_host", "this_host"]


@dataclass(frozen=True)
class HostSpec:
    """What one host does per second for a step whose weights it holds."""

    name: str
    threads: int
    """Compute threads the measurement ran with (``torch.get_num_threads()``)."""
    update_params_per_s: float
    """Fused CPU AdamW, parameters per second (fp32 masters, two fp32 moments)."""
    cast_params_per_s: float
    """fp32 → bf16 copies per second (a weight's bf16 copy; widening a bf16 gradient costs about the same)."""
    copy_gbps: float
    """Host memory copy bandwidth, GB/s (what a pinned buffer is filled at; pinning itself needs CUDA)."""


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()  # warm: first-touch page faults and lazy kernel selection are not the steady step
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_host(params: int = 1 << 22, repeats: int = 3) -> HostSpec:
    """Time this machine: one fused AdamW step over ``params`` fp32 parameters (``foreach`` where fused is
    missing), a cast of as many to bf16, and a copy of as many fp32 bytes; the best of ``repeats``."""
    import torch

    p = torch.zeros(params, requires_grad=True)
    p.grad = torch.randn(params)
    try:
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()
    except (RuntimeError, TypeError):  # an older torch without fused CPU AdamW
        opt = torch.optim.AdamW([p], foreach=True)
        opt.step()
    narrow = torch.empty(params, dtype=torch.bfloat16)
    target = torch.empty(params)
    update_s = best_seconds(opt.step, repeats)
    cast_s = best_seconds(lambda: narrow.copy_(p.detach()), repeats)
    copy_s = best_seconds(lambda: target.copy_(p.detach()), repeats)
    return HostSpec(name="this host (measured)", threads=torch.get_num_threads(),
                    update_params_per_s=params / update_s, cast_params_per_s=params / cast_s,
                    copy_gbps=params * 4 / copy_s / 1e9)


@functools.lru_cache(maxsize=1)
def this_host() -> HostSpec:
    """``measure_host()``, once a process (about half a second)."""
    return measure_host()


def host_step_us(host: HostSpec, updated_params: int, cast_params: int = 0) -> float:
    """The host's work in one step: ``updated_params`` optimizer updates and ``cast_params`` casts."""
    return (updated_params / host.update_params_per_s + cast_params / host.cast_params_per_s) * 1e6
