"""Predicted weak-scaling efficiency of data-parallel out-of-core training, 1 to 512 GPUs.

    python bench/scaling.py [--models 1.5B,8.3B] [--batch 4] [--budget 15GiB] [--strategy karma]
                            [--network-gbps 100] [--gpus-per-node 4] [--size real|tiny]

KARMA's setting: ABCI nodes, 4 x V100-16GB per node on NVLink, InfiniBand EDR (100 Gbit/s) between nodes.
Each GPU plans its own out-of-core step (the per-GPU batch is fixed: weak scaling) under the budget, then
``karma_fx.cluster.parallel_step`` adds the bucketed gradient all-reduce (overlapping backward) and the host
optimizer update. Efficiency = step time on one GPU / step time on N GPUs. The busy shares are fractions of the
step in which each resource works; they overlap, so they add up to more than 100%.

Beside it, FSDP2 (``karma_fx.fsdp.fsdp_step``): the same per-GPU plan with each block's weights all-gathered for
its forward and backward (prefetched one block ahead) and its gradients reduce-scattered, the update on the device.
The plan is the one made for replicated weights: a rank that holds 1/N of them has more room for activations,
which this does not re-plan, so FSDP2's column is an upper bound on its step time.

Models: Megatron-style GPT (the zoo's ``megatron_gpt``) at 1.5B (hidden 1600, 48 layers, 25 heads) and 8.3B
(hidden 3072, 72 layers, 32 heads), sequence 1024, fp32.
"""
from __future__ import annotations

import argparse
import time
import warnings

from tabulate import tabulate

import karma_fx
from karma_fx.cluster import Cluster, parallel_step, weak_scaling_efficiency
from karma_fx.fsdp import fsdp_step
from karma_fx.zoo import build

MODELS = {"1.5B": dict(hidden=1600, layers=48, heads=25), "8.3B": dict(hidden=3072, layers=72, heads=32)}
GPUS = (1, 4, 8, 16, 32, 64, 128, 256, 512)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1.5B,8.3B")
    p.add_argument("--size", choices=("real", "tiny"), default="real")
    p.add_argument("--batch", type=int, default=4, help="per-GPU batch (sequences of 1024 tokens)")
    p.add_argument("--budget", default="15GiB", help="device memory for the step (V100-16GB less CUDA context)")
    p.add_argument("--device", default="v100")
    p.add_argument("--strategy", default="karma")
    p.add_argument("--network-gbps", type=float, default=100.0)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--gpus", default=",".join(map(str, GPUS)))
    p.add_argument("--weights", choices=("auto", "device", "host"), default="auto",
                   help="where the weights live: on the device, streamed from the host (weights out of core), "
                        "or auto: on the device when the step fits that way, else streamed")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in a.models.split(","):
        start = time.perf_counter()
        overrides = MODELS[name] if a.size == "real" else {}
        model, args, kwargs = build("megatron_gpt", a.size, device="meta", batch=a.batch, **overrides)
        params = sum(t.numel() for t in model.parameters())
        prepared = karma_fx.prepare(model, args, kwargs, device=a.device)
        budget = a.budget if a.size == "real" else 1.0
        planned = None
        if a.weights != "host":
            planned = prepared.plan(budget, a.strategy, raise_if_infeasible=False)
        if planned is None or (a.weights == "auto" and not planned.plan.fits):
            planned = prepared.plan(budget, a.strategy, raise_if_infeasible=False, offload_weights=True)
        plan = planned.plan
        where = "streamed from the host" if plan.streamed_weights else "on the device"
        print(f"## Megatron GPT {name} ({params / 1e9:.2f}B parameters, {a.size}), batch {a.batch} per GPU, "
              f"{a.device}, budget {plan.budget_bytes / 2**30:.2f} GiB, strategy {plan.strategy}, weights {where} "
              f"(planned in {time.perf_counter() - start:.0f} s)")
        if not plan.fits:
            print(f"does not fit: the best plan peaks at {plan.peak_bytes / 2**30:.2f} GiB > "
                  f"{plan.budget_bytes / 2**30:.2f} GiB\n")
            continue
        rows = []
        for gpus in map(int, a.gpus.split(",")):
            per_node = min(gpus, a.gpus_per_node)
            cluster = Cluster(nodes=max(1, gpus // per_node), gpus_per_node=per_node, network_gbps=a.network_gbps)
            step = parallel_step(planned.problem, planned.timeline, planned.costs, cluster)
            eff = weak_scaling_efficiency(planned.problem, planned.timeline, planned.costs, cluster)
            sharded = fsdp_step(planned.problem, planned.timeline, cluster)
            rows.append([gpus, cluster.nodes, f"{step.step_time_us / 1e3:,.1f}", f"{eff:.1%}",
                         f"{step.share(step.compute_us):.0%}", f"{step.share(step.copy_us):.0%}",
                         f"{step.share(step.allreduce_us):.0%}", f"{step.share(step.host_update_us):.0%}",
                         f"{sharded.step_time_us / 1e3:,.1f}",
                         f"{planned.timeline.makespan_us / sharded.step_time_us:.1%}",
                         f"{sharded.share(sharded.allreduce_us):.0%}"])
        print(tabulate(rows, headers=["GPUs", "nodes", "step ms", "efficiency", "compute", "copies", "all-reduce",
                                      "host update", "FSDP2 step ms", "FSDP2 eff.", "gather+scatter"],
                       tablefmt="github"))
        print(f"one GPU alone, no exchange, no host update: {planned.timeline.makespan_us / 1e3:,.1f} ms; "
              f"slowdown over unlimited memory {plan.slowdown:.3f}x\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
