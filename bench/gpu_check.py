"""The GPU check: measured vs predicted step time and peak of the compiled training step, next to PyTorch's own.

    python bench/gpu_check.py                 # on CUDA (one H200: under 8 minutes)
    python bench/gpu_check.py --dry           # CPU, tiny sizes, preset device: exercises every path (CI runs it)

On CUDA it first calibrates a ``DeviceSpec`` (``karma_fx.device.calibrate``: host<->device bandwidth each way,
copy latency, HBM bandwidth, per-op overhead, matmul rate), then for a GPT-2-medium-size model (24 layers,
hidden 1024, batch 8 x 1024 tokens) and ResNet-50 (batch 128, 224x224), at budgets 0.5 and 0.3 of the
compiled step's unplanned peak, runs ``karma_fx.compile`` with each strategy plus two PyTorch baselines:
``torch.compile`` with ``activation_memory_budget`` (its min-cut recompute partitioner, backend aot_eager)
and eager ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (offload every saved tensor). Each row: the
measured median step time and ``torch.cuda.max_memory_allocated`` of a step, and the planner's predicted
time and peak. ``--deadline`` (seconds) skips what would not start in time, so the run stays bounded.

In ``--dry`` mode the same code runs on the CPU with tiny models and the H100 preset; memory is measured with
``karma_fx.measure_run.LiveBytes`` (live device storages) and times are CPU times, not comparable with the
predictions. It checks that the script works, nothing more.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch._dynamo
from tabulate import tabulate

import karma_fx
from karma_fx.budget import format_bytes
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.zoo import build, output_to_loss

STRATEGIES = "keep,checkpoint,offload,karma,torch-budget,cpsat"
REAL = {"gpt2-medium": ("gpt2", dict(layers=24, hidden=1024, heads=16, batch=8, seq=1024)),
        "resnet50": ("resnet50", dict(batch=128))}
TINY = {"gpt2-medium": ("gpt2", dict(layers=4)), "resnet50": ("resnet50", {})}


class Measure:
    """Time and peak device memory of training steps, on CUDA or (dry) on the CPU."""

    def __init__(self, cuda: bool, steps: int) -> None:
        self.cuda, self.steps = cuda, steps

    def __call__(self, model: torch.nn.Module, step: Callable, args: tuple, kwargs: dict,
                 around: Callable[[], Any] = contextlib.nullcontext) -> tuple[float, int]:
        def one() -> None:
            with around():
                output_to_loss(step(*args, **kwargs)).backward()
            for p in model.parameters():
                p.grad = None

        one()  # compile and warm up
        times = []
        for _ in range(self.steps):
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            one()
            if self.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            one()
            torch.cuda.synchronize()
            # Weights and inputs live before the step; the planner's peak counts them too.
            peak = torch.cuda.max_memory_allocated() - before + _resident_bytes(model, args, kwargs)
        else:
            from karma_fx.measure_run import measure_step_peak

            with around():
                peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
        return statistics.median(times) * 1e6, peak


def _resident_bytes(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _fresh(name: str, sizes: dict, size: str, device: str) -> tuple[torch.nn.Module, tuple, dict]:
    zoo_name, overrides = sizes[name]
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model, args, kwargs = build(zoo_name, size, device=device, **overrides)
    return model, args, kwargs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU, tiny models, preset device")
    p.add_argument("--models", default="gpt2-medium,resnet50")
    p.add_argument("--budgets", default=None, help="fractions of the unplanned peak (default 0.5,0.3; dry 0.95)")
    p.add_argument("--strategies", default=STRATEGIES)
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5; dry 1)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds; later rows are skipped")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    cuda = not a.dry
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --dry on a CPU")
    start = time.perf_counter()
    sizes, size, dev = (REAL, "real", "cuda") if cuda else (TINY, "tiny", "cpu")
    budgets = [float(b) for b in (a.budgets or ("0.5,0.3" if cuda else "0.95")).split(",")]
    measure = Measure(cuda, a.steps or (5 if cuda else 1))
    if cuda:
        from karma_fx.device import calibrate

        spec = calibrate()
        print(f"calibrated: H2D {spec.h2d_bytes_per_s / 1e9:.1f} GB/s, D2H {spec.d2h_bytes_per_s / 1e9:.1f} GB/s "
              f"({time.perf_counter() - start:.0f} s)")
    else:
        spec = karma_fx.get_device("h100")
    rows: list[list[Any]] = []
    for name in a.models.split(","):
        for budget in budgets:
            for strategy in a.strategies.split(","):
                if time.perf_counter() - start > a.deadline:
                    rows.append([name, budget, strategy, "skipped (deadline)", "", "", ""])
                    continue
                model, args, kwargs = _fresh(name, sizes, size, dev)
                compiled = karma_fx.compile(model, budget=budget, device=spec, strategy=strategy)
                try:
                    step_us, peak = measure(model, compiled, args, kwargs)
                except InfeasibleBudgetError as e:
                    rows.append([name, budget, strategy, f"infeasible (min {format_bytes(e.min_budget_bytes)})",
                                 "", "", ""])
                    continue
                plan = compiled.plan
                rows.append([name, budget, strategy, f"{step_us / 1e3:.2f}", format_bytes(peak),
                             f"{plan.step_time_us / 1e3:.2f}", format_bytes(plan.peak_bytes)])
            for label in ("torch activation_memory_budget", "torch save_on_cpu"):
                if time.perf_counter() - start > a.deadline:
                    rows.append([name, budget, label, "skipped (deadline)", "", "", ""])
                    continue
                model, args, kwargs = _fresh(name, sizes, size, dev)
                if label.startswith("torch activation"):
                    from torch._functorch import config as functorch_config

                    step = torch.compile(model, backend="aot_eager", dynamic=False)
                    with functorch_config.patch(activation_memory_budget=budget):
                        step_us, peak = measure(model, step, args, kwargs)
                else:
                    step_us, peak = measure(model, model, args, kwargs,
                                            around=lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda))
                rows.append([name, budget, label, f"{step_us / 1e3:.2f}", format_bytes(peak), "", ""])
    print(tabulate(rows, headers=["model", "budget", "strategy", "measured ms", "measured peak", "predicted ms",
                                  "predicted peak"], tablefmt="github"))
    print(f"total {time.perf_counter() - start:.0f} s on {'CUDA ' + torch.cuda.get_device_name() if cuda else 'CPU (dry)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
