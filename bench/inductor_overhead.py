"""karma + Inductor beside plain Inductor: step time when nothing moves, and measured vs predicted peaks.

    python bench/inductor_overhead.py [--models mlp,megatron_gpt,mlp_tiny] [--steps 30] [--budgets 0.9]
    python bench/inductor_overhead.py --predict [--costs measured] [--predict-budgets 0.9,0.8] [--threads 1]
    python bench/inductor_overhead.py --optimizer 0.8 [--models megatron_gpt] [--threads 1]

Time table: per model, a training step (forward, loss, backward, dropped grads) under
``torch.compile(backend="inductor")`` and under ``karma_fx.compile(compiler="inductor")`` with a 1 TiB budget
(a plan that moves nothing: the same generated code where Inductor's min-cut partition peaks no higher than
the plan's partition (mlp), so the overhead is karma's per-call bookkeeping; megatron_gpt gets the plan's
partition, which saves the embeddings' sum rather than both embeddings, so its row also holds that choice).
Variants run interleaved, step by step, so machine drift hits them alike; medians in milliseconds.

Peak table: the allocator-measured peak (``karma_fx.measure_run.AllocatorPeak``, torch.profiler memory
events, a steady-state step) of plain Inductor and of karma + Inductor for each of ``--strategies`` at each
fraction in ``--budgets``, beside the plan's predicted peak. The plan is made on the problem as Inductor allocates it
(``karma_fx.fusion.inductor_problem``: fused pointwise intermediates cost nothing, the addmm rewrite's later
matmul is modelled), a planned step is compiled without Inductor's buffer reuse, and a plan that moves nothing gets Inductor's min-cut partition only where it peaks no higher
than the partition the plan counts, so the measured peak is the prediction and within the budget: megatron_gpt
at 1.0 / 0.9 / 0.8 measured -0.0% / -0.0% / +0.0% of the plan (it was +2.4% / +2.5% / +2.8%, over the
budget at 1.0 and 0.8, before those two changes). Planned steps (``--no-time --models gpt-4x512-nodrop,gpt-4x512
--strategies checkpoint,offload,cpsat --budgets 0.95,0.75,0.6``, 2026-12-01): without dropout every cell
measured -5.0% to +0.0% of its plan once planned graphs were compiled without buffer reuse
(``karma_fx.inductor.PLANNED_CONFIG``; checkpoint was +9.8%, cpsat at 0.75 +8.8% and over the budget); with
dropout, checkpoint -2.3% (was +20.0%) once a run of loop ops counted as one kernel and kernels stopped fusing
across extern kernels (``karma_fx.fusion.outputs_held_through_runs``, ``karma_fx.inductor.PlanOrder``), and
cpsat, which swaps attention inputs out, +0.0% / +0.0% / -4.5% at 0.95 / 0.75 / 0.6 (was +7.5% / +13.6% /
+23.0%, over the budget) once each offloaded value was realised in its traced layout (``passes/rewrite.py``:
Inductor had copied host copies into that layout in the forward, 2 MiB each, while they were being written);
offload -23.2%: the roofline's copies are slower than this CPU's memcpy, so the plan holds each swapped-out
source longer than it lives (with ``costs="measured"`` -2.6%, one-off). Every cell is within its budget.

Optimizer table (``--optimizer B``): a whole step with AdamW, ``torch.compile`` stepping it after backward
beside karma's host AdamW at budget ``B``, compiled by Inductor and op by op (``docs/measurements.md``).

Predict table (``--predict``): the plan's predicted step time against the measured one, nothing moved and at
each ``--predict-budgets`` fraction, each prediction twice from the same op times: as the plan now counts
them (a fused group costs its kernel, ``karma_fx.fusion.kernel_costs``) and replayed on the ops one by one
(as before). On two shared CPU cores, ``--threads 1``, measured costs: megatron_gpt nothing moved predicted
+0% (fused kernels) against +29% (ops one by one); the measured op times themselves varied by +-20% between
compiles there (three repeats each, other load on the machine), which bounds what any row can show. That was
before op timing paused Python's garbage collector after an untimed pass. 2026-12-01, ``--predict --costs
measured --threads 1``, fused kernels against measured: the 4-layer d=512 GPT (``--models gpt-4x512``) nothing
moved -11%, at 0.7 (27 offloads) -13%, where it was -21% / -20% before a fused kernel was costed at least its
slowest member's work (``karma_fx.fusion.kernel_costs``); the ops one by one +14% / +12%; megatron_gpt nothing
moved / at 0.8 +1% / +4% (was +3% / -1%).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import torch
import torch._dynamo
from tabulate import tabulate

import karma_fx
from karma_fx.budget import format_bytes
from karma_fx.errors import InfeasibleBudgetError
from karma_fx.measure_run import measure_step_peak
from karma_fx.zoo import build, output_to_loss

MODELS = {
    "mlp_tiny": lambda: build("mlp", "tiny"),  # a step of microseconds: karma's per-call cost in absolute terms
    "mlp": lambda: build("mlp", "tiny", batch=512, hidden=1024, in_features=512, classes=64),
    "megatron_gpt": lambda: build("megatron_gpt", "tiny", batch=8, seq=128, layers=2, hidden=128, vocab=512,
                                  dropout=0.0),
    # the medium GPT of bench/measured_run.py, with its dropout (0.1) and without, for the peak table
    # (``--no-time --models gpt-4x512,gpt-4x512-nodrop``)
    "gpt-4x512": lambda: build("megatron_gpt", "tiny", batch=2, seq=512, layers=4, hidden=512, heads=8,
                               vocab=2048),
    "gpt-4x512-nodrop": lambda: build("megatron_gpt", "tiny", batch=2, seq=512, layers=4, hidden=512, heads=8,
                                      vocab=2048, dropout=0.0),
}


def _one_step(model: torch.nn.Module, step: Any, args: tuple, kwargs: dict) -> float:
    start = time.perf_counter()
    output_to_loss(step(*args, **kwargs)).backward()
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - start


def time_table(names: list[str], steps: int) -> list[list[str]]:
    rows = []
    for name in names:
        torch._dynamo.reset()
        model, args, kwargs = MODELS[name]()
        other = copy.deepcopy(model)
        variants = {
            "torch.compile inductor": (other, torch.compile(other, backend="inductor", dynamic=False)),
            "karma_fx.compile inductor, 1 TiB": (model, karma_fx.compile(model, budget="1TiB", compiler="inductor")),
        }
        times: dict[str, list[float]] = {label: [] for label in variants}
        for m, step in variants.values():  # compile and warm up
            for _ in range(3):
                _one_step(m, step, args, kwargs)
        for _ in range(steps):
            for label, (m, step) in variants.items():
                times[label].append(_one_step(m, step, args, kwargs))
        median = {label: statistics.median(t) * 1e3 for label, t in times.items()}
        base = median["torch.compile inductor"]
        for label, ms in median.items():
            rows.append([name, label, f"{ms:.3f}", f"{(ms / base - 1) * 100:+.2f}%"])
    return rows


def optimizer_table(names: list[str], steps: int, budget: str) -> list[list[str]]:
    """A whole training step with AdamW (forward, loss, backward, update): ``torch.compile(backend="inductor")``
    with ``optimizer.step()`` after backward, beside ``karma_fx.compile(optimizer=...)`` at ``budget``, whose
    host AdamW steps bucket by bucket while backward runs, its graphs compiled by Inductor (the default) and
    op by op (``compiler="eager"``, the only choice before ``karma::gradient_ready``). Interleaved, medians."""
    import functools

    adamw = functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True)
    rows = []
    for name in names:
        torch._dynamo.reset()
        base, args, kwargs = MODELS[name]()
        other = copy.deepcopy(base)
        ordinary = adamw(other.parameters())
        plain = torch.compile(other, backend="inductor", dynamic=False)

        def plain_step() -> None:
            output_to_loss(plain(*args, **kwargs)).backward()
            ordinary.step()
            ordinary.zero_grad(set_to_none=True)

        variants = {"torch.compile inductor, AdamW after backward": plain_step}
        for compiler in ("inductor", "eager"):
            m = copy.deepcopy(base)
            step = karma_fx.compile(m, budget=budget, compiler=compiler, optimizer=adamw)

            def karma_step(step: Any = step) -> None:
                output_to_loss(step(*args, **kwargs)).backward()
                step.pipeline.wait_updates()

            variants[f"karma {compiler}, host AdamW in backward, budget {budget}"] = karma_step
        times: dict[str, list[float]] = {label: [] for label in variants}
        for run in variants.values():  # compile and warm up
            for _ in range(3):
                run()
        for _ in range(steps):
            for label, run in variants.items():
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)
        base_ms = statistics.median(times["torch.compile inductor, AdamW after backward"]) * 1e3
        for label, t in times.items():
            ms = statistics.median(t) * 1e3
            rows.append([name, label, f"{ms:.3f}", f"{(ms / base_ms - 1) * 100:+.2f}%"])
    return rows


def predict_table(names: list[str], steps: int, budgets: list[float], costs: str) -> list[list[str]]:
    """Predicted (the plan's simulated step) against measured step time of karma + Inductor, nothing moved
    (1 TiB) and at each fraction in ``budgets``, beside plain Inductor's measured step. Each variant is its own
    compiled model; all run interleaved, step by step, so drift hits them alike; medians in ms.

    Two predictions of the same plan from the same op times (measured once per variant): the plan's own,
    with each fused group costing its kernel (``karma_fx.fusion.kernel_costs``), and the same plan replayed on
    the op-by-op times it was given before (how every op was costed before kernel costs), so that the
    comparison holds no timing noise but the step's own."""
    from karma_fx import fusion
    from karma_fx.simulate import simulate

    seen: list[tuple[Any, Any]] = []
    grouped = fusion.kernel_costs

    def recording(problem: Any, op_costs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((problem, op_costs))
        return grouped(problem, op_costs, *args, **kwargs)

    fusion.kernel_costs = recording
    rows = []
    try:
        for name in names:
            torch._dynamo.reset()
            base_model, args, kwargs = MODELS[name]()
            variants: dict[str, tuple[Any, Any]] = {}
            other = copy.deepcopy(base_model)
            variants["torch.compile inductor"] = (other, torch.compile(other, backend="inductor", dynamic=False))
            for budget in ["1TiB", *budgets]:
                m = copy.deepcopy(base_model)
                label = f"karma + inductor, {'nothing moves' if budget == '1TiB' else f'budget {budget}'}"
                variants[label] = (m, karma_fx.compile(m, budget=budget, compiler="inductor", costs=costs))
            times: dict[str, list[float]] = {label: [] for label in variants}
            op_by_op: dict[str, float] = {}
            for label, (m, step) in list(variants.items()):  # compile and warm up
                seen.clear()
                try:
                    for _ in range(3):
                        _one_step(m, step, args, kwargs)
                except InfeasibleBudgetError:
                    del variants[label], times[label]
                    continue
                if seen and len(step.regions) == 1:
                    problem, unfused = seen[-1]
                    op_by_op[label] = simulate(problem, step.plan.decisions, unfused, detail=False).makespan_us
            for _ in range(steps):
                for label, (m, step) in variants.items():
                    times[label].append(_one_step(m, step, args, kwargs))
            for label, (m, step) in variants.items():
                ms = statistics.median(times[label]) * 1e3
                plan = getattr(step, "plan", None)
                cells = []
                for us in (op_by_op.get(label), plan.step_time_us if plan is not None else None):
                    cells += ["", ""] if not us else [f"{us / 1e3:.2f}", f"{(us / 1e3 / ms - 1) * 100:+.0f}%"]
                moved = f"{len(plan.offloads)} off / {len(plan.recomputes)} rec" if plan is not None else ""
                rows.append([name, label, moved, f"{ms:.2f}", *cells])
    finally:
        fusion.kernel_costs = grouped
    return rows


def peak_table(names: list[str], budgets: list[float], strategies: list[str]) -> list[list[str]]:
    rows = []
    for name in names:
        torch._dynamo.reset()
        model, args, kwargs = MODELS[name]()
        plain = torch.compile(model, backend="inductor", dynamic=False)
        for _ in range(2):
            _one_step(model, plain, args, kwargs)
        measured = measure_step_peak(model, plain, args, kwargs, output_to_loss).peak_bytes
        rows.append([name, "torch.compile inductor", "", "", format_bytes(measured), ""])
        for strategy, budget in ((st, b) for st in strategies for b in budgets):
            torch._dynamo.reset()
            model, args, kwargs = MODELS[name]()
            step = karma_fx.compile(model, budget=budget, compiler="inductor", strategy=strategy)
            try:
                for _ in range(2):
                    _one_step(model, step, args, kwargs)
            except InfeasibleBudgetError as exc:
                rows.append([name, f"karma {strategy} + inductor, budget {budget}", format_bytes(exc.budget_bytes),
                             f"infeasible: floor {format_bytes(exc.min_budget_bytes)}", "", ""])
                continue
            measured = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
            plan = step.plan
            predicted = step.predicted_peak_bytes
            budget_bytes = step._session.budget_bytes or 0
            rows.append([name, f"karma {strategy} + inductor, budget {budget}", format_bytes(budget_bytes),
                         format_bytes(predicted), format_bytes(measured),
                         f"{(measured / predicted - 1) * 100:+.1f}%" if predicted else ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,megatron_gpt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--budgets", default="1.0,0.9,0.8", help="fractions of the unplanned peak for the peak table")
    p.add_argument("--strategies", default="cpsat", help="karma strategies of the peak table")
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--no-peak", action="store_true")
    p.add_argument("--predict", action="store_true",
                   help="only the predicted-vs-measured step time table (--costs, --predict-budgets)")
    p.add_argument("--costs", default="measured", help="cost model of the predict table: measured or roofline")
    p.add_argument("--predict-budgets", default="0.8", help="fractions planned in the predict table")
    p.add_argument("--optimizer", default="",
                   help="only the table of a whole step with AdamW, karma's host optimizer at this budget")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); 1 keeps a shared machine's other load from "
                        "stalling OpenMP kernels, which spin for their sibling threads")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = a.models.split(",")
    if a.optimizer:
        print(tabulate(optimizer_table(names, a.steps, a.optimizer),
                       headers=["model", "step", "median ms", "vs torch.compile"], tablefmt="github"))
        return 0
    if a.predict:
        budgets = [float(b) for b in a.predict_budgets.split(",") if b]
        print(tabulate(predict_table(names, a.steps, budgets, a.costs),
                       headers=["model", "step", "plan moves", "measured ms", "predicted, ops one by one",
                                "vs measured", "predicted, fused kernels", "vs measured"],
                       tablefmt="github"))
        return 0
    if not a.no_time:
        print(tabulate(time_table(names, a.steps), headers=["model", "step", "median ms", "vs torch.compile"],
                       tablefmt="github"))
        print()
    if not a.no_peak:
        budgets = [float(b) for b in a.budgets.split(",") if b]
        print(tabulate(peak_table(names, budgets, a.strategies.split(",")), headers=["model", "step", "budget", "predicted peak",
                                                            "measured peak", "measured vs predicted"],
                       tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
