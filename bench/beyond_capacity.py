"""Training beyond the device's capacity, simulated: weights, gradients and AdamW state 2x, 4x and 8x the budget.

    python bench/beyond_capacity.py [--models megatron_gpt,llama,llama3-8b] [--factors 2,4,8]
                                    [--device h100] [--precision bf16-mixed] [--size real|tiny]

Each model is captured once at real size (on ``meta``: nothing is allocated) and planned with its weights
streamed from host memory (``offload_weights=True``) at budget = state / factor, where the state is what a
step holds for each parameter in fp32 training with AdamW: the weight, its gradient and two moments, 16 bytes.
Under bf16-mixed the weights cross the link as their bf16 casts, made on the host, and the gradients come back
in bf16, widened on the host (``karma_fx.wire``).

Per row: the planned step against the unlimited-memory one, the physical bound (the largest of compute, the
weights' bytes in and the gradients' out over the link, and the host's update of every weight at this
machine's measured rate, ``karma_fx.host``) and which of them sets it. On a host with few cores the update is
the bottleneck: the device step beside it says what a host that keeps up would see.

Models: Megatron-GPT 1.56B (the zoo's real size), Llama 1.1B (the zoo's real size) and a Llama-3-8B-shaped
Llama (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocabulary 128256).
"""
from __future__ import annotations

import argparse
import time
import warnings

from tabulate import tabulate

import karma_fx
from karma_fx.host import this_host
from karma_fx.strategies.weights import physical_bound
from karma_fx.zoo import build

MODELS = {
    "megatron_gpt": ("megatron_gpt", {}),
    "llama": ("llama", {}),
    "llama3-8b": ("llama", dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)),
}
STATE_BYTES_PER_PARAM = 16  # fp32 weight, gradient, and AdamW's two moments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="megatron_gpt,llama,llama3-8b")
    p.add_argument("--factors", default="2,4,8")
    p.add_argument("--device", default="h100")
    p.add_argument("--precision", default="bf16-mixed", choices=("fp32", "bf16-mixed"))
    p.add_argument("--size", default="real", choices=("real", "tiny"), help="tiny: a smoke run (no overrides)")
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")
    warnings.filterwarnings("ignore")
    host = this_host()
    rows = []
    for name in args.models.split(","):
        zoo_name, overrides = MODELS[name]
        model, model_args, model_kwargs = build(zoo_name, args.size, device="meta", precision=args.precision,
                                                **(overrides if args.size == "real" else {}))
        params = sum(p.numel() for p in model.parameters())
        state = params * STATE_BYTES_PER_PARAM
        t0 = time.perf_counter()
        prepared = karma_fx.prepare(model, model_args, model_kwargs, device=args.device, name=name)
        capture_s = time.perf_counter() - t0
        for factor in (int(f) for f in args.factors.split(",")):
            budget = state // factor
            t0 = time.perf_counter()
            plan = prepared.plan(budget, raise_if_infeasible=False, offload_weights=True).plan
            plan_s = time.perf_counter() - t0
            bound = physical_bound(prepared.problem, prepared.costs, plan.decisions, host)
            step = plan.step_time_us if plan.fits else None
            floor = "" if step else f"no fit: floor {_floor(prepared) / 2**30:.2f} GiB"
            rows.append([name, f"{params / 1e9:.2f}B", f"{state / 2**30:.1f}", f"{factor}x", f"{budget / 2**30:.2f}",
                         _ms(step), _ms(plan.unlimited_step_time_us),
                         f"{step / plan.unlimited_step_time_us:.3f}x" if step else floor,
                         _ms(bound.compute_us), _ms(bound.link_in_us), _ms(bound.link_out_us), _ms(bound.host_us),
                         bound.bottleneck, f"{step / max(bound.compute_us, bound.link_in_us, bound.link_out_us):.3f}x"
                         if step else "-", f"{plan_s:.0f}"])
            print(f"  {name} at {factor}x: {rows[-1][5]} ms (captured in {capture_s:.0f} s, planned in {plan_s:.0f} s)",
                  flush=True)
    print(f"\n{args.precision} on the {args.device} preset; host: {host.update_params_per_s:.3g} AdamW parameters/s, "
          f"{host.cast_params_per_s:.3g} casts/s on {host.threads} threads (this machine, measured)\n")
    print(tabulate(rows, headers=["model", "params", "state GiB", "state/budget", "budget GiB", "step ms",
                                  "unlimited ms", "slowdown", "compute ms", "weights in ms", "grads out ms",
                                  "host update ms", "bottleneck", "step / device bound", "plan s"]))
    return 0


def _floor(prepared) -> int:
    from karma_fx.strategies.leanest import leanest_peak

    return leanest_peak(prepared.problem, prepared.costs, stream_weights=True)


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:,.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
