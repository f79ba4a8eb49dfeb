"""The GPU check: is the compiled step right on CUDA, and does it take the time and memory the plan says?

    python bench/gpu_check.py --out DIR       # on CUDA: every section, bounded by --deadline (one H200: ~6 min)
    python bench/gpu_check.py --dry           # CPU, tiny sizes, H100 preset: exercises every path (CI runs it)

Sections (``--sections``, in this order, each row skipped once ``--deadline`` seconds have passed):

``numerics``  A small GPT (dropout 0, so both sides draw no random numbers) trained 3 SGD steps under
              ``karma_fx.compile`` with strategies that swap and recompute (budget halfway between the lowest
              feasible peak and the unplanned one), against the same steps in eager PyTorch: relative error
              of each step's loss and of the final gradients, in fp32 and bf16-mixed; and with
              ``compiler="inductor"`` against ``torch.compile(backend="inductor")``. On CUDA this runs the
              copy streams, events and pinned host pool for real. The measured peak
              (``torch.cuda.max_memory_allocated``) is printed beside the plan's.
``regime``    The regime GPUs train in: a GPT at GPT-2-medium width in bf16 autocast with fused attention.
              ``karma_fx.device.calibrate()`` measures the GPU first; at each budget, each strategy is planned
              on the calibrated roofline (and greedy also with ``costs="measured"``) and timed; beside them,
              PyTorch's own answers: ``torch.compile`` with ``activation_memory_budget`` (aot_eager and
              inductor) and eager ``save_on_cpu``. Each row: measured median step time and peak, predicted
              step time and peak.
``inductor``  A 4-layer GPT at the same width: ``torch.compile(backend="inductor")`` against
              ``karma_fx.compile(compiler="inductor")`` with nothing to move (karma's overhead) and under a
              budget, beside Inductor with ``activation_memory_budget``.

``--out DIR`` also writes every row as a JSON line to ``DIR/gpu_check.jsonl`` as it is measured, so a run cut
short keeps what it measured. In ``--dry`` mode memory is measured with allocator events
(``karma_fx.measure_run.AllocatorPeak``) and times are CPU times, not comparable with the predictions: it
checks that the script works, nothing more.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import re
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch._dynamo
from tabulate import tabulate

import karma_fx
from karma_fx.budget import format_bytes
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.zoo import build, output_to_loss

SECTIONS = "numerics,regime,inductor"
STRATEGIES = "keep,keep+measured,checkpoint,karma,greedy,greedy+measured,cpsat;greedy,greedy+measured,karma"
NUMERIC_STRATEGIES = ("offload", "greedy", "cpsat")
# Real: GPT-2-medium width and sequence (hidden 1024, 16 heads, batch 8 x 1024 tokens), 12 layers so a row
# plans in seconds. Dry: the same code at a size a CPU runs in a second.
REAL = {
    "numerics": dict(batch=4, seq=256, layers=2, hidden=256, heads=4, vocab=4096, dropout=0.0),
    "regime": dict(batch=8, seq=1024, layers=12, hidden=1024, heads=16, vocab=50304, dropout=0.0),
    "inductor": dict(batch=8, seq=1024, layers=4, hidden=1024, heads=16, vocab=50304, dropout=0.0),
}
DRY = {
    "numerics": dict(batch=2, seq=32, layers=2, hidden=64, heads=4, vocab=256, dropout=0.0),
    "regime": dict(batch=2, seq=32, layers=2, hidden=64, heads=4, vocab=256, dropout=0.0),
    "inductor": dict(batch=2, seq=32, layers=1, hidden=64, heads=4, vocab=256, dropout=0.0),
}
HEADERS = ["section", "model", "budget", "what", "measured ms", "measured peak", "predicted ms", "predicted peak",
           "note"]


class Check:
    """Shared state of one run: device, deadline, rows, the JSON log."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.cuda = not a.dry
        self.device = "cuda" if self.cuda else "cpu"
        self.sizes = REAL if self.cuda else DRY
        self.steps = a.steps or (5 if self.cuda else 1)
        self.deadline = a.deadline
        self.start = time.perf_counter()
        self.rows: list[list[Any]] = []
        self.log = Path(a.out) / "gpu_check.jsonl" if a.out else None
        if self.log:
            self.log.parent.mkdir(parents=True, exist_ok=True)
        self.spec: Any = None if self.cuda else karma_fx.get_device("h100")
        self.time_limit_s = a.time_limit
        self.trace = a.trace
        """Rows whose label matches this regex also save their profiled step as a Chrome trace in ``--out``."""
        self.row_label = ""
        self.profile_kernels = False
        """Profile one more step of each row and note its GPU kernels (count and summed GPU time)."""
        self.kernels = ""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def late(self) -> bool:
        return self.elapsed() > self.deadline

    def add(self, section: str, model: str, budget: Any, what: str, measured_us: float | None = None,
            peak: int | None = None, predicted_us: float | None = None, predicted_peak: int | None = None,
            note: str = "", **extra: Any) -> None:
        row = [section, model, budget, what, _ms(measured_us), _bytes(peak), _ms(predicted_us),
               _bytes(predicted_peak), note]
        self.rows.append(row)
        print(" | ".join(str(c) for c in row), flush=True)
        if self.log:
            record = dict(zip(HEADERS, row), measured_us=measured_us, peak_bytes=peak, predicted_us=predicted_us,
                          predicted_peak_bytes=predicted_peak, elapsed_s=round(self.elapsed(), 1), **extra)
            with self.log.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    def guarded(self, section: str, model: str, budget: Any, what: str, body: Callable[[], None]) -> None:
        """Run one row; a row that fails is reported (with its traceback) and the next one runs."""
        if self.late():
            self.add(section, model, budget, what, note="skipped (deadline)")
            return
        self.row_label = f"{section} {what} {budget}"
        try:
            body()
        except InfeasibleBudgetError as e:
            self.add(section, model, budget, what, note=f"infeasible (min {format_bytes(e.min_budget_bytes)})")
        except Exception as e:  # a broken row must not cost the rest of the run: report it, go on
            traceback.print_exc()
            self.add(section, model, budget, what, note=f"ERROR {type(e).__name__}: {str(e)[:160]}")
        finally:
            _free(self.cuda)

    # ---- running and measuring steps --------------------------------------------------------------------------
    def measure(self, model: torch.nn.Module, step: Callable, args: tuple, kwargs: dict,
                around: Callable[[], Any] = contextlib.nullcontext) -> tuple[float, int]:
        """Median step time (µs) over ``self.steps`` steady steps and the device peak of one more step."""
        def one() -> None:
            with around():
                output_to_loss(step(*args, **kwargs)).backward()
            for p in model.parameters():
                p.grad = None

        one()  # compile and warm up
        one()
        times = []
        for _ in range(self.steps):
            self.sync()
            start = time.perf_counter()
            one()
            self.sync()
            times.append(time.perf_counter() - start)
        self.kernels = ""
        if self.cuda and self.profile_kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                one()
                torch.cuda.synchronize()
            self.kernels = _gpu_breakdown(prof.profiler.kineto_results.events())
            if self.trace and self.log and re.search(self.trace, self.row_label):
                path = self.log.parent / f"trace-{re.sub(r'[^A-Za-z0-9]+', '_', self.row_label)[:40]}.json"
                prof.export_chrome_trace(str(path))  # the step's timeline: compute, copy streams, host
                self.kernels += f"; trace {path.name}"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the reserved peak below then counts what this step's blocks needed
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            reserved_before = torch.cuda.memory_reserved()
            one()
            torch.cuda.synchronize()
            # Weights and inputs live before the step; the planner's peak counts them too.
            peak = torch.cuda.max_memory_allocated() - before + _resident_bytes(model, args, kwargs)
            # Allocated bytes count a swapped-out tensor until compute has waited for its copy (the runtime holds
            # it until then, where the plan frees it); reserved bytes add allocator rounding and fragmentation.
            reserved = torch.cuda.max_memory_reserved() - reserved_before + _resident_bytes(model, args, kwargs)
            self.kernels = (self.kernels + "; " if self.kernels else "") + f"reserved peak {format_bytes(reserved)}"
        else:
            from karma_fx.measure_run import AllocatorPeak

            with AllocatorPeak(model.parameters(), model.buffers(), _tensors(args, kwargs)) as live:
                with around():
                    output_to_loss(step(*args, **kwargs)).backward()
            for p in model.parameters():
                p.grad = None
            peak = live.peak_bytes
        return statistics.median(times) * 1e6, peak

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def fresh(self, section: str, precision: str = "bf16-mixed") -> tuple[torch.nn.Module, tuple, dict]:
        torch._dynamo.reset()
        _free(self.cuda)
        return build("megatron_gpt", "tiny", device=self.device, precision=precision, **self.sizes[section])


# ---- sections ---------------------------------------------------------------------------------------------------
def numerics(c: Check, compilers: tuple[str, ...]) -> None:
    """Loss and gradients of 3 SGD steps of karma-compiled steps against eager (or Inductor) PyTorch."""
    for precision in ("fp32", "bf16-mixed") if "eager" in compilers else ():
        probe_budget: dict[str, int] = {}

        def probe() -> None:
            model, args, kwargs = c.fresh("numerics", precision)
            compiled = karma_fx.compile(model, budget=1.0, strategy="keep", device=c.spec or "h100")
            output_to_loss(compiled(*args, **kwargs)).backward()
            high, low = compiled.unplanned_peak_bytes, compiled.min_budget_bytes
            probe_budget["bytes"] = low + (high - low) // 2
            c.add("numerics", f"gpt {precision}", "", "probe", note=f"unplanned {format_bytes(high)}, "
                  f"lowest feasible {format_bytes(low)}")

        c.guarded("numerics", f"gpt {precision}", "", "probe", probe)
        if "bytes" not in probe_budget:
            continue
        budget = probe_budget["bytes"]
        for strategy in NUMERIC_STRATEGIES:
            c.guarded("numerics", f"gpt {precision}", format_bytes(budget), strategy,
                      lambda s=strategy: _compare(c, precision, budget, s, "eager"))
    if "inductor" in compilers:  # compared with Inductor's own compile, in fp32
        c.guarded("numerics", "gpt fp32", "halfway", "greedy + inductor",
                  lambda: _compare(c, "fp32", None, "greedy", "inductor"))


def _compare(c: Check, precision: str, budget: int | None, strategy: str, compiler: str) -> None:
    model, args, kwargs = c.fresh("numerics", precision)
    reference = copy.deepcopy(model)
    if budget is None:  # halfway between the lowest feasible peak and the unplanned one, for this compiler
        probe = karma_fx.compile(copy.deepcopy(model), budget=1.0, strategy="keep", device=c.spec or "h100",
                                 compiler=compiler)
        output_to_loss(probe(*args, **kwargs)).backward()
        budget = probe.min_budget_bytes + (probe.unplanned_peak_bytes - probe.min_budget_bytes) // 2
        del probe
    compiled = karma_fx.compile(model, budget=budget, strategy=strategy, device=c.spec or "h100",
                                compiler=compiler, time_limit_s=c.time_limit_s)
    ref_step = reference if compiler == "eager" else torch.compile(reference, backend="inductor", dynamic=False)
    losses, peaks = [], []
    for _ in range(4):  # the first call compiles (Inductor's autotuning allocates): its peak is not a step's
        if c.cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        loss = output_to_loss(compiled(*args, **kwargs))
        loss.backward()
        if c.cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before + _resident_bytes(model, args, kwargs))
        ref_loss = output_to_loss(ref_step(*args, **kwargs))
        ref_loss.backward()
        losses.append(_rel(loss.detach(), ref_loss.detach()))
        grads = [_rel(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())
                 if q.grad is not None]
        with torch.no_grad():
            for m in (model, reference):
                for p in m.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-0.05)
                        p.grad = None
    plan = compiled.plan
    moved = f"{len(plan.offloads)} offloads, {len(plan.recomputes)} recomputes"
    if peaks:
        moved += f"; compiling call's peak {format_bytes(peaks[0])}"
    c.add("numerics", f"gpt {precision}", format_bytes(budget), f"{strategy} ({compiler})",
          peak=max(peaks[1:]) if peaks else None, predicted_us=plan.step_time_us, predicted_peak=plan.peak_bytes,
          note=f"{moved}; loss rel err max {max(losses):.1e}; grad rel err max {max(grads):.1e}",
          loss_rel_errors=losses, grad_rel_error_max=max(grads))


def regime(c: Check, budgets: list[float], strategies: list[list[str]], baselines: list[tuple[str, ...]]) -> None:
    """Predicted against measured step time and peak, bf16 autocast, GPT-2-medium width. ``strategies[i]`` and
    ``baselines[i]`` are the rows at ``budgets[i]`` (the last list for every later budget); a strategy
    ``name+measured`` plans with ``costs="measured"``; ``keep`` runs at budget 1.0."""
    name = "gpt-{layers}x{hidden} bf16-mixed".format(**c.sizes["regime"])
    c.profile_kernels = True
    if c.cuda and c.spec is None:
        from karma_fx.device import calibrate

        def cal() -> None:
            c.spec = calibrate()
            c.add("regime", "", "", "calibrate", note=f"H2D {c.spec.h2d_bytes_per_s / 1e9:.1f} GB/s, D2H "
                  f"{c.spec.d2h_bytes_per_s / 1e9:.1f} GB/s, bf16 "
                  f"{dict(c.spec.peak_flops).get('bfloat16', 0) / 1e12:.0f} TFLOP/s, HBM "
                  f"{c.spec.hbm_bytes_per_s / 1e12:.2f} TB/s, overhead {c.spec.kernel_overhead_us:.1f} us",
                  spec=str(c.spec))

        c.guarded("regime", "", "", "calibrate", cal)
        if c.spec is None:
            c.spec = karma_fx.get_device("h200")
    for i, budget in enumerate(budgets):
        for entry in strategies[min(i, len(strategies) - 1)]:
            strategy, _, costs = entry.partition("+")
            label = strategy + (f", {costs} costs" if costs else "")
            options = dict(strategy=strategy, costs=costs or "roofline")
            b = 1.0 if strategy == "keep" else budget
            c.guarded("regime", name, b, label,
                      lambda o=options, b=b, lab=label: _karma_row(c, "regime", name, b, lab, o))
        _torch_rows(c, "regime", name, budget, baselines[min(i, len(baselines) - 1)])


def inductor(c: Check, budgets: list[float]) -> None:
    """karma + Inductor beside Inductor: nothing to move, then under a budget. Each row also counts the GPU
    kernels of one step and their summed time, which tells GPU work from host overhead."""
    name = "gpt-{layers}x{hidden} bf16-mixed".format(**c.sizes["inductor"])
    c.profile_kernels = True

    def plain() -> None:
        model, args, kwargs = c.fresh("inductor")
        step_us, peak = c.measure(model, torch.compile(model, backend="inductor", dynamic=False), args, kwargs)
        c.add("inductor", name, "", "torch.compile inductor", step_us, peak, note=c.kernels)

    c.guarded("inductor", name, "", "torch.compile inductor", plain)
    c.guarded("inductor", name, "1 TiB", "karma inductor, nothing moves",
              lambda: _karma_row(c, "inductor", name, 1 << 40, "karma inductor, nothing moves",
                                 dict(strategy="keep", compiler="inductor")))
    for budget in budgets:
        c.guarded("inductor", name, budget, "karma inductor greedy",
                  lambda b=budget: _karma_row(c, "inductor", name, b, "karma inductor greedy",
                                              dict(strategy="greedy", compiler="inductor")))
        _torch_rows(c, "inductor", name, budget, ("inductor",))


def _karma_row(c: Check, section: str, name: str, budget: float | int, label: str, options: dict) -> None:
    model, args, kwargs = c.fresh(section)
    t0 = time.perf_counter()
    compiled = karma_fx.compile(model, budget=budget, device=c.spec, time_limit_s=c.time_limit_s, **options)
    step_us, peak = c.measure(model, compiled, args, kwargs)
    plan = compiled.plan
    c.add(section, name, budget, label, step_us, peak, plan.step_time_us, plan.peak_bytes,
          note=f"{plan.status}, budget {format_bytes(plan.budget_bytes)}, unplanned "
               f"{format_bytes(plan.unplanned_peak_bytes or 0)}, {len(plan.offloads)} off / "
               f"{len(plan.recomputes)} rec, compile+run {time.perf_counter() - t0:.0f} s"
               + (f"; {c.kernels}" if c.kernels else ""),
          unlimited_us=plan.unlimited_step_time_us, budget_bytes=plan.budget_bytes)


def _torch_rows(c: Check, section: str, name: str, budget: float, which: tuple[str, ...]) -> None:
    for kind in which:
        label = ("torch save_on_cpu" if kind == "save_on_cpu"
                 else f"torch activation_memory_budget ({kind})")

        def row(kind: str = kind, label: str = label) -> None:
            model, args, kwargs = c.fresh(section)
            if kind == "save_on_cpu":
                step_us, peak = c.measure(model, model, args, kwargs,
                                          around=lambda: torch.autograd.graph.save_on_cpu(pin_memory=c.cuda))
            else:
                from torch._functorch import config as functorch_config

                step = torch.compile(model, backend=kind, dynamic=False)
                with functorch_config.patch(activation_memory_budget=budget):
                    step_us, peak = c.measure(model, step, args, kwargs)
            c.add(section, name, budget, label, step_us, peak, note=c.kernels)

        c.guarded(section, name, budget, label, row)


# ---- small helpers ----------------------------------------------------------------------------------------------
def _gpu_breakdown(events: list) -> str:
    """One profiled step in a line: GPU kernels and copies (count, summed ms, copies to or from pageable host
    memory, which cannot overlap compute), and host waits on the GPU (synchronise calls, summed ms)."""
    gpu = [e for e in events if str(e.device_type()).endswith("CUDA") and e.name() != "[memory]"]
    copies = [e for e in gpu if e.name().startswith("Memcpy")]
    kernels = [e for e in gpu if not e.name().startswith("Memcpy") and not e.name().startswith("Memset")]
    syncs = [e for e in events if str(e.device_type()).endswith("CPU") and "Synchronize" in e.name()]
    pageable = sum("Pageable" in e.name() for e in copies)
    return (f"{len(kernels)} kernels {sum(e.duration_ns() for e in kernels) / 1e6:.2f} ms, {len(copies)} copies "
            f"{sum(e.duration_ns() for e in copies) / 1e6:.2f} ms ({pageable} pageable), {len(syncs)} host syncs "
            f"{sum(e.duration_ns() for e in syncs) / 1e6:.2f} ms")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]


def _resident_bytes(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    tensors = list(model.parameters()) + list(model.buffers()) + _tensors(args, kwargs)
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _ms(us: float | None) -> str:
    return "" if us is None else f"{us / 1e3:.2f}"


def _bytes(n: int | None) -> str:
    return "" if n is None else format_bytes(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU, tiny models, preset device")
    p.add_argument("--sections", default=SECTIONS)
    p.add_argument("--budgets", default=None,
                   help="fractions of the unplanned peak (default 0.75,0.65: the regime GPT's leanest plan needs "
                        "0.59; dry 0.9)")
    p.add_argument("--strategies", default=STRATEGIES,
                   help="karma strategies of the regime section (name+measured: costs='measured'); "
                        "';' separates the lists of successive budgets")
    p.add_argument("--baselines", default="aot_eager,inductor,save_on_cpu;inductor",
                   help="PyTorch's answers in the regime section: activation_memory_budget under these backends, "
                        "and save_on_cpu; ';' separates the lists of successive budgets")
    p.add_argument("--numerics-compilers", default="eager,inductor")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5; dry 1)")
    p.add_argument("--time-limit", type=float, default=20.0, help="planning limit per compile, seconds")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds; later rows are skipped")
    p.add_argument("--out", default=None, help="directory for gpu_check.jsonl (one JSON line per row)")
    p.add_argument("--trace", default=None,
                   help="regex over 'section label budget': matching rows also save one profiled step as a "
                        "Chrome trace in --out (CUDA; a few MB each)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if not a.dry and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --dry on a CPU")
    c = Check(a)
    budgets = [float(b) for b in (a.budgets or ("0.75,0.65" if c.cuda else "0.9")).split(",")]
    where = f"CUDA {torch.cuda.get_device_name()}" if c.cuda else "CPU (dry)"
    print(f"karma_fx gpu_check on {where}, torch {torch.__version__}", flush=True)
    sections = a.sections.split(",")
    unknown = set(sections) - set(SECTIONS.split(","))
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    if "numerics" in sections:
        numerics(c, tuple(a.numerics_compilers.split(",")))
    if "regime" in sections:
        regime(c, budgets, [part.split(",") for part in a.strategies.split(";")],
               [tuple(x for x in part.split(",") if x) for part in a.baselines.split(";")])
    if "inductor" in sections:
        inductor(c, budgets)
    print(tabulate(c.rows, headers=HEADERS, tablefmt="github"))
    print(f"total {c.elapsed():.0f} s on {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
