"""Overhead of karma_fx when nothing has to move: step time with an unlimited budget vs PyTorch's own.

    python bench/overhead.py [--models cnn,gpt2,llama,resnet50] [--size tiny] [--steps 30]

Per model, one training step (forward, loss, backward, zeroed grads) is timed under: eager PyTorch;
``torch.compile(backend="aot_eager_default_partitioner")`` (AOTAutograd, no compiler, PyTorch's default
partitioner — the graphs an empty plan emits); ``torch.compile(backend="karma")`` with a 1 TiB budget; and
``karma_fx.compile`` with a 1 TiB budget. Variants run interleaved, step by step, so machine drift hits them
alike; the table gives median milliseconds and the overhead of each karma variant over the AOT baseline.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch._dynamo
from tabulate import tabulate

import karma_fx
from karma_fx.zoo import build, output_to_loss


def _variants(name: str, size: str) -> dict:
    made = {}
    for label in ("eager", "aot_eager (default partitioner)", "torch.compile karma", "karma_fx.compile"):
        model, args, kwargs = build(name, size)
        if label.startswith("aot_eager"):
            step = torch.compile(model, backend="aot_eager_default_partitioner", dynamic=False)
        elif label == "torch.compile karma":
            step = torch.compile(model, backend="karma", options={"budget": "1TiB"}, dynamic=False)
        elif label == "karma_fx.compile":
            step = karma_fx.compile(model, budget="1TiB")
        else:
            step = model
        made[label] = (model, step, args, kwargs)
    return made


def _one_step(model, step, args, kwargs) -> float:
    start = time.perf_counter()
    output_to_loss(step(*args, **kwargs)).backward()
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,gpt2,llama,resnet50")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rows = []
    for name in a.models.split(","):
        torch._dynamo.reset()
        variants = _variants(name, a.size)
        times: dict[str, list[float]] = {label: [] for label in variants}
        for label, v in variants.items():  # compile and warm up
            _one_step(*v), _one_step(*v)
        for _ in range(a.steps):
            for label, v in variants.items():
                times[label].append(_one_step(*v))
        median = {label: statistics.median(t) * 1e3 for label, t in times.items()}
        base = median["aot_eager (default partitioner)"]
        for label, ms in median.items():
            rows.append([name, label, f"{ms:.3f}", f"{(ms / base - 1) * 100:+.1f}%"])
    print(tabulate(rows, headers=["model", "step", "median ms", "vs aot_eager (default partitioner)"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
