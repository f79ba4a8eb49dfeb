"""A HuggingFace decoder returns its logits beside the loss: the steady step's allocator peak under plain
``torch.compile`` (which gives the logits a zero gradient and runs the head's backward on it) and under
``karma_fx.compile(budget=1.0)`` (which returns them detached from the second step: ``karma_fx.unused_grads``).

    python bench/unused_outputs.py                          # Inductor both sides
    python bench/unused_outputs.py --compiler eager         # aot_eager against karma op by op
    python bench/unused_outputs.py --layers 2 --vocab 4096  # a smaller decoder

The model is the zoo's HF GPT-2 (tiny: d=256, 4 heads, dropout off) at batch 2 x 512 by default. The loop is
``out = step(**batch); out.loss.backward()`` (the logits held through the backward, as a loop that keeps the
output does) or ``step(**batch).loss.backward()`` (dropped first, as the HF ``Trainer``). Each configuration gets a
fresh copy of the model and a reset Dynamo, trains ``--steps`` steps and measures one more with ``AllocatorPeak``
(weights, buffers and the batch counted as what existed before the step; gradients dropped before it).
"""
from __future__ import annotations

import argparse
import copy

import torch
from tabulate import tabulate

import karma_fx
from karma_fx.measure_run import AllocatorPeak
from karma_fx.zoo import build


def peak(model: torch.nn.Module, step, batch: dict, hold: bool, steps: int) -> int:
    def one() -> None:
        if hold:
            out = step(**batch)
            out.loss.backward()
        else:
            step(**batch).loss.backward()

    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        one()
    model.zero_grad(set_to_none=True)
    with AllocatorPeak(model.parameters(), model.buffers(), list(batch.values())) as meter:
        one()
    return meter.peak_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(1)
    base, _, batch = build("gpt2", "tiny", batch=a.batch, seq=a.seq, layers=a.layers, hidden=256, heads=4,
                           vocab=a.vocab, dropout=0.0)
    logits = a.batch * a.seq * a.vocab * 4
    rows = []
    for hold in (True, False):
        found = {}
        for who in ("torch.compile", "karma_fx, budget=1.0"):
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            if who == "torch.compile":
                step = torch.compile(model, backend="inductor" if a.compiler == "inductor" else "aot_eager")
            else:
                step = karma_fx.compile(model, budget=1.0, compiler=a.compiler)
            found[who] = peak(model, step, batch, hold, a.steps)
        theirs, ours = found["torch.compile"], found["karma_fx, budget=1.0"]
        rows.append(["held" if hold else "dropped", f"{theirs / 2**20:.2f}", f"{ours / 2**20:.2f}",
                     f"{(ours - theirs) / 2**20:+.2f}", f"{(theirs - ours) / logits:.2f}"])
    print(f"HF GPT-2, {a.layers} layers, d=256, vocabulary {a.vocab}, batch {a.batch}x{a.seq}, {a.compiler}; "
          f"fp32 logits {logits / 2**20:.2f} MiB")
    print(tabulate(rows, headers=["logits in the loop", "torch.compile MiB", "karma MiB", "difference",
                                  "saved, in logits"]))


if __name__ == "__main__":
    main()
