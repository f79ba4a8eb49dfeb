"""Data-parallel out-of-core training of a GPT-style model with karma_fx, launched by torchrun.

    torchrun --nnodes N --nproc-per-node G examples/train_gpt_dp.py [--steps 3] [--budget 0.9]

Each rank plans and runs the out-of-core step on its shard of the global batch (``--batch`` sequences, split
evenly over the ranks); gradients are all-reduced in buckets while backward runs (NCCL on GPUs, gloo on CPUs)
and PyTorch's AdamW applies the update on the host, bucket by bucket. ``--size real`` trains GPT-2 small
(124M); the default ``tiny`` runs anywhere in seconds. ``--out`` saves rank 0's final parameters,
``--trace`` the last step's exchange/update timeline as a Chrome trace (chrome://tracing, Perfetto).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os

import torch
import torch.distributed as dist

import karma_fx
from karma_fx.zoo import build, output_to_loss


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "real"), default="tiny")
    p.add_argument("--batch", type=int, default=6, help="global batch, split evenly over the ranks")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", default="1.0", help="per-rank device budget: bytes ('12GiB') or a fraction")
    p.add_argument("--strategy", default="offload")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket-kib", type=int, default=8, help="gradient bucket size in KiB")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--out", help="save rank 0's parameters here (torch.save of the state dict)")
    p.add_argument("--trace", help="write rank 0's last-step exchange/update timeline (Chrome trace JSON)")
    return p.parse_args(argv)


def global_batch(size: str, batch: int) -> dict:
    """The same batch on every rank (seeded), before sharding."""
    _, _, kwargs = build("gpt2", size, batch=batch, dropout=0.0)
    return kwargs


def build_model(size: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model, _, _ = build("gpt2", size, batch=1, dropout=0.0)
    return model


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} does not split evenly over {world} ranks")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = build_model(a.size).to(device)
    batch = {k: v[rank::world].to(device) for k, v in global_batch(a.size, a.batch).items()}
    budget = float(a.budget) if a.budget.replace(".", "", 1).isdigit() else a.budget
    optimizer = (functools.partial(torch.optim.AdamW, lr=a.lr, foreach=True) if a.optimizer == "adamw"
                 else functools.partial(torch.optim.SGD, lr=a.lr, momentum=0.9))
    step = karma_fx.compile(model, budget=budget, strategy=a.strategy, data_parallel=True, optimizer=optimizer,
                            bucket_bytes=a.bucket_kib << 10)
    for i in range(a.steps):
        loss = output_to_loss(step(**batch))
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {i}: loss {mean.item() / world:.6f}", flush=True)
    step.pipeline.wait_updates()
    if rank == 0:
        print(f"{world} rank(s), {len(step.pipeline.buckets)} gradient buckets, plan: {step.plan.strategy}, "
              f"{len(step.plan.decisions)} decisions", flush=True)
        if a.out:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, a.out)
        if a.trace:
            with open(a.trace, "w") as f:
                json.dump(step.pipeline.chrome_trace(), f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
