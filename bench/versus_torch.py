"""The comparison users would make, measured: karma_fx against PyTorch's own ways of saving activation memory, at
equal allocator-measured peak, on medium CPU models whose ops take a millisecond or more.

    python bench/versus_torch.py                                   # at PyTorch's points, Inductor both sides
    python bench/versus_torch.py --models gpt-4x512 --ratios 1.0,0.5,0.0 --rounds 7
    python bench/versus_torch.py --mode sweep                      # the older sweep, described below
    python bench/versus_torch.py --models resnet18-64px --budgets 0.8,0.6 --ratios 1.0,0.5,0.0
    python bench/versus_torch.py --backends aot_eager,inductor     # also the budget partitioner under Inductor
    python bench/versus_torch.py --karma-compilers inductor --backends inductor   # both sides under Inductor

Default (``--mode points``), the bar a user checks first: ``torch.compile(model)`` (Inductor) with
``torch._functorch.config.activation_memory_budget`` at each of ``--ratios``. Per ratio, in one process with a reset
Dynamo: PyTorch's step is compiled under that ratio and its steady-state peak measured (``AllocatorPeak``); karma
(``compiler="inductor"``, measured costs) is compiled with that peak as its budget in bytes and trained ``--settle``
steps with the copies it is timed with (``--copies``: the plan prices each copy) (it measures its step and plans
again where the step broke the budget: ``karma_fx.margin``); karma's steady peak is measured (copies synchronous:
the same plan, freed where it frees); then the two are timed interleaved, one step of each in turn for ``--rounds``
rounds, and the ratio of the medians printed (absolute times drift by several percent over minutes on a shared
machine; their ratio within one process does not). One more row sets karma at ``budget=1.0`` against plain
``torch.compile``. The floors: PyTorch's lowest measured peak over the ratios, and karma's (a budget of 1 KiB is
refused naming the smallest total; karma is trained and measured at it).

Models: a 4-layer d=512 GPT at sequence 512 (batch 2, vocab 2048), a 4-layer d=256 GPT with a vocabulary of 8192
(its loss head dominates: the logits alone are 32 MiB), the same shape as a HuggingFace GPT-2 (which returns its
logits beside the loss: ``torch.compile`` gives them a zero gradient and runs the head's backward on it, karma from
its second step does not: ``karma_fx.unused_grads``), a ResNet-18 (basic blocks [2, 2, 2, 2], width 64) on 64x64
images, batch 32, a VGG-style network (four stages of two 3x3 convolutions and a max pooling, widths 32-128) on
64x64 images, batch 16, and a probe, a two-pass residual MLP (d=128, batch 8x256). Every configuration gets a fresh model
and a reset Dynamo, is run twice (compile, then a steady-state step that fills any host-buffer pool), timed over
``--steps`` steps (median; the fastest is shown too, a hint of how much other work on the machine disturbed them),
then run once more under ``AllocatorPeak`` (torch.profiler's allocator events; weights, buffers and inputs added as
what existed before the step; gradients are dropped before each step, so they count). Where copies run on a worker
thread, one more step with synchronous copies gives the peak where the plan frees (the two agree: compute waits for
each swap-out where the plan has it landed, so a copy that lags behind costs a stall, not memory).

Configurations of ``--mode sweep``:

* ``eager``: the unplanned step, op by op.
* ``karma <strategy> <t>``: ``karma_fx.compile(model, budget=B, strategy=..., costs="measured")``, with ``B``
  at position ``t`` between the compiled step's lowest reachable peak (0) and its unplanned peak (1), both
  read off a probe step; its CPU copies on a worker thread (``--copies``).
* ``aot_eager r``: ``torch.compile(backend="aot_eager")`` with ``torch._functorch.config.
  activation_memory_budget = r`` while it compiles. In torch 2.13 ``aot_eager`` partitions with
  ``min_cut_rematerialization_partition``, which reads the budget, and runs the aten graphs op by op with
  eager kernels, as karma's compiled step does: the like-for-like baseline. It only recomputes.
* ``aot_eager_decomp_partition r`` (``--backends``): the graph Inductor's partitioner sees (Inductor's
  decompositions: batch norm, layer norm as pointwise ops it may recompute), still run with eager kernels.
* ``inductor r`` (``--backends``): the same partitioner with Inductor's fused C++ kernels: a different kernel
  set, so a faster step there says nothing about the plan (and each compile takes a minute or more here).
* ``offload-all``: torchtune-style activation offload on the eager step: ``saved_tensors_hooks`` that copy every
  saved tensor of at least ``--min-offload-bytes`` (not a parameter, buffer or a view of one) to the host on
  pack and back on unpack. The copies are karma's own ``karma.offload`` / ``karma.prefetch`` ops (same copy
  engine, same host pool as karma's plans); the backward fetches each tensor when autograd asks for it (no
  look-ahead prefetch).

What "host" means on a CPU: host and "device" share one allocator. A step's measured peak counts what the
allocator hands out during the step; host buffers come from a pool that persists across steps, so in a
steady-state step they allocate nothing and are not counted, for karma and offload-all alike (as on a GPU,
where pinned host memory is not device memory). Their cost is real and is in the step time: each copy is a
memcpy on the machine's cores. Compute runs on ``--threads`` intra-op threads (default 1), leaving a core to
the copy worker thread, the nearest a CPU gets to a GPU's copy engine; on a GPU a copy competes with compute
for nothing but memory bandwidth, so offloading costs less there than here. Freed host memory is kept for
reuse (``--host-memory keep``), for every configuration, as a GPU's caching allocator keeps device memory.

Pairing (``pair``): each karma point is set against each baseline family's point whose measured peak is the
closest at or above it (within ``--tolerance``), i.e. a baseline given at least as much memory; a faster
baseline point at a peak no higher than karma's (a baseline that dominates) is named too.
"""
# No ``from __future__ import annotations``: tests load this file without registering it in sys.modules, and
# dataclasses resolve string annotations through sys.modules.

import argparse
import itertools
import contextlib
import gc
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch._dynamo
from tabulate import tabulate
from torch import nn

import karma_fx
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.measure_run import measure_step_peak
from karma_fx.zoo import build, output_to_loss

MIB = 2**20


class BasicBlock(nn.Module):
    """Two 3x3 convs with batch norm and a residual (projected when the shape changes): ResNet-18's block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """7x7/2 stem and max pool, four stages of two basic blocks (widths 64, 128, 256, 512), pool, Linear."""

    def __init__(self, classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        blocks: list[nn.Module] = []
        cin = width
        for stage in range(4):
            cout = width * 2**stage
            blocks += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.blocks(self.stem(x))).flatten(1))


def resnet18(batch: int = 32, image: int = 64) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return ResNet18().train(), (torch.randn(batch, 3, image, image),), {}


class TwoPassMLP(nn.Module):
    """Residual blocks of LayerNorm, Linear d→4d, GELU, Linear 4d→d, each block run twice: the probe shape of the
    issue that made Inductor the default (PyTorch's budget partitioner reached 18.04 MiB where karma refused
    every budget below 20.77), a graph made of pointwise ops Inductor fuses and recomputes inside its kernels."""

    def __init__(self, d: int = 128, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
            x = x + block(x)
        return x.square().mean()


def two_pass_mlp(batch: int = 8, seq: int = 256, d: int = 128) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return TwoPassMLP(d).train(), (torch.randn(batch, seq, d),), {}


class SmallVGG(nn.Module):
    """VGG-style stages of 3x3 convolution, ReLU and 2x2 max pooling (widths 32, 64, 128, 128), then a linear
    classifier: each pooled ReLU is read by the backward only through its mask, which min-cut saves instead of the
    ReLU (``passes.narrowing``)."""

    def __init__(self, classes: int = 100, widths: tuple[int, ...] = (32, 64, 128, 128)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for w in widths:
            layers += [nn.Conv2d(cin, w, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(w, w, 3, padding=1),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            cin = w
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


def small_vgg(batch: int = 16, image: int = 64) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return SmallVGG().train(), (torch.randn(batch, 3, image, image),), {}


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple, dict]]] = {
    "gpt-4x512": lambda: build("megatron_gpt", "tiny", batch=2, seq=512, layers=4, hidden=512, heads=8, vocab=2048),
    # the loss head's cell (issue: a medium decoder with a vocabulary of 8k or more): its logits are 32 MiB
    "gpt-4x256-v8k": lambda: build("megatron_gpt", "tiny", batch=2, seq=512, layers=4, hidden=256, heads=4,
                                   vocab=8192),
    # a HuggingFace decoder: it returns its logits beside the loss, whose zero gradient torch.compile materializes
    # and runs the head's backward on (karma detaches them after the first step: ``karma_fx.unused_grads``)
    "hf-gpt2-v8k": lambda: build("gpt2", "tiny", batch=2, seq=512, layers=4, hidden=256, heads=4, vocab=8192,
                                 dropout=0.0),
    "resnet18-64px": resnet18,
    "mlp-2pass": two_pass_mlp,  # a probe: pointwise ops Inductor fuses (``TwoPassMLP``)
    "vgg-64px": small_vgg,  # ReLUs read through their masks only (``SmallVGG``)
    "mlp-tiny": lambda: build("mlp", "tiny"),  # a quick check of the bench itself, not a comparison
}


@dataclass(frozen=True)
class Point:
    """One measured configuration: its family (``karma cpsat``, ``aot_eager``, ...), knob, peak and time."""

    family: str
    knob: str
    peak_bytes: int
    step_ms: float
    """Median of the timed steps."""
    fastest_ms: float = 0.0
    sync_peak_bytes: int = 0
    """Where the copies were timed on a worker thread: the peak with synchronous copies (0: not measured).
    The two agree where compute waits for each swap-out where the plan has it landed (every plan does)."""


@dataclass(frozen=True)
class Pairing:
    ours: Point
    theirs: Point | None
    """The baseline point with the closest measured peak at or above ours (None: it never gets that high)."""
    below: Point | None
    """When ``theirs`` is None: the baseline point with the highest peak (all are below ours)."""
    dominated_by: Point | None
    """The fastest baseline point at a peak no higher than ours that is faster than ours, if any."""
    time: str = "step_ms"
    """The time compared: ``step_ms`` (median) or ``fastest_ms``."""

    def verdict(self) -> str:
        ms = getattr(self.ours, self.time)
        if self.dominated_by is not None:
            q = self.dominated_by
            return f"slower: {q.family} {q.knob} is faster at {q.peak_bytes / MIB:.1f} MiB"
        if self.theirs is None:
            q = self.below
            if q is None:
                return "no baseline point"
            return (f"no baseline point this high; its highest, {q.knob} at {q.peak_bytes / MIB:.1f} MiB, "
                    f"is {'faster' if getattr(q, self.time) < ms else 'slower'}")
        gain = getattr(self.theirs, self.time) / ms - 1
        return f"{'faster' if gain > 0 else 'slower'} by {abs(gain):.1%}"


def pair(ours: list[Point], theirs: list[Point], tolerance: float = 0.01, time: str = "step_ms") -> list[Pairing]:
    """Each of ``ours`` against ``theirs``: the point whose peak is the closest at or above it (peaks within
    ``tolerance`` of each other count as equal), and the fastest point at a peak no higher (same tolerance)
    that beats it on ``time`` (a ``Point`` field: ``step_ms`` or ``fastest_ms``)."""
    out = []
    for p in ours:
        above = [q for q in theirs if q.peak_bytes >= p.peak_bytes * (1 - tolerance)]
        match = min(above, key=lambda q: (q.peak_bytes, getattr(q, time))) if above else None
        beaters = [q for q in theirs
                   if q.peak_bytes <= p.peak_bytes * (1 + tolerance) and getattr(q, time) < getattr(p, time)]
        below = max(theirs, key=lambda q: q.peak_bytes) if theirs and match is None else None
        dominated = min(beaters, key=lambda q: getattr(q, time)) if beaters else None
        out.append(Pairing(p, match, below, dominated, time))
    return out


class OffloadAll(torch.autograd.graph.saved_tensors_hooks):
    """Every saved tensor of at least ``min_bytes`` that is not (a view of) a parameter or buffer goes to the
    host on pack (``karma.offload``) and comes back on unpack (``karma.prefetch`` then ``karma.wait``)."""

    def __init__(self, model: nn.Module, min_bytes: int = 1024) -> None:
        resident = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self.packed = 0

        def pack(t: torch.Tensor) -> Any:
            nbytes = t.numel() * t.element_size()
            if nbytes < min_bytes or t.untyped_storage().data_ptr() in resident:
                return t
            self.packed += 1
            with torch.no_grad():
                return torch.ops.karma.offload(t.detach()), t.device

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            host, device = packed
            return torch.ops.karma.wait(torch.ops.karma.prefetch(host, device))

        super().__init__(pack, unpack)


def measure(model: nn.Module, step: Callable, args: tuple, kwargs: dict, steps: int,
            around: Callable[[], Any] = contextlib.nullcontext,
            sync_around: Callable[[], Any] | None = None) -> tuple[int, float, float, int]:
    """Measured peak (bytes), median and fastest steady-state step time (ms) of ``step`` run in ``around()``;
    then, given ``sync_around``, the peak of a step run in it (after one step to settle), else 0."""
    def one() -> None:
        with around():
            output_to_loss(step(*args, **kwargs)).backward()
        for p in model.parameters():
            p.grad = None

    one()  # compile
    one()  # steady state: host pool filled, caches warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        one()
        times.append((time.perf_counter() - start) * 1e3)
    with around():
        peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
    sync_peak = 0
    if sync_around is not None:
        for p in model.parameters():  # measure_step_peak leaves the gradients of its step
            p.grad = None
        around = sync_around
        one()
        with around():
            sync_peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
    return peak, statistics.median(times), min(times), sync_peak


@contextlib.contextmanager
def _fresh(name: str) -> Iterator[tuple[nn.Module, tuple, dict]]:
    torch._dynamo.reset()
    gc.collect()
    try:
        yield MODELS[name]()
    finally:
        torch._dynamo.reset()
        gc.collect()


def karma_range(name: str, compiler: str = "eager") -> tuple[int, int]:
    """The compiled step's lowest reachable peak and its unplanned peak (bytes), from a probe step."""
    with _fresh(name) as (model, args, kwargs):
        # measured costs, as the planned steps use: they add each kernel's scratch, which raises the floor (the
        # GPT's from 154.2 to 158.2 MiB), and a floor from the roofline's problem is out of the planned steps' reach
        probe = karma_fx.compile(model, budget=1.0, strategy="keep", compiler=compiler, costs="measured")
        output_to_loss(probe(*args, **kwargs)).backward()
        return probe.min_budget_bytes, probe.unplanned_peak_bytes


def sweep(name: str, a: argparse.Namespace) -> dict[str, list[Point]]:
    """Every configuration of model ``name`` measured, grouped by family; infeasible karma budgets printed."""
    from torch._functorch import config as functorch_config

    from karma_fx.runtime import copy_mode

    families: dict[str, list[Point]] = {}

    def add(family: str, knob: str, peak: int, ms: float, fastest_ms: float, sync_peak: int = 0) -> None:
        families.setdefault(family, []).append(Point(family, knob, peak, ms, fastest_ms, sync_peak))
        print(f"  {name} {family} {knob}: {peak / MIB:.1f} MiB, {ms:.1f} ms (fastest {fastest_ms:.1f})",
              flush=True)

    with _fresh(name) as (model, args, kwargs):
        add("eager", "unplanned", *measure(model, model, args, kwargs, a.steps))
    sync = (lambda: copy_mode("sync")) if a.copies == "threads" else None
    for compiler, strategy in itertools.product(a.karma_compilers.split(","), a.strategies.split(",")):
        floor, unplanned = karma_range(name, compiler)
        family = f"karma {strategy}" + (" +inductor" if compiler == "inductor" else "")
        for position in a.budgets.split(","):
            budget = int(floor + float(position) * (unplanned - floor))
            knob = f"{position}: {budget / MIB:.1f} MiB"
            with _fresh(name) as (model, args, kwargs):
                step = karma_fx.compile(model, budget=budget, strategy=strategy, costs="measured",
                                        time_limit_s=a.time_limit, compiler=compiler)
                try:
                    add(family, knob, *measure(model, step, args, kwargs, a.steps, lambda: copy_mode(a.copies), sync))
                except InfeasibleBudgetError as e:
                    print(f"  {name} {family} {knob}: infeasible ({e})", flush=True)
    for backend in a.backends.split(","):
        for ratio in a.ratios.split(","):
            with _fresh(name) as (model, args, kwargs):
                step = torch.compile(model, backend=backend, dynamic=False)
                with functorch_config.patch(activation_memory_budget=float(ratio)):
                    add(backend, f"r={ratio}", *measure(model, step, args, kwargs, a.steps))
    with _fresh(name) as (model, args, kwargs):
        def offload_all(mode: str) -> Callable[[], contextlib.ExitStack]:
            def enter() -> contextlib.ExitStack:
                stack = contextlib.ExitStack()
                stack.enter_context(copy_mode(mode))
                stack.enter_context(OffloadAll(model, a.min_offload_bytes))
                return stack
            return enter

        add("offload-all", f">={a.min_offload_bytes} B", *measure(
            model, model, args, kwargs, a.steps, offload_all(a.copies), offload_all("sync") if sync else None))
    return families


def tables(name: str, families: dict[str, list[Point]], tolerance: float) -> str:
    """All points of a model by family, then each karma point against each baseline family."""
    points = [p for family in families.values() for p in family]
    out = [f"## {name}", "", tabulate([[p.family, p.knob, f"{p.peak_bytes / MIB:.1f}", f"{p.step_ms:.1f}",
                                        f"{p.fastest_ms:.1f}",
                                        f"{p.sync_peak_bytes / MIB:.1f}" if p.sync_peak_bytes else ""]
                                       for p in points],
                                      headers=["config", "knob", "measured peak MiB", "step ms (median)",
                                               "fastest ms", "peak MiB, sync copies"], tablefmt="github")]
    eager = families.get("eager", [None])[0]
    baselines = [f for f in families if f not in ("eager",) and not f.startswith("karma")]
    rows = []
    for family in (f for f in families if f.startswith("karma")):
        for base in baselines:
            median = pair(families[family], families[base], tolerance)
            fastest = pair(families[family], families[base], tolerance, time="fastest_ms")
            for p, f in zip(median, fastest):
                t = p.theirs
                rows.append([f"{family} {p.ours.knob}", f"{p.ours.peak_bytes / MIB:.1f}", f"{p.ours.step_ms:.1f}",
                             base, t.knob if t else "-", f"{t.peak_bytes / MIB:.1f}" if t else "-",
                             f"{t.step_ms:.1f}" if t else "-", p.verdict(), f.verdict()])
    out += ["", tabulate(rows, headers=["karma", "peak MiB", "ms", "vs", "knob", "peak MiB", "ms",
                                        "karma at equal peak (median)", "(fastest step)"], tablefmt="github")]
    if eager is not None:
        out.append(f"\nunplanned eager step: {eager.peak_bytes / MIB:.1f} MiB, {eager.step_ms:.1f} ms")
    return "\n".join(out)


def _settled(model: nn.Module, step: Callable, args: tuple, kwargs: dict, steps: int) -> Callable[[], None]:
    """One training step of ``step`` as a callable, after ``steps`` of them (compiles, karma's measuring)."""
    def one() -> None:
        for p in model.parameters():  # a peak measured in between leaves its gradients: a step must not add to them
            p.grad = None
        output_to_loss(step(*args, **kwargs)).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(steps):
        one()
    return one


def interleaved(steps: list[Callable[[], None]], rounds: int) -> list[float]:
    """Median ms of each of ``steps``, timed one after the other in turn for ``rounds`` rounds."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for one, spent in zip(steps, times):
            gc.collect()
            start = time.perf_counter()
            one()
            spent.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _karma_at(name: str, budget: Any, a: argparse.Namespace) -> tuple[nn.Module, Callable, tuple, dict]:
    model, args, kwargs = MODELS[name]()
    step = karma_fx.compile(model, budget=budget, compiler="inductor", costs="measured",
                            time_limit_s=a.time_limit)
    return model, step, args, kwargs


def _moves(plan: Any) -> str:
    """A plan's moves for the table, with the loss head's chunk where the plan chunks it: which trace ran is
    what most often differs between two runs of one cell (the traces are timed apart, so timing noise picks)."""
    return f"{len(plan.decisions)}" + (f", head in {plan.loss_chunk}-token chunks" if plan.loss_chunk else "")


def at_their_points(name: str, a: argparse.Namespace) -> str:
    """``--mode points``: PyTorch's Inductor step at each ratio, karma at its measured peak, timed interleaved."""
    from torch._functorch import config as functorch_config

    from karma_fx.runtime import copy_mode

    rows, theirs_lowest = [], None
    points = [(f"r={r}", float(r)) for r in a.ratios.split(",")] + [("budget=1.0", None)]
    for knob, ratio in points:
        with _fresh(name) as (model, args, kwargs):
            theirs = torch.compile(model, backend="inductor", dynamic=False)
            with functorch_config.patch(activation_memory_budget=1.0 if ratio is None else ratio):
                their_step = _settled(model, theirs, args, kwargs, 2)
            their_peak = measure_step_peak(model, theirs, args, kwargs, output_to_loss).peak_bytes
            if ratio is not None and (theirs_lowest is None or their_peak < theirs_lowest[1]):
                theirs_lowest = (knob, their_peak)
            mine_model, mine, margs, mkwargs = _karma_at(name, 1.0 if ratio is None else their_peak, a)
            try:
                with copy_mode(a.copies):  # planned for the copies it is timed with (they price each copy)
                    my_step = _settled(mine_model, mine, margs, mkwargs, a.settle)
            except InfeasibleBudgetError as e:
                rows.append([knob, f"{their_peak / MIB:.2f}", "-", f"refused: smallest {e.min_budget_bytes / MIB:.2f}"
                             if e.min_budget_bytes else "refused", "-", "-", "-"])
                print(f"  {name} {knob}: {rows[-1]}", flush=True)
                continue
            my_peak = measure_step_peak(mine_model, mine, margs, mkwargs, output_to_loss).peak_bytes
            with copy_mode(a.copies):
                my_step()  # the copy engine as timed, settled
                their_ms, my_ms = interleaved([their_step, my_step], a.rounds)
            moves = _moves(mine.plan)
            rows.append([knob, f"{their_peak / MIB:.2f}", f"{their_ms:.1f}", f"{my_peak / MIB:.2f}", f"{my_ms:.1f}",
                         f"{my_ms / their_ms:.3f}", f"{my_peak / their_peak - 1:+.1%}", moves])
            print(f"  {name} {knob}: {rows[-1]}", flush=True)
    floor = ["karma's lowest", "-", "-", "-", "-", "-", "-", "-"]
    try:
        with _fresh(name), copy_mode(a.copies):
            model, step, args, kwargs = _karma_at(name, 1024, a)
            _settled(model, step, args, kwargs, 1)
    except InfeasibleBudgetError as e:
        named = e.min_budget_bytes
        with _fresh(name):
            model, step, args, kwargs = _karma_at(name, named, a)
            try:
                with copy_mode(a.copies):
                    _settled(model, step, args, kwargs, a.settle)
                peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
                floor = ["karma's lowest", "-", "-", f"{peak / MIB:.2f}", "-", "-",
                         f"budget {named / MIB:.2f}", _moves(step.plan)]
            except InfeasibleBudgetError as again:
                floor[3] = f"refused again at {named / MIB:.2f}: {again.min_budget_bytes / MIB:.2f}"
    out = [f"## {name} (Inductor both sides; karma's budget: PyTorch's measured peak at each point)", "",
           tabulate(rows + [floor], headers=["PyTorch", "peak MiB", "ms", "karma peak MiB", "karma ms",
                                             "karma / PyTorch time", "karma peak vs theirs", "karma moves"],
                    tablefmt="github")]
    if theirs_lowest is not None:
        out.append(f"\nPyTorch's lowest: {theirs_lowest[1] / MIB:.2f} MiB ({theirs_lowest[0]})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="points", choices=("points", "sweep"),
                   help="points: karma at PyTorch's Inductor points (default); sweep: every family at its own knobs")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default="cpsat", help="karma strategies, e.g. cpsat,karma")
    p.add_argument("--karma-compilers", default="eager",
                   help="compiler= of the karma steps: eager, inductor or both (eager,inductor); compare "
                        "'karma ... +inductor' with --backends inductor")
    p.add_argument("--budgets", default="0.75,0.5,0.25,0.0",
                   help="karma budgets, as positions between the compiled step's lowest reachable peak (0) and "
                        "its unplanned peak (1)")
    p.add_argument("--ratios", default="1.0,0.6,0.3,0.0", help="activation_memory_budget values")
    p.add_argument("--rounds", type=int, default=7, help="--mode points: interleaved timing rounds")
    p.add_argument("--settle", type=int, default=6,
                   help="--mode points: karma steps before measuring (compile, its own measuring, a re-plan)")
    p.add_argument("--backends", default="aot_eager",
                   help="torch.compile backends for the ratio sweep: aot_eager, aot_eager_decomp_partition, inductor")
    p.add_argument("--copies", default="threads", choices=("threads", "sync"), help="CPU copy engine")
    p.add_argument("--min-offload-bytes", type=int, default=1024, help="offload-all's size threshold")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the rest copy and idle)")
    p.add_argument("--time-limit", type=float, default=20.0, help="cpsat seconds per region")
    p.add_argument("--tolerance", type=float, default=0.01, help="peaks this close count as equal")
    p.add_argument("--host-memory", default="keep", choices=("keep", "default"),
                   help="keep freed host memory for reuse, as a GPU's caching allocator does, for every "
                        "configuration alike (karma_fx.runtime.keep_freed_host_memory), or glibc's default")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    if a.host_memory == "keep":
        from karma_fx.runtime import keep_freed_host_memory

        keep_freed_host_memory()
    for name in a.models.split(","):
        print(at_their_points(name, a) if a.mode == "points" else tables(name, sweep(name, a), a.tolerance),
              flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
