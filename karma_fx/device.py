"""What the planner needs to know about an accelerator: memory, compute and copy speeds.

A plan is only as good as its cost model, and the cost model only needs a handful of numbers per device. The
presets below are datasheet figures (so a plan can be made on a laptop for a GPU you do not have);
``calibrate()`` measures the same numbers on the machine at hand when one is available.

Conventions:

* ``peak_flops`` for ``float32`` is the plain FP32 (CUDA-core) rate, not TF32: PyTorch does not use TF32 for
  matmuls by default (``torch.backends.cuda.matmul.allow_tf32 = False``). ``bfloat16``/``float16`` are dense
  tensor-core rates (the datasheets' headline numbers are "with sparsity", i.e. twice these).
* ``efficiency`` scales the peak FLOP/s: real matmul-class kernels at training sizes reach roughly 60% of
  the datasheet peak (cuBLAS on large square GEMMs gets 70-90%, but layer-sized GEMMs, attention and
  launch tails pull the average down). Memory bandwidth is used as is.
* Host-link bandwidths are *effective* pinned-memory ``cudaMemcpyAsync`` rates, about 75-80% of the PCIe
  link rate, per direction; ``copy_latency_us`` is the fixed cost of issuing one copy.
* ``memory_bytes`` is the nominal capacity (GiB as ``nvidia-smi`` rounds it); the planner keeps its own
  headroom for the CUDA context and allocator fragmentation.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Union

from karma_fx.errors import KarmaError


class DeviceError(KarmaError, ValueError):
    """An unknown device name or an invalid ``DeviceSpec``."""

__all__ = ["DeviceSpec", "PRESETS", "calibrate", "get_device"]

GiB = 1 << 30
TFLOPS = 1e12
GBps = 1e9


def _normalize_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the cost model sees it. Frozen and hashable so it can key caches and be shared."""

    name: str
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]
    """(dtype, FLOP/s) pairs; a mapping may be passed and is stored sorted. Must include ``float32``."""
    hbm_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    copy_latency_us: float = 10.0
    kernel_overhead_us: float = 3.0
    """Fixed per-op cost (launch + tail) that even an empty kernel pays."""
    link: str = "PCIe"
    efficiency: float = 0.6
    """Fraction of ``peak_flops`` that real kernels reach (see module docstring)."""
    _flops: dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        raw = self.peak_flops
        items = raw.items() if isinstance(raw, Mapping) else raw
        try:
            pairs = tuple(sorted((_normalize_dtype(k), float(v)) for k, v in items))
        except (TypeError, ValueError) as exc:
            raise DeviceError(f"DeviceSpec {self.name!r}: peak_flops must map dtype names to numbers ({exc})") from None
        object.__setattr__(self, "peak_flops", pairs)
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append("name must be a non-empty string")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            problems.append(f"memory_bytes must be a positive int, got {self.memory_bytes!r}")
        for dtype, value in pairs:
            if not value > 0 or value == float("inf"):
                problems.append(f"peak_flops[{dtype!r}] must be a positive finite number, got {value!r}")
        if "float32" not in dict(pairs):
            problems.append("peak_flops must include 'float32' (the fallback for other dtypes)")
        for attr in ("hbm_bytes_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s"):
            value = getattr(self, attr)
            if not _is_number(value) or not 0 < value < float("inf"):
                problems.append(f"{attr} must be a positive finite number, got {value!r}")
        for attr in ("copy_latency_us", "kernel_overhead_us"):
            value = getattr(self, attr)
            if not _is_number(value) or not 0 <= value < float("inf"):
                problems.append(f"{attr} must be a non-negative finite number, got {value!r}")
        if not _is_number(self.efficiency) or not 0 < self.efficiency <= 1:
            problems.append(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        if problems:
            raise DeviceError(f"invalid DeviceSpec {self.name!r}: " + "; ".join(problems))
        self._flops.update(pairs)

    def flops_for(self, dtype: Any) -> float:
        """Peak FLOP/s for ``dtype`` (a name or ``torch.dtype``); dtypes without an entry use the float32 rate."""
        return self._flops.get(_normalize_dtype(dtype), self._flops["float32"])

    def with_(self, **changes: Any) -> "DeviceSpec":
        """A copy with some fields changed (e.g. a smaller ``memory_bytes`` to plan for a shared GPU)."""
        return replace(self, **changes)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Datasheet sources (dense rates; fp32 = non-tensor-core FP32):
#  V100-SXM2-16GB: NVIDIA Tesla V100 datasheet — FP32 15.7 TF, FP16 tensor 125 TF, FP64 7.8 TF, HBM2 900 GB/s.
#    No bf16 hardware: PyTorch runs bf16 matmuls without tensor cores, so bf16 gets the FP32 rate.
#  A100-SXM4-80GB: NVIDIA A100 datasheet — FP32 19.5 TF, BF16/FP16 tensor 312 TF, FP64 9.7 TF, HBM2e 2,039 GB/s.
#  H100-SXM5-80GB: NVIDIA H100 datasheet — FP32 67 TF, BF16/FP16 tensor 989 TF (1,979 sparse), FP64 34 TF,
#    HBM3 3.35 TB/s.
#  H200-SXM-141GB: NVIDIA H200 datasheet — same compute as H100 SXM, HBM3e 4.8 TB/s, 141 GB.
#  GH200 (96 GB HBM3): NVIDIA GH200 Grace Hopper datasheet — H100-class compute, HBM3 4.0 TB/s,
#    NVLink-C2C 900 GB/s total = 450 GB/s per direction between Grace memory and the GPU.
# Host links, effective per direction: PCIe 3.0 x16 ≈ 12 GB/s (15.75 link), 4.0 x16 ≈ 25 GB/s (31.5),
# 5.0 x16 ≈ 50 GB/s (63). Latency ~10 µs per cudaMemcpyAsync over PCIe, ~5 µs over C2C.
_HOPPER_FLOPS = {"float64": 34 * TFLOPS, "float32": 67 * TFLOPS, "bfloat16": 989 * TFLOPS, "float16": 989 * TFLOPS}

PRESETS: dict[str, DeviceSpec] = {
    spec.name.split("-")[0].lower(): spec
    for spec in (
        DeviceSpec(
            name="V100-SXM2-16GB", memory_bytes=16 * GiB,
            peak_flops={"float64": 7.8 * TFLOPS, "float32": 15.7 * TFLOPS, "bfloat16": 15.7 * TFLOPS,
                        "float16": 125 * TFLOPS},
            hbm_bytes_per_s=900 * GBps, d2h_bytes_per_s=12 * GBps, h2d_bytes_per_s=12 * GBps,
            copy_latency_us=10.0, kernel_overhead_us=3.0, link="PCIe 3.0 x16", efficiency=0.6,
        ),
        DeviceSpec(
            name="A100-SXM4-80GB", memory_bytes=80 * GiB,
            peak_flops={"float64": 9.7 * TFLOPS, "float32": 19.5 * TFLOPS, "bfloat16": 312 * TFLOPS,
                        "float16": 312 * TFLOPS},
            hbm_bytes_per_s=2039 * GBps, d2h_bytes_per_s=25 * GBps, h2d_bytes_per_s=25 * GBps,
            copy_latency_us=10.0, kernel_overhead_us=3.0, link="PCIe 4.0 x16", efficiency=0.6,
        ),
        DeviceSpec(
            name="H100-SXM5-80GB", memory_bytes=80 * GiB, peak_flops=_HOPPER_FLOPS,
            hbm_bytes_per_s=3350 * GBps, d2h_bytes_per_s=50 * GBps, h2d_bytes_per_s=50 * GBps,
            copy_latency_us=10.0, kernel_overhead_us=3.0, link="PCIe 5.0 x16", efficiency=0.6,
        ),
        DeviceSpec(
            name="H200-SXM-141GB", memory_bytes=141 * GiB, peak_flops=_HOPPER_FLOPS,
            hbm_bytes_per_s=4800 * GBps, d2h_bytes_per_s=50 * GBps, h2d_bytes_per_s=50 * GBps,
            copy_latency_us=10.0, kernel_overhead_us=3.0, link="PCIe 5.0 x16", efficiency=0.6,
        ),
        DeviceSpec(
            name="GH200-96GB", memory_bytes=96 * GiB, peak_flops=_HOPPER_FLOPS,
            hbm_bytes_per_s=4000 * GBps, d2h_bytes_per_s=450 * GBps, h2d_bytes_per_s=450 * GBps,
            copy_latency_us=5.0, kernel_overhead_us=3.0, link="NVLink-C2C", efficiency=0.6,
        ),
    )
}
"""Keyed by short lower-case name: v100, a100, h100, h200, gh200."""

DEFAULT_DEVICE = "h100"


def get_device(name_or_spec: Union[str, DeviceSpec, None] = None) -> DeviceSpec:
    """Resolve a preset name (case-insensitive; ``"H100"``, ``"h100-80gb"``, ``"H100-SXM5-80GB"``), pass a
    ``DeviceSpec`` through, or return the default (h100) for ``None``.

    A suffix must agree with the preset (``"a100-40gb"`` is refused rather than silently planned on 80 GB).
    """
    if name_or_spec is None:
        return PRESETS[DEFAULT_DEVICE]
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise DeviceError(f"device must be a preset name or a DeviceSpec, got {type(name_or_spec).__name__}")
    key = name_or_spec.strip().lower().replace("_", "-").replace(" ", "-")
    key = key.removeprefix("nvidia-")
    head, *suffix = key.split("-")
    spec = PRESETS.get(head)
    if spec is not None:
        known = set(spec.name.lower().split("-")[1:])
        if all(part in known for part in suffix if part):
            return spec
    raise DeviceError(
        f"unknown device {name_or_spec!r}; presets: "
        + ", ".join(f"{k} ({s.name})" for k, s in PRESETS.items())
        + "; or pass a DeviceSpec / use calibrate()"
    )


def calibrate(device: Any = "cuda", *, size_mb: int = 256) -> DeviceSpec:
    """Measure this machine's GPU: host↔device bandwidth (pinned, ``size_mb`` MiB), copy latency, HBM bandwidth
    (device-to-device copy), per-op overhead and matmul FLOP/s for float32 (TF32 off), bfloat16 and float16.

    Takes a few seconds. The matmul rate measured is what a large square GEMM achieves, hence efficiency 0.9.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("calibrate() needs a CUDA device, and torch.cuda.is_available() is False here; "
                           "use a preset instead, e.g. get_device('h100')")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"calibrate() measures CUDA devices, got {device!r}")
    if size_mb <= 0:
        raise ValueError(f"size_mb must be positive, got {size_mb}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", index)

    def seconds(fn: Any, iters: int) -> float:
        fn()  # warm up (allocations, cuBLAS handles)
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    with torch.cuda.device(index):
        n = size_mb << 20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
        buf2 = torch.empty_like(buf)
        h2d = n / seconds(lambda: buf.copy_(host, non_blocking=True), 5)
        d2h = n / seconds(lambda: host.copy_(buf, non_blocking=True), 5)
        hbm = 2 * n / seconds(lambda: buf2.copy_(buf), 10)  # a copy reads and writes n bytes
        tiny_host = torch.empty(64, dtype=torch.uint8, pin_memory=True)
        tiny = torch.empty(64, dtype=torch.uint8, device=dev)
        latency_us = 1e6 * seconds(lambda: tiny.copy_(tiny_host, non_blocking=True), 100)
        one = torch.zeros(1, device=dev)
        overhead_us = 1e6 * seconds(lambda: one.add_(1), 200)
        del host, buf, buf2

        flops: dict[str, float] = {}
        old_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
                    continue
                m = 4096
                a = torch.randn(m, m, device=dev, dtype=dtype)
                b = torch.randn(m, m, device=dev, dtype=dtype)
                flops[_normalize_dtype(dtype)] = 2 * m**3 / seconds(lambda: torch.mm(a, b), 10)
                del a, b
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old_tf32
        props = torch.cuda.get_device_properties(index)

    return DeviceSpec(
        name=f"calibrated-{props.name}",
        memory_bytes=int(props.total_memory),
        peak_flops=flops,
        hbm_bytes_per_s=hbm,
        d2h_bytes_per_s=d2h,
        h2d_bytes_per_s=h2d,
        copy_latency_us=max(latency_us, 0.0),
        kernel_overhead_us=max(overhead_us, 0.0),
        link="measured",
        efficiency=0.9,
    )


def measure_copy_speed(device: Any) -> tuple[float, float, float]:
    """(D2H bytes/µs, H2D bytes/µs, latency µs) of the karma copy ops on ``device`` as they run here: on CUDA
    ``calibrate()``'s pinned-copy figures; on a CPU the ops' own time for a 16 MiB and a 4-byte tensor (host
    memory to host memory, with the runtime's pool and dispatch overhead in the latency).

    With the copies on a worker thread the latency is the copy engine's own: a 4-byte round trip less the time
    the computing thread spends in the copy ops' calls and waits, which the cost model charges to compute on its
    own (``measure_copy_issue_us``). Left in, a copy that compute waits for was charged it twice."""
    import time

    import torch

    from karma_fx.runtime import cpu_copies_are_synchronous  # importing it registers torch.ops.karma

    dev = torch.device(device)
    if dev.type == "cuda":
        spec = calibrate(dev)
        return spec.d2h_bytes_per_s / 1e6, spec.h2d_bytes_per_s / 1e6, spec.copy_latency_us

    def fastest_us(fn: Any, repeats: int) -> float:
        """The fastest of ``repeats`` runs: the link's own speed. A copy engine on a CPU is a thread, and one
        measurement is kept for the whole process (``pricing.copy_speed``): taken while another process held
        the cores, the median of nine 16 MiB copies read device-to-host 1.4 GB/s instead of 25, and every plan
        of that process then held its swapped-out tensors and gradients as if their copies queued (a streamed
        MLP's floor rose from 530 to 782 KiB). Being descheduled only ever adds time, so the fastest run is the
        one that was not."""
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return min(times)

    # 16 MiB: glibc maps blocks of 32 MiB and more afresh on every allocation, even with freed memory kept
    # (``runtime.keep_freed_host_memory``), and a prefetch allocates its target: at 32 MiB the page faults
    # made host-to-device read 2.4 GB/s, at 16 MiB 11.4 GB/s, the speed the step's smaller tensors see.
    # written, not ``torch.empty``: pages never touched all map the kernel's one zero page, which reads from cache
    # (the fastest of the copies then read as the 100 GB/s cap)
    big, small = torch.ones(4 << 20), torch.ones(1)
    karma = torch.ops.karma
    round_trip = fastest_us(lambda: karma.wait(karma.prefetch(karma.offload(small), dev)), 21) / 2
    if not cpu_copies_are_synchronous():
        round_trip_calls = []
        for _ in range(21):
            start = time.perf_counter()
            host = karma.offload(small)
            issued = time.perf_counter()
            time.sleep(0.001)  # landed by now: the wait then costs only its call
            begin = time.perf_counter()
            karma.wait(host)
            back = karma.prefetch(host, dev)
            issued_back = time.perf_counter()
            time.sleep(0.001)
            again = time.perf_counter()
            karma.wait(back)
            round_trip_calls.append((issued - start + issued_back - begin + time.perf_counter() - again) * 1e6)
        engine_only = round_trip - min(round_trip_calls) / 2
    else:
        engine_only = round_trip
    # Each copy is waited for: with the copies on a worker thread (``KARMA_CPU_COPIES=threads``) the offload
    # call returns as soon as the copy is queued, and timing the call alone read as petabytes per second.
    d2h = fastest_us(lambda: karma.wait(karma.offload(big)), 15)
    host = karma.offload(big)
    h2d = fastest_us(lambda: karma.wait(karma.prefetch(host, dev)), 15)
    nbytes = big.numel() * big.element_size()
    # Each big copy's time holds the same round trip as the small one: what is left is moving the bytes; never
    # faster than host memory moves (a noisy round trip as long as the copy itself once read as 16 PB/s, and
    # the process's compiles all planned with it).
    fastest = nbytes / HOST_COPY_BYTES_PER_US
    return (nbytes / max(d2h - round_trip, fastest), nbytes / max(h2d - round_trip, fastest),
            max(engine_only, 0.0))


HOST_COPY_BYTES_PER_US = 1e5
"""100 GB/s: no CPU core copies host memory faster (one core moves 5-20 GB/s)."""


def measure_copy_issue_us(device: Any) -> float:
    """Compute time one copy costs on ``device`` besides the copy itself, in µs: what a stretch of compute
    takes longer with a 4 MiB copy issued before it and waited for after it, averaged over the two directions.

    On a CPU with threaded copies (``copy_mode("threads")``) the thread that computes also runs the copy ops'
    Python (the host pool, the hand-off to the worker, the bookkeeping that keeps sources alive) and the wait,
    and the worker's share of the interpreter lock and of memory bandwidth is taken from it: 0.3-0.5 ms a copy
    on a 2-core machine, time the step pays in full. Timing the calls alone, with nothing computing beside
    them, read 0.15 ms, and a planned GPT step with 126 copies ran 30 ms over its prediction. On a GPU the host
    issues copies ahead of the kernels and, with copying synchronous on a CPU, the copies' measured latency
    already holds it: 0 for both."""
    import time

    import torch

    from karma_fx.runtime import cpu_copies_are_synchronous

    dev = torch.device(device)
    if dev.type == "cuda" or cpu_copies_are_synchronous():
        return 0.0
    tensor = torch.ones(1 << 20)  # written: untouched pages all read the kernel's one zero page
    square = torch.ones(384, 384)  # two matmuls: 2.6 ms on one thread here, time enough for a 4 MiB copy to land
    offload, prefetch, wait = torch.ops.karma.offload, torch.ops.karma.prefetch, torch.ops.karma.wait

    def compute() -> None:
        torch.mm(square, square)
        torch.mm(square, square)

    def lost_us(issue: Any) -> float:
        # The fastest run of each, not the median of their differences: another process taking a core only adds
        # time, to either run of a pair, and the median of 21 differences read 0 to 1.7 ms while one held them.
        # And never less than the issue call itself, which the computing thread runs whatever the load: two busy
        # processes beside it made the difference read 0. (Not the wait: a copy still running would be in it.)
        alone, beside, calls = [], [], []
        for _ in range(21):
            start = time.perf_counter()
            compute()
            alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = issue()
            issued = time.perf_counter()
            compute()
            wait(out)
            end = time.perf_counter()
            beside.append(end - start)
            calls.append(issued - start)
        return max(min(beside) - min(alone), min(calls)) * 1e6

    host = wait(offload(tensor))
    lost_us(lambda: prefetch(host, dev))  # warm up the pool, the workers and the matmul
    return max((lost_us(lambda: offload(tensor)) + lost_us(lambda: prefetch(host, dev))) / 2, 0.0)
