"""Planned steps under Inductor against plain Inductor, on the Hugging Face models: loss and every gradient.

    python bench/inductor_numerics.py [--models gpt2,bert,llama] [--strategies offload,checkpoint,cpsat]
                                      [--positions 0.5,0.9] [--batch 8 --seq 128] [--steps 3] [--size tiny]

For each zoo model, strategy and budget: ``karma_fx.compile(..., compiler="inductor")`` and ``torch.compile(backend="inductor")`` train copies of
the same model side by side with SGD for ``--steps`` steps; the table shows what the plan moved (offloads,
recomputed tensors) and the largest relative difference of the loss and of any parameter's gradient
(max |a - b| over max |b|, per parameter, ``NOISE`` for a gradient that is zero but for rounding) over all
steps. The target is fp32 equality within 1e-5: a plan
moves tensors, it must not change a number, and a recomputed fused kernel must round as the original did.
A row whose plan moves nothing says so (that row only checks the unplanned path). A budget is a position
between the lowest peak a plan reaches (0) and the unplanned peak (1), both read from a first compile that
plans nothing: the tiny models' weights dominate their memory, so a fraction of the peak such as 0.9 is
below anything a plan reaches (BERT and Llama at the zoo's tiny sequence length save nothing worth
moving; ``--batch`` and ``--seq`` make the activations matter). Inductor compiles each graph once per
variant, a minute or more per model on two cores; the kernels are cached in ``TORCHINDUCTOR_CACHE_DIR`` (a
temporary directory unless set).
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile
import warnings

import torch
import torch._dynamo
from tabulate import tabulate

import karma_fx
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.plan import Offload, Recompute
from karma_fx.zoo import build, output_to_loss

TOLERANCE = 1e-5
NOISE = 1e-4
"""A gradient below this fraction of the model's largest is compared at that scale instead of its own, so
the check is ``|a - b| <= TOLERANCE * max(|b|, NOISE * largest)``: an error of 1e-9 of the largest gradient
still fails. Why: BERT's attention key biases get ~1e-12 against a largest gradient of ~0.05 (the softmax
cannot see them: their true gradient is zero), and no two compiled programs reproduce that rounding digit for
digit (plain Inductor's differs from eager's by half its size; karma's from Inductor's by as much)."""


def compare(model: torch.nn.Module, args: tuple, kwargs: dict, strategy: str, budget: int,
            steps: int) -> dict:
    """Train karma (planned, Inductor) and plain Inductor side by side; the largest differences and the plan."""
    reference = copy.deepcopy(model)
    try:
        planned = karma_fx.compile(model, budget=budget, strategy=strategy, compiler="inductor")
        loss_a = output_to_loss(planned(*args, **kwargs))  # plans on the first call
    except InfeasibleBudgetError as exc:
        return {"error": f"infeasible: {str(exc).splitlines()[0]}"}
    plain = torch.compile(reference, backend="inductor", dynamic=False)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(reference.parameters(), lr=0.05)
    worst_loss = worst_grad = 0.0
    for step in range(steps):
        if step:
            loss_a = output_to_loss(planned(*args, **kwargs))
        loss_a.backward()
        loss_b = output_to_loss(plain(*args, **kwargs))
        loss_b.backward()
        worst_loss = max(worst_loss, abs(loss_a.item() - loss_b.item()) / max(abs(loss_b.item()), 1e-30))
        pairs = [(p, q) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
        largest = max(q.grad.abs().max().item() for _, q in pairs)
        for p, q in pairs:
            scale = max(q.grad.abs().max().item(), NOISE * largest, 1e-30)
            worst_grad = max(worst_grad, (p.grad - q.grad).abs().max().item() / scale)
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    plan = planned.plan
    return {"offloads": sum(isinstance(d, Offload) for d in plan.decisions),
            "recomputed": sum(len(d.tensors) for d in plan.decisions if isinstance(d, Recompute)),
            "loss": worst_loss, "grad": worst_grad}


def built(name: str, opts: argparse.Namespace) -> tuple[torch.nn.Module, tuple, dict]:
    """The zoo model at ``--size``, with ``--batch`` and (language models) ``--seq``, dropout off: Inductor
    draws its random numbers with its own generator, so with dropout the two steps differ by design."""
    from karma_fx.zoo import ZOO

    seq = {"seq": opts.seq} if ZOO[name].takes_seq else {}
    nodrop = {"dropout": 0.0} if "dropout" in ZOO[name].overrides else {}
    return build(name, opts.size, batch=opts.batch, **seq, **nodrop)


def peaks(name: str, opts: argparse.Namespace) -> tuple[int, int]:
    """The step's unplanned peak and the lowest budget a plan reaches, compiled by Inductor (the plan counts
    what Inductor allocates, so these differ from the eager step's)."""
    torch._dynamo.reset()
    model, args, kwargs = built(name, opts)
    probe = karma_fx.compile(model, budget=1.0, strategy="keep", compiler="inductor")
    output_to_loss(probe(*args, **kwargs))
    return probe.unplanned_peak_bytes, probe.min_budget_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert,llama")
    parser.add_argument("--strategies", default="offload,checkpoint,cpsat")
    parser.add_argument("--positions", default="0.5,0.9",
                        help="budgets between the lowest reachable peak (0) and the unplanned peak (1)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", default="tiny", choices=("tiny", "real"))
    opts = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="karma-inductor-"))
    warnings.filterwarnings("ignore")
    rows = []
    for name in opts.models.split(","):
        high, low = peaks(name, opts)
        for strategy in opts.strategies.split(","):
            for position in (float(b) for b in opts.positions.split(",")):
                budget = int(low + position * (high - low))
                torch._dynamo.reset()
                model, args, kwargs = built(name, opts)
                got = compare(model, args, kwargs, strategy, budget, opts.steps)
                if "error" in got:
                    rows.append([name, strategy, f"{position:g} ({budget} B)", "-", "-", "-", got["error"]])
                    continue
                moved = got["offloads"] + got["recomputed"]
                verdict = ("equal" if max(got["loss"], got["grad"]) <= TOLERANCE else "DIFFERENT") \
                    + ("" if moved else " (nothing moved)")
                rows.append([name, strategy, f"{position:g} ({budget} B)", f"{got['offloads']} / {got['recomputed']}",
                             f"{got['loss']:.1e}", f"{got['grad']:.1e}", verdict])
                print(*rows[-1], flush=True)
    print(tabulate(rows, headers=["model", "strategy", "budget", "offloads / recomputed", "loss rel",
                                  "max grad rel", f"within {TOLERANCE:g}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
