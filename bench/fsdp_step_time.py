"""Per-rank step time under FSDP2: karma at a budget that moves nothing against FSDP2 with Inductor alone,
interleaved in one process per rank.

    torchrun --nproc-per-node 2 bench/fsdp_step_time.py [--layers 4] [--hidden 256] [--rounds 16] [--budget 1.0]

A GPT-2 (the zoo's, no dropout) sharded with ``fully_shard`` per block and the root, twice from the same weights:
one compiled with ``torch.compile`` (Inductor), one with ``backend="karma"``. After warm-up steps, each round
times one AdamW step of each, in alternating order, between barriers. Each rank prints the medians and their
ratio (karma / Inductor); issue 33 asks for at most 1.03 at a budget that moves nothing. Gloo on CPUs, NCCL on
GPUs.

Dynamo compiles each FSDP2 block's frame once per model instance: the cache limits are raised so that two
instances of one model class do not fall back to eager (the default limit of 8 is reached by the second model's
blocks).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import time
import warnings

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from karma_fx.zoo import build, output_to_loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--budget", default="1.0")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    shape = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, dropout=0.0, seq=a.seq)
    torch.manual_seed(0)
    base, _, _ = build("gpt2", "tiny", batch=1, **shape)
    base = base.to(device)
    torch.manual_seed(1 + rank)
    _, _, batch = build("gpt2", "tiny", batch=a.batch, **shape)
    batch = {k: v.to(device) for k, v in batch.items()}
    budget = float(a.budget) if a.budget.replace(".", "", 1).isdigit() else a.budget

    def sharded() -> torch.nn.Module:
        model = copy.deepcopy(base)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model

    models = {"inductor": sharded(), "karma": sharded()}
    steps = {"inductor": torch.compile(models["inductor"], dynamic=False),
             "karma": torch.compile(models["karma"], backend="karma", options={"budget": budget}, dynamic=False)}
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}

    def one(name: str) -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        output_to_loss(steps[name](**batch)).backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(a.warmup):
        for name in steps:
            one(name)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(a.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            times[name].append(one(name))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"rank {rank}: {a.layers} blocks, d={a.hidden}, budget {a.budget}: median step FSDP2+Inductor "
          f"{med['inductor'] * 1e3:.1f} ms, through karma {med['karma'] * 1e3:.1f} ms, ratio "
          f"{med['karma'] / med['inductor']:.3f}\n", end="", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
