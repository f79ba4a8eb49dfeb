"""Host work of a call through the front door: what ``karma_fx.compile`` adds to a step where nothing moves.

    python bench/host_work.py [--models params,layers] [--doors eager,inductor] [--rounds 15] [--calls 300]
                              [--keep-grads]

Two models of 300 weights with steps short enough that host work shows: ``params`` (300 small parameters, two
of them read, a handful of ops) and ``layers`` (149 ``Linear(4, 4)`` and one more, all read). Each call zeroes
the gradients (``p.grad = None``, as ``zero_grad()``), runs the model and its backward; with ``--keep-grads``
the gradients accumulate instead, so every call begins holding them (gradient accumulation).

Per model, four variants run interleaved, ``--calls`` calls a round, and the table gives medians over
``--rounds`` rounds:

* the op-by-op door (``compiler="eager"``) against ``torch.compile`` with AOTAutograd, no compiler and
  PyTorch's default partitioner: the same graphs, so the difference is karma's host work;
* the Inductor door (the default) against ``torch.compile(backend="inductor")``: Inductor on both sides, but
  PyTorch partitions with its min-cut partitioner and karma with its own, so the graphs differ too.

Budgets are 1 TiB: nothing moves. One compute thread.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn
from tabulate import tabulate


class ManyParameters(nn.Module):
    """300 weights, a handful of ops: the step is nearly all host work."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(298)])
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.ws[0] + self.ws[1]).sum()


class ManyLayers(nn.Module):
    """300 weights, every one read: 150 small linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(150)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).sum()


MODELS = {"params": ManyParameters, "layers": ManyLayers}
VARIANTS = ("torch.compile, aot_eager", "karma_fx.compile, eager", "torch.compile, inductor",
            "karma_fx.compile, inductor")


def _compiled(label: str, model: nn.Module):
    import karma_fx
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    if label == "torch.compile, aot_eager":
        return torch.compile(model, backend=aot_autograd(fw_compiler=lambda gm, _: gm,
                                                         partition_fn=default_partition))
    if label == "torch.compile, inductor":
        return torch.compile(model, backend="inductor")
    return karma_fx.compile(model, budget="1TiB", compiler=label.rsplit(" ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--doors", default="eager,inductor", help="which pairs of rows to time")
    ap.add_argument("--keep-grads", action="store_true", help="accumulate gradients instead of zeroing them")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    doors = args.doors.split(",")
    if not doors or set(doors) - {"eager", "inductor"}:
        ap.error(f"--doors takes eager and/or inductor, got {args.doors!r}")
    pairs = [(VARIANTS[0], VARIANTS[1])] * ("eager" in doors) + [(VARIANTS[2], VARIANTS[3])] * ("inductor" in doors)
    variants = [label for pair in pairs for label in pair]
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        made = {}
        for label in variants:
            model = MODELS[name]()
            made[label] = (model, list(model.parameters()), _compiled(label, model))
        x = torch.randn(2, 4)

        def call(params: list, step) -> None:
            if not args.keep_grads:
                for p in params:
                    p.grad = None
            step(x).backward()

        for model, params, step in made.values():  # compile, plan, measure and settle
            for _ in range(10):
                call(params, step)
        times: dict[str, list[float]] = {label: [] for label in variants}
        for _ in range(args.rounds):
            for label, (_, params, step) in made.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call(params, step)
                times[label].append((time.perf_counter() - t0) / args.calls * 1e3)
        med = {label: statistics.median(v) for label, v in times.items()}
        for theirs, ours in pairs:
            rows.append([name, theirs, f"{med[theirs]:.3f}", ours, f"{med[ours]:.3f}",
                         f"{med[ours] - med[theirs]:+.3f}"])
    print(tabulate(rows, headers=["model", "PyTorch", "ms a call", "karma", "ms a call", "karma adds, ms"],
                   tablefmt="github"))
    print(f"\nmedians of {args.rounds} rounds of {args.calls} calls, one thread; gradients "
          + ("accumulated" if args.keep_grads else "zeroed before each call"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
