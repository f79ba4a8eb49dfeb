"""Does the budget hold through a real training run, with default options? One row per model x door x budget.

    python bench/budget_probes.py                          # every case, both doors, budgets 0.9 and 0.6
    python bench/budget_probes.py --cases rescnn,t5 --doors compile --budgets 0.6
    python bench/budget_probes.py --list

Each case is trained as a user's loop does it: ``zero_grad(set_to_none=True)`` at the start of each
accumulation group, forward, loss, backward for each micro-batch, ``optimizer.step()`` (plain SGD, which keeps
no state) after the group. The model is compiled with nothing but a budget (``karma_fx.compile(model,
budget=b)`` or ``torch.compile(model, backend="karma", options={"budget": b}, dynamic=False)``), so what is
measured is what the defaults give. Every second micro-batch is measured with the allocator's own events
(``karma_fx.measure_run.AllocatorPeak``: what existed before it, the weights, buffers, gradients held and the
batch, plus the highest running sum of allocations during it); the others are left to karma, which measures
with the same profiler (a step's kernel scratch while it compiles, the code after its forward once per
sequence of runs) and cannot under someone else's session. So the first step (it compiles), and the first
after a new batch shape or layout (it recompiles), are not measured here: both run karma's one measuring run
of the unplanned step, host memory on this CPU that a CUDA device does not see (on a GPU that run spills
every value to host memory between ops). The budget in bytes is the one in force at the end
(``Plan.budget_bytes``; a fraction grows with the step it is a fraction of). With ``--rounds N`` each case
trains N times over its batches and the verdict is on the last round: a step karma measures above the budget
(its model of the compiled kernels short) makes it plan again with the difference as a margin
(``karma_fx.margin``), so a run settles; the steps before are printed apart, never hidden.

Cases: every zoo model at tiny size (``zoo:<name>``) and probe models of our own (``ProbeCase``): a residual
CNN, DenseNet-, MobileNet- and ViT-style models, a small transformer LM, a model that updates views in place,
HF T5, an activation-heavy MLP trained with gradient accumulation and called on pieces of a batch before one
backward, blocks with a graph break each, and a batch that changes size or layout mid-run.

A budget the planner refuses raises ``InfeasibleBudgetError`` naming the smallest total that works; the case is
then run again at that total, which must hold too (``named`` rows).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

Batch = tuple[tuple, dict, Any]
"""(args, kwargs, target) of one micro-batch; ``target`` is handed to the case's loss with the output."""


# ---- probe models ------------------------------------------------------------------------------------------
class ResCNN(nn.Module):
    """A small residual CNN: a stem and two residual blocks at 16 channels, pooled, a linear head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
            for _ in range(2))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = F.relu(h + block(h))
        return self.head(h.mean((2, 3)))


class DenseCNN(nn.Module):
    """DenseNet-style: each layer's output concatenated to its input (growth 8), a transition, a head."""

    def __init__(self, growth: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(16 + i * growth), nn.ReLU(),
                          nn.Conv2d(16 + i * growth, growth, 3, padding=1, bias=False))
            for i in range(layers))
        width = 16 + layers * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 16, 1), nn.AvgPool2d(2))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = torch.cat([h, layer(h)], dim=1)
        return self.head(self.transition(h).mean((2, 3)))


class MobileCNN(nn.Module):
    """MobileNet-style: depthwise-separable blocks (3x3 depthwise, 1x1 pointwise) with ReLU6, one residual."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU6())

        def separable() -> nn.Module:
            return nn.Sequential(nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False),
                                 nn.BatchNorm2d(width), nn.ReLU6(),
                                 nn.Conv2d(width, width, 1, bias=False), nn.BatchNorm2d(width))
        self.blocks = nn.ModuleList(separable() for _ in range(3))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h.mean((2, 3)))


class TinyViT(nn.Module):
    """ViT-style: 4x4 patches of a 32x32 image (64 tokens) and a class token through two encoder layers."""

    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, 65, dim) * 0.02)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True,
                                                                norm_first=True) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1) + self.position
        for layer in self.encoder:
            h = layer(h)
        return self.head(self.norm(h[:, 0]))


class SmallLM(nn.Module):
    """A small transformer language model: embedding, two encoder layers with dropout, a vocabulary head."""

    def __init__(self, d: int = 64, vocab: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
                                    for _ in range(2))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class InPlaceViews(nn.Module):
    """Updates views of intermediate tensors in place (a slice, a reshaped view, a transposed row) in each of
    four blocks: after functionalization these are scatter ops into their base, which the plan must account as
    PyTorch runs them. Activations, not weights, fill the step, so a plan has something to move."""

    def __init__(self, d: int = 256, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.out = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for lin in self.blocks:
            g = lin(h)
            g[:, : g.shape[1] // 2].mul_(0.5)
            g.view(g.shape[0], 4, -1)[:, 1].add_(1.0)
            g.t()[0].sub_(0.25)
            h = h + torch.tanh(g) * torch.sigmoid(g)
        return self.out(h)


class AccumulateMLP(nn.Module):
    """Activation-heavy: wide hidden layers on a large batch, small weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BrokenBlock(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.tanh(torch.tanh(self.up(x)) * 1.5) * 0.5)
        torch._dynamo.graph_break()  # as HF decoders with a break per layer
        return x + self.down(torch.tanh(torch.tanh(h) * 0.5))


class BrokenStack(nn.Module):
    """Six MLP blocks with a graph break in each: twelve region runs a step."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BrokenBlock() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# ---- cases ---------------------------------------------------------------------------------------------------
@dataclass
class ProbeCase:
    """A model, its micro-batches step by step, its loss, and how many micro-batches make one update."""

    name: str
    build: Callable[[], tuple[nn.Module, list[Batch], Callable[[Any, Any], torch.Tensor]]]
    accumulate: int = 1
    what: str = ""
    pieces: int = 1
    """The model is called on this many pieces of each micro-batch (its first argument) before one backward, and
    its outputs concatenated: the calls are runs of one step."""


def _forward(step: Callable, case: ProbeCase, args: tuple, kwargs: dict) -> Any:
    if case.pieces == 1:
        return step(*args, **kwargs)
    return torch.cat([step(piece, *args[1:], **kwargs) for piece in args[0].chunk(case.pieces)])


def _images(batch: int = 16) -> list[Batch]:
    return [((torch.randn(batch, 3, 32, 32),), {}, torch.randint(0, 10, (batch,))) for _ in range(4)]


def _classify(out: Any, target: Any) -> torch.Tensor:
    return F.cross_entropy(out, target)


def _lm_loss(out: Any, target: Any) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _zoo(name: str) -> ProbeCase:
    def make() -> tuple[nn.Module, list[Batch], Callable]:
        from karma_fx.zoo import build, output_to_loss

        model, args, kwargs = build(name, "tiny")
        return model, [(args, kwargs, None)] * 4, lambda out, _: output_to_loss(out)
    return ProbeCase(f"zoo:{name}", make, what=f"zoo {name}, tiny")


def _t5() -> tuple[nn.Module, list[Batch], Callable]:
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=2,
                                                d_kv=16, decoder_start_token_id=0, pad_token_id=0))
    batches = [((), {"input_ids": torch.randint(1, 100, (4, 16)), "labels": torch.randint(1, 100, (4, 16))}, None)
               for _ in range(4)]
    return model, batches, lambda out, _: out.loss


def _changing_batch() -> tuple[nn.Module, list[Batch], Callable]:
    """Two steps at batch 256, then two at 512, then two on a non-contiguous (transposed) batch of 512."""
    model = AccumulateMLP()
    small = [((torch.randn(256, 64),), {}, torch.randint(0, 8, (256,))) for _ in range(2)]
    large = ((torch.randn(512, 64),), {}, torch.randint(0, 8, (512,)))
    strided = ((torch.randn(64, 512).t(),), {}, torch.randint(0, 8, (512,)))
    return model, small + [large, large, strided, strided], _classify


CASES: dict[str, ProbeCase] = {c.name: c for c in [
    ProbeCase("rescnn", lambda: (ResCNN(), _images(), _classify), what="residual CNN, 16 ch, 16x3x32x32"),
    ProbeCase("densecnn", lambda: (DenseCNN(), _images(), _classify), what="DenseNet-style, concat growth 8"),
    ProbeCase("mobilecnn", lambda: (MobileCNN(), _images(), _classify), what="MobileNet-style, depthwise"),
    ProbeCase("vit", lambda: (TinyViT(), _images(), _classify), what="ViT-style, 65 tokens, d=64"),
    ProbeCase("small-lm", lambda: (SmallLM(), [((i,), {}, i) for i in [torch.randint(0, 512, (8, 64))] * 4],
                                   _lm_loss), what="2-layer transformer LM, vocabulary 512"),
    ProbeCase("inplace-views", lambda: (InPlaceViews(), [((torch.randn(1024, 64),), {}, torch.randint(0, 8, (1024,)))
                                                        for _ in range(4)], _classify),
              what="in-place updates of views"),
    ProbeCase("t5", _t5, what="HF T5, 2+2 layers, d=32"),
    ProbeCase("accumulate", lambda: (AccumulateMLP(), [((torch.randn(512, 64),), {}, torch.randint(0, 8, (512,)))
                                                       for _ in range(8)], lambda o, t: _classify(o, t) / 4),
              accumulate=4, what="MLP, 4 micro-batches per update"),
    ProbeCase("pieces", lambda: (AccumulateMLP(), [((torch.randn(512, 64),), {}, torch.randint(0, 8, (512,)))
                                                   for _ in range(4)], _classify),
              pieces=4, what="MLP called on 4 pieces of a batch before one backward"),
    ProbeCase("graph-breaks", lambda: (BrokenStack(), [((torch.randn(128, 64),), {}, None)] * 4,
                                       lambda out, _: out.square().mean()), what="6 blocks, a graph break each"),
    ProbeCase("new-batch", _changing_batch, what="batch 256, then 512, then 512 transposed"),
]}
ZOO_NAMES = ("mlp", "cnn", "resnet50", "resnet200", "resnet1001", "wrn28_10", "vgg16", "megatron_gpt", "gpt2",
             "bert", "llama")
for _name in ZOO_NAMES:
    CASES[f"zoo:{_name}"] = _zoo(_name)


# ---- running one -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one case did under one door and budget."""

    budget_bytes: int = 0
    steady_bytes: list[int] = field(default_factory=list)
    """Measured peaks of the last round over the batches (every round, with ``--rounds 1``)."""
    earlier_bytes: list[int] = field(default_factory=list)
    """Measured peaks of the rounds before it: where karma measured a step over the budget and planned again."""
    plan_peak_bytes: int = 0
    error: str = ""
    named_bytes: int = 0
    """The smallest total an ``InfeasibleBudgetError`` named, if one was raised."""
    seconds: float = 0.0

    @property
    def worst_steady(self) -> int:
        return max(self.steady_bytes, default=0)


def _held(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree

    args, kwargs, target = batch
    leaves = pytree.tree_leaves((args, kwargs, target))
    return [*model.parameters(), *model.buffers(), *(t for t in leaves if isinstance(t, torch.Tensor))]


def _compiled(model: nn.Module, door: str, budget: Any) -> tuple[Any, Callable[[], Any]]:
    """The model under ``door`` with nothing but ``budget``, and how to read the budget in bytes it planned."""
    import karma_fx
    from karma_fx.backend import regions

    if door == "compile":
        step = karma_fx.compile(model, budget=budget)
        return step, lambda: step.plan.budget_bytes
    options = {"budget": budget}
    step = torch.compile(model, backend="karma", options=options, dynamic=False)

    def planned() -> int:
        runs = [r for r in regions(options) if r.last is not None]
        return runs[-1].plan.budget_bytes if runs else 0
    step._karma_options = options  # keeps the options dict (the session's key) alive as long as the step
    return step, planned


def run_case(case: ProbeCase, door: str, budget: Any, rounds: int = 1) -> Outcome:
    """Train ``case`` under ``door`` at ``budget``, ``rounds`` times over its batches, measuring every second
    micro-batch; errors are reported, not raised."""
    from karma_fx.errors import InfeasibleBudgetError, KarmaError
    from karma_fx.measure_run import AllocatorPeak

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batches, loss_fn = case.build()
    out = Outcome()
    t0 = time.perf_counter()
    try:
        step, planned_budget = _compiled(model, door, budget)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for i, batch in enumerate(batches * rounds):
            if i % case.accumulate == 0:
                opt.zero_grad(set_to_none=True)
            args, kwargs, target = batch
            gc.collect()
            if i % 2 == 0:
                loss_fn(_forward(step, case, args, kwargs), target).backward()
            else:
                with AllocatorPeak(_held(model, batch)) as meter:
                    loss_fn(_forward(step, case, args, kwargs), target).backward()
                last = i >= len(batches) * (rounds - 1)
                (out.steady_bytes if last else out.earlier_bytes).append(meter.peak_bytes)
            if (i + 1) % case.accumulate == 0:
                opt.step()
        out.budget_bytes = planned_budget()
    except InfeasibleBudgetError as exc:
        out.error, out.named_bytes = f"infeasible: {_first_line(exc)}", exc.min_budget_bytes or 0
    except KarmaError as exc:
        out.error = f"{type(exc).__name__}: {_first_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - a raw error is a finding, reported as such
        inner = getattr(exc, "inner_exception", None) or exc
        out.error = f"RAW {type(inner).__name__}: {_first_line(inner)} @ {traceback.extract_tb(exc.__traceback__)[-1].name}"
    out.seconds = time.perf_counter() - t0
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:150]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}" if n else "-"


def verdict(o: Outcome) -> str:
    if o.error:
        return "RAW" if o.error.startswith("RAW") else "typed"
    return "ok" if o.worst_steady <= o.budget_bytes else "OVER"


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (see --list)")
    p.add_argument("--doors", default="compile,backend", help="compile (karma_fx.compile), backend (torch.compile)")
    p.add_argument("--budgets", default="0.9,0.6", help="fractions or sizes, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over each case's batches; the verdict is on the last (a steady run: steps "
                        "karma measured over the budget in earlier rounds are shown apart)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    if a.list:
        print(tabulate([[c.name, c.accumulate, c.what] for c in CASES.values()], headers=["case", "accumulate", "what"]))
        return 0
    torch.set_num_threads(a.threads)
    unknown = [c for c in a.cases.split(",") if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; see --list")
    rows, bad = [], 0
    for name in a.cases.split(","):
        for door in a.doors.split(","):
            for budget in a.budgets.split(","):
                b: Any = float(budget) if budget.replace(".", "", 1).isdigit() else budget
                o = run_case(CASES[name], door, b, a.rounds)
                rows.append(_row(name, door, budget, o))
                tries = 0
                while o.named_bytes and tries < 3:  # the total the error named must work (a later, larger
                    tries += 1                      # batch may name a larger one: try that too)
                    o = run_case(CASES[name], door, o.named_bytes, a.rounds)
                    rows.append(_row(name, door, "named", o))
                if o.named_bytes or verdict(o) in ("OVER", "RAW"):
                    bad += 1
                print(tabulate([rows[-1]], tablefmt="plain"), file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["case", "door", "budget", "MiB", "measured worst", "over", "verdict",
                                  "earlier rounds", "s", "error"]))
    print(f"\n{bad} case(s) over budget, refused at the total they named, or raw errors")
    return 1 if bad else 0


def _row(name: str, door: str, budget: str, o: Outcome) -> list:
    over = f"{o.worst_steady / o.budget_bytes - 1:+.1%}" if o.budget_bytes and o.steady_bytes else "-"
    earlier = max(o.earlier_bytes, default=0)
    before = f"{earlier / o.budget_bytes - 1:+.1%}" if earlier and o.budget_bytes else "-"
    return [name, door, budget, _mib(o.budget_bytes or o.named_bytes), _mib(o.worst_steady), over, verdict(o),
            before, f"{o.seconds:.0f}", o.error[:90]]


if __name__ == "__main__":
    raise SystemExit(main())
