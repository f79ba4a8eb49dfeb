"""The host's update rate: what a step whose weights live in host memory can do per second on this machine.

    python bench/host_update.py [--params 16777216] [--repeats 3]

With weights out of core (``offload_weights=True``) every parameter is updated on the host every step, and under
bf16-mixed the host also makes each weight's bf16 copy and widens each bf16 gradient (``karma_fx.wire``). This
times those on this machine, per thread count (``torch.set_num_threads``): PyTorch's fused CPU AdamW (and
``foreach``, for comparison), a fp32 → bf16 cast, a fp32 copy. The last column is the host's part of one step
of a 1.56B-parameter model (Megatron-GPT) in bf16-mixed: update plus two casts per parameter. Plans use the
same measurement at the process's thread count (``karma_fx.host.this_host``).
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from karma_fx.host import best_seconds, host_step_us, measure_host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    most = torch.get_num_threads()
    rows = []
    for threads in sorted({1, max(1, most // 2), most}):
        torch.set_num_threads(threads)
        host = measure_host(args.params, args.repeats)
        q = torch.zeros(args.params, requires_grad=True)
        q.grad = torch.randn(args.params)
        foreach = torch.optim.AdamW([q], foreach=True)
        foreach_rate = args.params / best_seconds(foreach.step, args.repeats)
        megatron = host_step_us(host, 1_560_000_000, 2 * 1_560_000_000)
        rows.append([threads, f"{host.update_params_per_s / 1e9:.3f}", f"{foreach_rate / 1e9:.3f}",
                     f"{host.cast_params_per_s / 1e9:.3f}", f"{host.copy_gbps:.1f}", f"{megatron / 1e3:,.0f}"])
    torch.set_num_threads(most)
    print(f"{args.params:,} fp32 parameters, best of {args.repeats}\n")
    print(tabulate(rows, headers=["threads", "fused AdamW G params/s", "foreach AdamW G params/s",
                                  "bf16 cast G params/s", "copy GB/s", "1.56B bf16-mixed step, host ms"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
