"""A GPT sharded with FSDP2 and trained out of core with karma_fx, launched by torchrun.

    torchrun --nproc-per-node 2 examples/train_fsdp.py [--steps 3] [--budget 0.75] [--door backend] [--check]

Each transformer block and the root are sharded with ``torch.distributed.fsdp.fully_shard``; FSDP2 gathers each
block's weights for its forward and backward and reduce-scatters its gradients, as it does without karma (its
collectives and prefetching are untouched). karma plans the rest of each rank's step, the activations, within
``--budget`` per rank: a fraction of the step as it runs, or bytes ('2GiB'). ``--door compile`` uses
``karma_fx.compile(model, ...)``; ``--door backend`` (default) uses ``torch.compile(model, backend="karma")``, the
way torchtitan-style code compiles. Gloo on CPUs, NCCL on GPUs.

Rank 0 prints each step's mean loss, then every rank its allocator-measured peak of the last step (its shards,
its batch and what the step allocates) against its budget. ``--check`` trains the same model under FSDP2 without
karma too and prints the largest parameter difference after the same steps.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import karma_fx
from karma_fx.measure_run import AllocatorPeak
from karma_fx.zoo import build, output_to_loss


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "real"), default="tiny", help="tiny GPT-2, or GPT-2 small (124M)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", default="0.75", help="per-rank device budget: a fraction of the step, or bytes")
    p.add_argument("--door", choices=("compile", "backend"), default="backend")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="also train without karma and compare the parameters")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    return p.parse_args(argv)


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as its documentation applies it: every transformer block, then the root (embeddings, head)."""
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def train(model: torch.nn.Module, step, batches: list[dict], lr: float, rank: int, loud: bool
          ) -> tuple[list[torch.Tensor], int]:
    """AdamW over ``batches``; the last step's allocator peak on this rank."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    peak = 0
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:  # a steady step, measured as a user would: this rank's shards and batch
            gc.collect()
            with AllocatorPeak([p.to_local() for p in model.parameters()], list(batch.values())) as meter:
                loss = output_to_loss(step(**batch))
                loss.backward()
            peak = meter.peak_bytes
        else:
            loss = output_to_loss(step(**batch))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if loud and rank == 0:
            print(f"step {i}: loss {mean.item() / dist.get_world_size():.6f}", flush=True)
    return [p.full_tensor() for p in model.parameters()], peak


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    base, _, _ = build("gpt2", a.size, batch=1, seq=a.seq, dropout=0.0)
    base = base.to(device)
    batches = []
    for i in range(a.steps):  # a different batch per rank and step, the same in both runs
        torch.manual_seed(1000 * i + rank)
        _, _, kwargs = build("gpt2", a.size, batch=a.batch, seq=a.seq, dropout=0.0)
        batches.append({k: v.to(device) for k, v in kwargs.items()})
    budget = float(a.budget) if a.budget.replace(".", "", 1).isdigit() else a.budget

    model = sharded(copy.deepcopy(base))
    if a.door == "compile":
        step = karma_fx.compile(model, budget=budget)
    else:
        step = torch.compile(model, backend="karma", options={"budget": budget}, dynamic=False)
    got, peak = train(model, step, batches, a.lr, rank, loud=True)
    print(f"rank {rank}: peak {peak / 2**20:.2f} MiB of the last step (budget {a.budget})", flush=True)
    if a.check:
        reference = sharded(copy.deepcopy(base))
        want, plain = train(reference, reference, batches, a.lr, rank, loud=False)
        diff = max((x - y).abs().max().item() for x, y in zip(got, want))
        print(f"rank {rank}: without karma peak {plain / 2**20:.2f} MiB; largest parameter difference {diff:.3g}",
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
