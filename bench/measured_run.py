"""Predicted vs measured memory and time of the compiled training step on this machine (CPU).

    python bench/measured_run.py                       # peaks: tiny zoo models, roofline costs
    python bench/measured_run.py --time                # times: medium models, costs="measured"

Peaks: for each model the budget is halfway between the compiled step's lowest known-feasible peak and its
unplanned peak; the step is compiled, warmed up, then run once under ``AllocatorPeak`` (torch.profiler's
allocator events, which see the compiled step as it runs). A row per model x strategy: budget, simulated peak,
measured peak, their ratio.

Times (``--time``): medium models whose ops take a millisecond or more (a 4-layer d=512 GPT at sequence 512 and a
bottleneck ResNet at 64x64, batch 32); each is compiled with ``costs="measured"`` (its ops timed once here, the
copy ops' speed measured) at ``--fraction`` of its unplanned peak, planned and timed with its copies on worker
threads (``--copies threads``: overlapping compute, as on a GPU) or on the compute thread (``--copies sync``, the
CPU default, which the plan then counts as stalls), and the median of ``--steps`` steady-state steps is compared
with the plan's predicted step time. Compute runs on ``--threads`` intra-op threads (default 1), leaving the other
cores to the copy worker: the model gives copies an engine of their own, as a GPU's copy engines are, and a copy
thread competing with compute threads for the same cores is not in it (on two cores with two compute threads the
4-layer GPT's offload step ran 21.6% over its prediction, with one 7.7%; 2026-12-01). Before anything is built,
glibc is told to keep freed memory (``--host-memory keep``, ``karma_fx.runtime.keep_freed_host_memory``), as a
GPU's caching allocator keeps device memory; with its defaults every large tensor gets fresh pages, which a copy
thread running beside compute makes dearer still. The peak is measured with synchronous copies (frees where the
plan puts them) and checked against the budget, and with the copies as timed (compute waits for each swap-out
where the plan has it landed, so a copy later than modelled costs a stall there, not memory).

Each model's first row is its unplanned step (strategy ``keep`` at its own peak), and that step runs again
beside every planned step, one step each in turn: this machine's speed drifts by several percent over minutes, so
the last two columns set the plan's predicted cost over the unplanned step against its measured cost over the
unplanned step measured beside it, which the drift leaves out.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import torch
from tabulate import tabulate

import karma_fx
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.measure_run import measure_step_peak
from karma_fx.zoo import build, output_to_loss

MODELS = "mlp,cnn,resnet50,resnet200,resnet1001,wrn28_10,vgg16,megatron_gpt,gpt2,bert,llama"
MEDIUM = {
    "gpt-4x512": lambda: build("megatron_gpt", "tiny", batch=2, seq=512, layers=4, hidden=512, heads=8, vocab=2048),
    "resnet-64px": lambda: build("resnet50", "tiny", batch=32, image=64, width=32),
}


def peaks(a: argparse.Namespace) -> list[list]:
    rows = []
    for name in a.models.split(","):
        model, args, kwargs = build(name, "tiny")
        probe = karma_fx.compile(copy.deepcopy(model), budget=1.0, strategy="keep")
        probe(*args, **kwargs)
        high, low = probe.unplanned_peak_bytes, probe.min_budget_bytes
        budget = low + (high - low) // 2
        for strategy in a.strategies.split(","):
            model, args, kwargs = build(name, "tiny")
            compiled = karma_fx.compile(model, budget=budget, strategy=strategy)
            try:
                output_to_loss(compiled(*args, **kwargs)).backward()
            except InfeasibleBudgetError:
                rows.append([name, strategy, budget, "infeasible", "", ""])
                continue
            live = measure_step_peak(model, compiled, args, kwargs, output_to_loss)
            plan = compiled.plan
            rows.append([name, strategy, budget, plan.peak_bytes, live.peak_bytes,
                         f"{live.peak_bytes / plan.peak_bytes:.4f}"])
    return rows


def _step_ms(model: torch.nn.Module, step: Any, args: tuple, kwargs: dict) -> float:
    start = time.perf_counter()
    output_to_loss(step(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def times(a: argparse.Namespace) -> list[list]:
    """One row per medium model x strategy, and first one for the unplanned step (strategy ``keep``, nothing
    moved). The unplanned step runs interleaved with each planned one, step for step: this machine's speed
    drifts by several percent over minutes, and the planned step's cost over the unplanned one measured beside
    it is free of that drift, so the last two columns show how well the plan's own cost is predicted."""
    from karma_fx.budget import format_bytes
    from karma_fx.runtime import copy_mode

    rows = []
    for name in a.medium.split(","):
        base_model, base_args, base_kwargs = MEDIUM[name]()
        base = karma_fx.compile(base_model, budget=1.0, strategy="keep", costs="measured")
        for strategy in ["unplanned"] + a.strategies.split(","):
            if strategy == "unplanned":
                model, args, kwargs, step = base_model, base_args, base_kwargs, base
            else:
                model, args, kwargs = MEDIUM[name]()
                step = karma_fx.compile(model, budget=a.fraction, strategy=strategy, costs="measured",
                                        time_limit_s=30)
            with copy_mode(a.copies):
                try:
                    for _ in range(2):
                        _step_ms(model, step, args, kwargs)
                        _step_ms(base_model, base, base_args, base_kwargs)
                except InfeasibleBudgetError:
                    rows.append([name, strategy, "infeasible"] + [""] * 9)
                    continue
                measured, beside = [], []
                for _ in range(a.steps):
                    measured.append(_step_ms(model, step, args, kwargs))
                    beside.append(_step_ms(base_model, base, base_args, base_kwargs))
                threaded_peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
            model.zero_grad(set_to_none=True)
            output_to_loss(step(*args, **kwargs)).backward()  # a step with synchronous copies first
            peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
            model.zero_grad(set_to_none=True)
            plan = step.plan
            ms = statistics.median(measured)
            predicted = plan.step_time_us / 1e3
            rows.append([name, strategy, format_bytes(plan.budget_bytes), f"{predicted:.1f}", f"{ms:.1f}",
                         f"{ms / predicted - 1:+.1%}", format_bytes(plan.peak_bytes), format_bytes(peak),
                         "yes" if peak <= plan.budget_bytes else "NO", format_bytes(threaded_peak),
                         f"{plan.slowdown - 1:+.1%}",
                         f"{ms / statistics.median(beside) - 1:+.1%}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=MODELS)
    p.add_argument("--strategies", default="checkpoint,offload,karma")
    p.add_argument("--time", action="store_true", help="predicted vs measured step time of the medium models")
    p.add_argument("--medium", default=",".join(MEDIUM))
    p.add_argument("--fraction", type=float, default=0.7)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--copies", default="threads", choices=("threads", "sync"), help="CPU copy engine planned and timed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for --time (0: torch's default); the rest of the cores copy")
    p.add_argument("--host-memory", default="keep", choices=("keep", "default"),
                   help="--time: keep freed host memory for reuse, as a GPU's caching allocator does "
                        "(karma_fx.runtime.keep_freed_host_memory), or glibc's default")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if a.time:
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.host_memory == "keep":
            from karma_fx.runtime import keep_freed_host_memory

            keep_freed_host_memory()
        rows = times(a)
        print(tabulate(rows, headers=["model", "strategy", "budget", "predicted ms", "measured ms", "error",
                                      "simulated peak", "measured peak", "peak <= budget",
                                      f"peak, {a.copies} copies", "over unplanned: predicted",
                                      "measured (interleaved)"], tablefmt="github"))
    else:
        print(tabulate(peaks(a), headers=["model (tiny)", "strategy", "budget B", "simulated peak B",
                                          "measured peak B", "measured / simulated"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
