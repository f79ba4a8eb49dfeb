"""Karma's model of Inductor's step against the allocator, on every zoo model at tiny size (CPU).

    python bench/inductor_peaks.py                    # every zoo model
    python bench/inductor_peaks.py gpt2 resnet50
    python bench/inductor_peaks.py cnn resnet50 --budgets 1.0 --no-layout-optimization

Per model, three steady steps are measured with the allocator's events (``AllocatorPeak``: the weights, buffers
and batch, plus the highest running sum of allocations during forward, loss and backward; every second step from
the fourth, so that karma's own measuring runs, and the step that traces a region again with an output no loss
differentiates detached, are outside them; the step's outputs held until the backward has run, as a
training loop that keeps ``outputs = model(**batch)`` holds them, or with ``--outputs dropped`` let go before it, as
``loss_fn(model(x)).backward()`` and HuggingFace's ``Trainer`` do: a decoder's logits its backward reads are then
freed once read, and karma counts them so): plain ``torch.compile`` (Inductor's own step), and
``karma_fx.compile(model, budget=b, compiler="inductor")`` at ``b=1.0`` (nothing moves) and at the budgets asked
for (``--budgets``). Each karma row prints the peak karma predicted for the step that ran
(``predicted_peak_bytes``) and how far the allocator's peak is from it: the issue's target is within 2%.
"""
from __future__ import annotations

import argparse
import gc
import sys
import warnings

import torch
from tabulate import tabulate

import karma_fx
from karma_fx.errors import KarmaError
from karma_fx.measure_run import AllocatorPeak
from karma_fx.zoo import build, names, output_to_loss


def _steady_peak(model: torch.nn.Module, step, args: tuple, kwargs: dict, steps: int = 8, held: bool = True) -> int:
    peaks = []
    existing = [*model.parameters(), *model.buffers(), *(a for a in args if isinstance(a, torch.Tensor)),
                *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]
    for i in range(steps):
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if i < 2 or i % 2 == 0:  # the second step may trace a region again (an output no loss differentiates)
            _one_step(step, args, kwargs, held)  # as every step (karma learns from the steps it measures whether
            continue  # the caller holds its outputs through the backward)
        with AllocatorPeak(existing) as meter:
            _one_step(step, args, kwargs, held)
        peaks.append(meter.peak_bytes)
    return max(peaks)


def _one_step(step, args: tuple, kwargs: dict, held: bool) -> None:
    if held:
        output = step(*args, **kwargs)
        output_to_loss(output).backward()
        del output
    else:
        output_to_loss(step(*args, **kwargs)).backward()


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=None)
    p.add_argument("--budgets", default="1.0,0.6", help="fractions, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-layout-optimization", action="store_true",
                   help="Inductor's layout optimization off on both sides (it runs convolutions channels-last in "
                        "a step that moves nothing, which karma's model does not count)")
    p.add_argument("--outputs", choices=("held", "dropped"), default="held",
                   help="the step's outputs held through the backward, or let go before it")
    a = p.parse_args(argv)
    held = a.outputs == "held"
    torch.set_num_threads(a.threads)
    if a.no_layout_optimization:
        import torch._inductor.config as inductor_config

        inductor_config.layout_optimization = False
    rows = []
    for name in a.models or names():
        torch.manual_seed(0)
        model, args, kwargs = build(name, "tiny")
        torch._dynamo.reset()
        plain = _steady_peak(model, torch.compile(model, dynamic=False), args, kwargs, held=held)
        rows.append([name, "torch.compile", "-", f"{plain / 2**20:.3f}", "-", "-"])
        for budget in (float(b) for b in a.budgets.split(",")):
            torch._dynamo.reset()
            step = karma_fx.compile(model, budget=budget, compiler="inductor")
            try:
                peak = _steady_peak(model, step, args, kwargs, held=held)
            except KarmaError as exc:
                rows.append([name, "karma", budget, "-", "-", f"{type(exc).__name__}"])
                continue
            predicted = step.predicted_peak_bytes
            rows.append([name, "karma", budget, f"{peak / 2**20:.3f}", f"{predicted / 2**20:.3f}",
                         f"{(peak - predicted) / predicted:+.1%}"])
            print(*rows[-1], sep="  ", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model (tiny)", "step", "budget", "measured MiB", "predicted MiB",
                                  "measured vs predicted"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
