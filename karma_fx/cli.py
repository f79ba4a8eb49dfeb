"""``karma-fx``: plan a zoo model from the shell, compare strategies, list the zoo.

    karma-fx plan gpt2 --budget 0.7 --plot out/timeline.png
    karma-fx plan cnn --size tiny                          # default budget: one that the model can reach
    karma-fx plan --graph graph.json --budget 0.8          # a node-link training graph, recompute only
    karma-fx compare cnn --size tiny --budgets 0.9,0.8 --time-limit 5
    karma-fx models

A plan shows its progress on stderr (stage, strategy, best plan so far) once it has lasted two seconds, from
the capture to the last strategy; ``-q`` prints only the result, ``-v`` / ``-vv`` the ``karma_fx`` logger's
INFO / DEBUG records instead of the progress line.

Every error a user can fix (a ``KarmaError``: bad budget, infeasible budget, unknown model or strategy) is
printed as one ``karma-fx: error: …`` line with exit status 2, never a traceback; the message already says
what would work (e.g. the smallest feasible budget). Ctrl-C prints one ``karma-fx: interrupted`` line and exits
with 130, the shell's status for SIGINT. Everything that can be checked without the model (budget, device,
output formats) is checked before the slow capture, so a typo costs no wait.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from karma_fx.budget import format_bytes, parse_budget
from karma_fx.errors import KarmaError

PROG = "karma-fx"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT: what shells report for a command stopped by Ctrl-C, so scripts can tell it from a failure."""
AUTO_BUDGET = "auto"
AUTO_FRACTION = 0.5
"""``--budget auto`` (the default): this fraction of the unplanned peak when a plan can reach it, else halfway
from the smallest budget known to work to the unplanned peak. A fixed 0.5 was out of reach for eight of the
eleven tiny zoo models (their weights are most of their peak), so a first ``karma-fx plan cnn --size tiny``
ended in an error."""


class CliError(KarmaError):
    """A command-line request that cannot be honoured (an option that does not apply to the model, …)."""


# ---- argument parsing -------------------------------------------------------------------------------------
def _zoo_names() -> list[str]:
    from karma_fx.zoo import names

    return names()


def _device_names() -> list[str]:
    from karma_fx.device import PRESETS

    return list(PRESETS)


def _time_limit(text: str) -> float:
    """``--time-limit``: a finite number of seconds above 0 (argparse turns the error into a usage line)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return seconds


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """``-q`` / ``-v``: what goes to stderr besides the result and errors."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true",
                       help="print only the result: no progress line, no timings, no log records")
    group.add_argument("-v", "--verbose", action="count", default=0,
                       help="log the karma_fx logger's records to stderr: -v INFO (each planning stage), "
                            "-vv DEBUG")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``plan`` and ``compare``: which model, at which size, on which device, how long."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"zoo model (required; karma-fx models lists them): {', '.join(_zoo_names())}")
    p.add_argument("--size", choices=("tiny", "real"), default=None,
                   help="real: the published architecture, built on the meta device (default); "
                        "tiny: a CPU-sized copy for quick checks")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the zoo's for this size)")
    p.add_argument("--seq", type=int, default=None, help="sequence length, language models only "
                                                          "(default: the zoo's for this size)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers (transformers only)")
    p.add_argument("--costs", choices=("roofline", "measured"), default="roofline",
                   help="roofline: op times from the --device preset (default); measured: the step's ops timed "
                        "here, for real (tiny size: a real-size model is built on meta and cannot run)")
    p.add_argument("--compiler", choices=("eager", "inductor"), default=None,
                   help="what runs the planned step: inductor (fused kernels; default, or $KARMA_COMPILER) or "
                        "eager (op by op): the plan karma_fx.compile(..., compiler=...) makes for the same model and "
                        "budget")
    p.add_argument("--loss-chunk", default="auto",
                   help="the loss head (cross-entropy over the vocabulary): auto (default: chunked where that makes "
                        "the better plan), 0 (as the model computes it) or tokens per chunk")
    p.add_argument("--precision", choices=("fp32", "bf16-mixed", "bf16"), default=None,
                   help="training regime: fp32 (default); bf16-mixed (fp32 weights under bf16 autocast); "
                        "bf16 (bf16 weights)")
    p.add_argument("--device", default="h100",
                   help=f"device preset whose costs and speeds are used (default h100): {', '.join(_device_names())}")
    p.add_argument("--time-limit", type=_time_limit, default=None, metavar="SECONDS",
                   help="wall-clock limit of each planning (the capture excluded): the strategies stop starting "
                        "new work then and return their best plan (default: the strategy's own limits)")
    _add_output_args(p)


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree; separate from ``main`` so docs and tests can inspect it."""
    from karma_fx.strategies import COMPARED, DEFAULT_STRATEGY, STRATEGY_NAMES

    parser = argparse.ArgumentParser(
        prog=PROG, description="Out-of-core training planner for PyTorch: decides per tensor whether to keep, "
                               "offload+prefetch or recompute it under a device-memory budget.")
    from karma_fx import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p_plan = sub.add_parser("plan", help="plan one model at one budget and print the schedule",
                            description="Capture the model's training step, plan it under the budget and print "
                                        "the schedule with the predicted step time and peak.")
    _add_model_args(p_plan)
    p_plan.add_argument("--graph", metavar="FILE",
                        help="plan this networkx node-link training graph (Checkmate/Moccasin format: nodes with "
                             "cost_cpu, cost_ram, backward) instead of a zoo model; recompute only unless "
                             "--allow-offload")
    p_plan.add_argument("--allow-offload", action="store_true",
                        help="with --graph: let the plan offload too, reading cost_cpu as µs and copying over the "
                             "--device's host link")
    p_plan.add_argument("--budget", default=AUTO_BUDGET,
                        help="device-memory budget: a size ('24GiB', '800MB'), a fraction of the unplanned peak "
                             f"('0.5') or '{AUTO_BUDGET}' (the default): {AUTO_FRACTION:g} of the unplanned peak "
                             "when a plan can reach it, else halfway from the smallest workable budget to the "
                             "unplanned peak")
    p_plan.add_argument("--strategy", default=DEFAULT_STRATEGY,
                        help=f"one of {', '.join(STRATEGY_NAMES)} (default {DEFAULT_STRATEGY})")
    p_plan.add_argument("--json", metavar="FILE", help="save the plan as JSON (reload with karma_fx.Plan.load)")
    p_plan.add_argument("--plot", metavar="FILE", help="draw memory and the three streams (.png, .svg, .pdf or "
                                                       "any format matplotlib writes)")
    p_plan.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (.json)")
    p_plan.add_argument("--max-rows", type=int, default=60, help="schedule rows to print (default 60; -1: all)")
    p_plan.add_argument("--offload-weights", action="store_true",
                        help="keep the weights in host memory and stream them through the device (weights out of "
                             "core); gradients go to the host as soon as they exist")
    p_plan.add_argument("--nodes", type=int, default=None,
                        help="predict the data-parallel step on this many nodes (weak scaling: the batch is per GPU)")
    p_plan.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (with --nodes; default 1)")
    p_plan.add_argument("--network-gbps", type=float, default=100.0,
                        help="network bandwidth per node in Gbit/s (with --nodes; default 100, InfiniBand EDR)")
    p_plan.add_argument("--fsdp", action="store_true",
                        help="with --nodes: also predict the step under FSDP2 (fully_shard per block and the root: "
                             "per-block all-gathers prefetched one block ahead, gradients reduce-scattered)")
    p_plan.set_defaults(func=cmd_plan, parser=p_plan)

    p_cmp = sub.add_parser("compare", help="plan every strategy at several budgets and print a grid",
                           description="Capture once, then plan each strategy at each budget. Cells show the "
                                       "slowdown over the unlimited-memory step and the simulated peak.")
    _add_model_args(p_cmp)
    p_cmp.add_argument("--budgets", default="0.7,0.5,0.35,0.25",
                       help="comma-separated budgets, sizes or fractions (default 0.7,0.5,0.35,0.25)")
    p_cmp.add_argument("--strategies", default=",".join(COMPARED),
                       help=f"comma-separated strategies (default: {','.join(COMPARED)}; also: remat)")
    p_cmp.set_defaults(func=cmd_compare, parser=p_cmp)

    p_models = sub.add_parser("models", help="list the model zoo")
    _add_output_args(p_models)
    p_models.set_defaults(func=cmd_models)
    return parser


# ---- shared steps -----------------------------------------------------------------------------------------
def _check_device(name: str) -> str:
    """Resolve the preset now: ``get_device`` raises a plain ``ValueError``, which we turn into a clean error."""
    from karma_fx.device import get_device

    try:
        return get_device(name).name
    except ValueError as exc:
        raise CliError(str(exc)) from None


_MODEL_FLAGS = (("model", "MODEL"), ("size", "--size"), ("batch", "--batch"), ("seq", "--seq"),
                ("layers", "--layers"), ("precision", "--precision"))
_MODEL_DEFAULTS = {"size": "real", "precision": "fp32"}


class _NoModel(CliError):
    """No MODEL named: answered with the command's usage, not by planning some model for minutes."""


def _model_defaults(args: argparse.Namespace) -> None:
    """Fill the model options left out (they default to None so that ``--graph`` can tell them given)."""
    for key, value in _MODEL_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _check_model(args: argparse.Namespace) -> None:
    """Reject an unknown model or a misapplied option before the (slow) import of transformers and capture."""
    from karma_fx.zoo import ZOO

    if args.model is None:
        raise _NoModel(f"name the model to plan: one of {', '.join(ZOO)} (karma-fx models describes them)"
                       + (", or --graph FILE" if args.command == "plan" else ""))
    _model_defaults(args)
    if args.model not in ZOO:
        raise CliError(f"unknown model {args.model!r}; choose one of: {', '.join(ZOO)}")
    entry = ZOO[args.model]
    if args.layers is not None and "layers" not in entry.overrides:
        takers = [n for n, m in ZOO.items() if "layers" in m.overrides]
        raise CliError(f"--layers does not apply to {args.model} (accepted overrides: "
                       f"{', '.join(entry.overrides) or 'none'}); models with layers: {', '.join(takers)}")
    if args.seq is not None and not entry.takes_seq:
        raise CliError(f"--seq does not apply to {args.model}, which takes images")
    for flag in ("batch", "seq", "layers"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise CliError(f"--{flag} must be a positive integer, got {value}")


def _prepare(args: argparse.Namespace) -> Any:
    """Build the zoo model (on meta at real size: no weights are allocated) and capture its training step."""
    import karma_fx
    from karma_fx.zoo import build

    overrides = {"layers": args.layers} if args.layers is not None else {}
    device = "meta" if args.size == "real" else "cpu"
    t0 = time.perf_counter()
    model, model_args, model_kwargs = build(args.model, args.size, batch=args.batch, seq=args.seq, device=device,
                                            precision=args.precision, **overrides)
    build_s = time.perf_counter() - t0
    name = args.model if args.size == "real" else f"{args.model}-tiny"
    if args.precision != "fp32":
        name += f"-{args.precision}"
    prepared = karma_fx.prepare(model, model_args, model_kwargs, device=args.device, name=name, costs=args.costs,
                                compiler=getattr(args, "compiler", None), loss_chunk=_loss_chunk(args))
    prepared.seconds.setdefault("build", build_s)
    return prepared


def _loss_chunk(args: argparse.Namespace) -> int | None:
    """``--loss-chunk`` as ``karma_fx.prepare`` takes it (commands without the flag: the step as the model
    computes it)."""
    value = getattr(args, "loss_chunk", "0")
    if value == "auto":
        # Streamed weights plan the step as written (Prepared.plan takes no chunked twin with them): capturing
        # the twins would only double the capture (Megatron-GPT 1.56B: 23 s of a 105 s plan).
        return 0 if getattr(args, "offload_weights", False) else None
    try:
        chunk = int(value)
    except ValueError:
        chunk = -1
    if chunk < 0:
        raise CliError(f"--loss-chunk must be auto, 0 or a number of tokens per chunk, got {value!r}")
    return chunk


def _check_budget(budget: str) -> None:
    """Validate a budget before the slow capture. A fraction needs the unplanned peak, not known yet, so a
    huge stand-in is used: with 1 every fraction below 1 would round to zero bytes and be refused."""
    if budget != AUTO_BUDGET:
        parse_budget(budget, 1 << 60)


def _resolve_budget(budget: str, prepared: Any) -> tuple[int | str, str]:
    """The budget to plan at (``--budget`` as given, or bytes for ``auto``) and how to show it."""
    if budget != AUTO_BUDGET:
        return budget, budget
    peak, floor = prepared.unplanned_peak_bytes, prepared.min_peak_bytes()
    half = parse_budget(str(AUTO_FRACTION), peak)
    if half >= floor:
        return half, f"{AUTO_BUDGET} ({AUTO_FRACTION:g} of the unplanned peak)"
    if floor >= peak:
        return peak, f"{AUTO_BUDGET} (the unplanned peak: no plan here peaks lower)"
    return (floor + peak + 1) // 2, (f"{AUTO_BUDGET} (halfway from the smallest workable budget, "
                                     f"{format_bytes(floor)}, to the unplanned peak: {AUTO_FRACTION:g} of it is "
                                     "out of reach)")


def _check_plot_path(path: str) -> None:
    """Refuse a ``--plot`` file matplotlib cannot write (or matplotlib missing) before the slow capture, rather
    than after minutes of planning."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError("--plot needs matplotlib, which is not installed: pip install 'karma_fx[plot]'") from None
    supported = sorted(Figure().canvas.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in supported:
        what = f"a .{suffix} file" if suffix else "a file without an extension"
        raise CliError(f"--plot {path}: matplotlib cannot write {what}; end the name with one of "
                       f"{', '.join('.' + s for s in supported)}")


def _write(path: str, what: str, writer: Callable[[Path], None], *, quiet: bool = False) -> None:
    """Create parent folders (``--plot out/x.png`` should just work) and say where the file went (unless
    ``quiet``)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        writer(target)
    except OSError as exc:
        raise CliError(f"cannot write {what} to {path}: {exc.strerror or exc}") from None
    if not quiet:
        print(f"wrote {what}: {target}")


def _seconds(seconds: dict[str, float], keys: Sequence[str]) -> str:
    return ", ".join(f"{k} {seconds[k]:.2f} s" for k in keys if k in seconds)


def _label(args: argparse.Namespace) -> str:
    return args.model if args.size == "real" else f"{args.model}-tiny"


def _progress(args: argparse.Namespace, label: str) -> Any:
    """One progress display from the capture to the last strategy: the library opens one per ``prepare`` and
    none around ``Prepared.plan``, so the strategies (most of a real model's planning) ran silent. Off with
    ``-q``, and with ``-v``, whose log records already say each stage."""
    from karma_fx import progress

    enabled = False if args.quiet or args.verbose else None  # None: on a terminal or with KARMA_PROGRESS=1
    return progress.planning(label, enabled=enabled)


@contextlib.contextmanager
def _logging_to_stderr(verbose: int) -> Any:
    """``-v``: the ``karma_fx`` logger's INFO records on stderr, ``-vv`` its DEBUG ones; undone on the way out,
    as ``main`` may run in-process (tests, notebooks)."""
    if not verbose:
        yield
        return
    logger = logging.getLogger("karma_fx")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s" if verbose == 1
                                           else f"{PROG}: %(levelname)s %(name)s: %(message)s"))
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose == 1 else logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


# ---- commands ---------------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    """``karma-fx plan``: one model, one budget, one strategy; print the schedule and write what was asked."""
    from karma_fx.strategies import STRATEGY_NAMES

    if args.graph is not None:
        return _plan_graph(args)
    if args.allow_offload:
        raise CliError("--allow-offload applies to --graph only (zoo models may always offload)")
    _check_model(args)
    _check_budget(args.budget)
    if args.strategy not in STRATEGY_NAMES:
        raise CliError(f"unknown strategy {args.strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    device_name = _check_device(args.device)
    cluster = _cluster(args)
    if args.plot:
        _check_plot_path(args.plot)
    with _progress(args, _label(args)):
        prepared = _prepare(args)
        budget, shown = _resolve_budget(args.budget, prepared)
        planned = prepared.plan(budget, args.strategy, offload_weights=args.offload_weights,
                                time_limit_s=args.time_limit)
    plan = planned.plan
    max_rows = None if args.max_rows is not None and args.max_rows < 0 else args.max_rows
    where = plan.device if args.costs == "measured" else device_name  # measured costs: this machine, not a preset
    print(f"{args.model} ({args.size}) on {where}, budget {shown} = {format_bytes(plan.budget_bytes)}")
    print()
    print(plan.table(max_rows=max_rows))
    seconds = planned.seconds
    total = sum(seconds.get(k, 0.0) for k in ("build", "capture", "liveness", "costs", "strategy"))
    if not args.quiet:
        print(f"planning took {total:.2f} s: "
              f"{_seconds(seconds, ('build', 'capture', 'liveness', 'costs', 'strategy'))}")
    if cluster is not None:
        _print_data_parallel(cluster, planned)
        if args.fsdp:
            _print_fsdp(cluster, planned)
    _write_outputs(args, planned, plan.device)
    return 0


def _plan_graph(args: argparse.Namespace) -> int:
    """``karma-fx plan --graph FILE``: plan an external node-link graph (no zoo model, no capture)."""
    from karma_fx.external import prepare_graph
    from karma_fx.strategies import STRATEGY_NAMES

    given = [flag for key, flag in _MODEL_FLAGS if getattr(args, key) is not None]
    given += [flag for flag, on in (("--offload-weights", args.offload_weights), ("--nodes", args.nodes is not None),
                                    ("--fsdp", args.fsdp))
              if on]
    if given:
        raise CliError(f"--graph plans the graph in the file: {', '.join(given)} "
                       f"{'does' if len(given) == 1 else 'do'} not apply to it (zoo model options)")
    _check_budget(args.budget)
    if args.strategy not in STRATEGY_NAMES:
        raise CliError(f"unknown strategy {args.strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    if args.strategy == "torch-budget":
        raise CliError("torch-budget needs a captured PyTorch graph; it cannot plan --graph")
    _check_device(args.device)
    if args.plot:
        _check_plot_path(args.plot)
    t0 = time.perf_counter()
    with _progress(args, Path(args.graph).name):
        prepared = prepare_graph(args.graph, device=args.device, allow_offload=args.allow_offload)
        read_s = time.perf_counter() - t0
        budget, shown = _resolve_budget(args.budget, prepared)
        planned = prepared.plan(budget, args.strategy, time_limit_s=args.time_limit)
    plan = planned.plan
    max_rows = None if args.max_rows is not None and args.max_rows < 0 else args.max_rows
    mode = "keep / offload / recompute" if args.allow_offload else "recompute only"
    print(f"{prepared.problem.name} ({args.graph}: {len(prepared.problem.ops)} nodes, {mode}), budget {shown} "
          f"= {format_bytes(plan.budget_bytes)}")
    print()
    print(plan.table(max_rows=max_rows))
    if not args.quiet:
        print(f"planning took {read_s + planned.seconds['strategy']:.2f} s: read {read_s:.2f} s, "
              f"strategy {planned.seconds['strategy']:.2f} s")
    _write_outputs(args, planned, mode)
    return 0


def _write_outputs(args: argparse.Namespace, planned: Any, subtitle: str) -> None:
    """The files ``--json``, ``--plot`` and ``--trace`` ask for (``subtitle`` ends the plot's title)."""
    plan = planned.plan
    if args.json:
        _write(args.json, "plan", plan.save, quiet=args.quiet)
    if args.plot:
        from karma_fx.report import plot_timeline

        title = f"{plan.model} · {plan.strategy} · budget {format_bytes(plan.budget_bytes)} · {subtitle}"
        _write(args.plot, "plot", lambda p: plot_timeline(planned.timeline, p, budget_bytes=plan.budget_bytes,
                                                          title=title), quiet=args.quiet)
    if args.trace:
        from karma_fx.report import write_chrome_trace

        _write(args.trace, "trace", lambda p: write_chrome_trace(planned.timeline, p, name=plan.model),
               quiet=args.quiet)


def _cluster(args: argparse.Namespace) -> Any:
    """The ``Cluster`` of ``--nodes``/``--gpus-per-node``/``--network-gbps``; None without ``--nodes``."""
    from karma_fx.cluster import Cluster
    from karma_fx.errors import KarmaError

    if args.nodes is None:
        if getattr(args, "fsdp", False):
            raise CliError("--fsdp predicts the step on many GPUs: give --nodes (and --gpus-per-node)")
        return None
    try:
        return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, network_gbps=args.network_gbps)
    except KarmaError as e:
        raise CliError(str(e)) from None


def _print_data_parallel(cluster: Any, planned: Any) -> None:
    """The predicted data-parallel step on ``cluster`` (weak scaling)."""
    from karma_fx.cluster import parallel_step, weak_scaling_efficiency

    step = parallel_step(planned.problem, planned.timeline, planned.costs, cluster)
    efficiency = weak_scaling_efficiency(planned.problem, planned.timeline, planned.costs, cluster)
    print(f"data parallel on {cluster.nodes} node(s) x {cluster.gpus_per_node} GPU(s) = {cluster.world_size} GPUs, "
          f"{cluster.network_gbps:g} Gbit/s per node, host optimizer: step {step.step_time_us / 1e3:,.3f} ms, "
          f"weak-scaling efficiency {efficiency:.1%} ({step.buckets} gradient buckets); busy share of the step: "
          f"compute {step.share(step.compute_us):.0%}, copies {step.share(step.copy_us):.0%}, all-reduce "
          f"{step.share(step.allreduce_us):.0%}, host update {step.share(step.host_update_us):.0%}")


def _print_fsdp(cluster: Any, planned: Any) -> None:
    """The predicted FSDP2 step on ``cluster`` (``karma_fx.fsdp``), beside the data-parallel one."""
    from karma_fx.fsdp import fsdp_step, fsdp_units

    step = fsdp_step(planned.problem, planned.timeline, cluster)
    units = fsdp_units(planned.problem)
    print(f"FSDP2 on {cluster.world_size} GPUs ({len(units)} units: {len(units) - 1} blocks and the root; each rank "
          f"holds 1/{cluster.world_size} of the weights): step {step.step_time_us / 1e3:,.3f} ms, "
          f"{step.step_time_us / step.single_step_us - 1:+.1%} over one GPU alone; busy share of the step: compute "
          f"{step.share(step.compute_us):.0%}, all-gather and reduce-scatter {step.share(step.allreduce_us):.0%}")


def _split(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise CliError(f"no {what} given")
    return items


def cmd_compare(args: argparse.Namespace) -> int:
    """``karma-fx compare``: capture once, plan every strategy at every budget, print the grid."""
    from karma_fx.report import compare_table
    from karma_fx.strategies.leanest import LEANEST_SWAPS
    from karma_fx.strategies import STRATEGY_NAMES

    _check_model(args)
    budgets = _split(args.budgets, "budgets")
    for b in budgets:
        _check_budget(b)
    strategies = _split(args.strategies, "strategies")
    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown:
        raise CliError(f"unknown strateg{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}; "
                       f"choose from {', '.join(STRATEGY_NAMES)}")
    device_name = _check_device(args.device)
    rows: list[dict[str, Any]] = []
    per_strategy: dict[str, float] = {}
    with _progress(args, _label(args)):
        prepared = _prepare(args)
        for s in strategies:
            t0 = time.perf_counter()
            for b in budgets:
                budget_bytes = parse_budget(b, prepared.unplanned_peak_bytes)
                row: dict[str, Any] = {"strategy": s, "budget": b, "budget_bytes": budget_bytes}
                try:
                    plan = prepared.plan(b, s, raise_if_infeasible=False, time_limit_s=args.time_limit).plan
                except KarmaError as exc:
                    row.update(fits=False, slowdown=None, peak_bytes=None, error=str(exc))
                else:
                    row.update(fits=plan.fits, slowdown=plan.slowdown, peak_bytes=plan.peak_bytes)
                rows.append(row)
            per_strategy[s] = time.perf_counter() - t0
    keep = prepared.keep
    print(f"{args.model} ({args.size}) on {device_name}: slowdown over the unlimited-memory step / simulated peak "
          "(* fastest that fits)")
    print()
    print(compare_table(rows))
    print()
    print(f"unplanned peak     {format_bytes(prepared.unplanned_peak_bytes)}")
    print(f"unlimited step     {keep.makespan_us / 1e3:,.3f} ms")
    how = ("nothing moved: the step as written" if prepared.floor_as_written() else
           LEANEST_SWAPS if prepared.costs.allow_offload else "the leanest recompute-only plan known")
    print(f"smallest peak      {format_bytes(prepared.min_peak_bytes())} ({how}: the smallest budget known to work)")
    if not args.quiet:
        print(f"capture            {_seconds(prepared.seconds, ('build', 'capture', 'liveness', 'costs'))}")
        print("planning time      " + ", ".join(f"{s} {t:.2f} s" for s, t in per_strategy.items())
              + f" (for {len(budgets)} budget{'s' if len(budgets) != 1 else ''})")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """``karma-fx models``: what can be planned, with the sizes the zoo defaults to."""
    from tabulate import tabulate

    from karma_fx.zoo import ZOO

    body = []
    for m in ZOO.values():
        shape = f"batch {m.default_batch_real}" + (f", seq {m.default_seq_real}" if m.takes_seq else "")
        body.append([m.name, m.description, shape, ", ".join(m.overrides)])
    print(tabulate(body, headers=["model", "description", "real size defaults", "overrides"], tablefmt="simple"))
    return 0


# ---- entry point ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return the exit status (0 ok, 2 usage or planning error, 130 interrupted) instead of
    exiting, so tests and ``python -m karma_fx`` can call it in-process."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # One line, no traceback: the user knows they pressed Ctrl-C; a trace from deep in the solver helps nobody.
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


@contextlib.contextmanager
def _interrupts_held() -> Any:
    """Hold Ctrl-C until the block is over, then raise it. For the import of torch: its C++ side imports NumPy
    and swallows whatever that raises, a KeyboardInterrupt too (a Ctrl-C then was lost, and the CLI planned on
    and exited 0). Only where Python's own handler is in place, in the main thread; elsewhere a no-op."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def _import_the_heavy_modules() -> None:
    """torch and what plans with it, imported up front with Ctrl-C held (see ``_interrupts_held``)."""
    with _interrupts_held():
        import numpy  # noqa: F401
        import torch  # noqa: F401

        import karma_fx.api  # noqa: F401


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _main(argv: list[str] | None) -> int:
    _import_the_heavy_modules()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an argparse usage error (already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        with warnings.catch_warnings(), _logging_to_stderr(getattr(args, "verbose", 0)):
            # PyTorch's own deprecation chatter from tracing internals says nothing the user can act on.
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|copyreg)(\.|$)")
            warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec.*")
            return int(args.func(args))
    except _NoModel as exc:
        args.parser.print_usage(sys.stderr)
        print(f"{args.parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KarmaError as exc:
        print(f"{PROG}: error: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
