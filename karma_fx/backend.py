"""``torch.compile(model, backend="karma", options={"budget": ...})``: the planner as a Dynamo backend.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so the string ``"karma"``
works with nothing imported first. ``karma_fx.compile`` is built on the same backend, so both doors share
Dynamo's guards (train/eval, grad mode, autocast, ``requires_grad``, parameter identity, input strides and
dtypes: a change recompiles and re-plans) and everything below.

Options (see ``karma_fx.config.OPTIONS``): ``budget`` (bytes, ``"12GiB"`` or a fraction of the unplanned peak;
defaults to ``$KARMA_BUDGET`` where a framework passes no options), ``strategy``, ``device`` (a preset name or
``DeviceSpec`` for the cost model), ``offload_weights``, ``time_limit_s``.

Dynamo hands us one FX graph per compiled region; AOTAutograd traces its joint forward+backward graph and
calls our partitioner. Graph breaks give several regions, and one region may run many times per step (a
block compiled once, run for every layer). Every *run* is accounted for (``karma_fx.regions``): a run is
planned, as it starts, under the budget minus what the step's earlier runs hold, the persistent bytes that
are not its own and the gradients of the runs that follow; a region keeps one compiled variant per plan it
needed. The first step learns the sequence of runs; from the second on, each run also leaves room for the
leanest plans of the runs known to follow, and a budget that cannot work raises ``InfeasibleBudgetError``
naming the total that does.

Dynamic shapes are not supported: a plan is made for concrete sizes. Pass ``dynamic=False`` to
``torch.compile`` so that a new input shape recompiles and re-plans instead.
"""
from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from karma_fx.config import KarmaConfig
from karma_fx.errors import UnsupportedModelError
from karma_fx.passes.capture import _friendly_errors
from karma_fx.passes.partition import make_partition_fn
from karma_fx.passes.rewrite import computed_where_planned, recomputations_end_their_functions
from karma_fx.plan import Plan
from karma_fx.regions import Footprint
from karma_fx.session import Session
from karma_fx.variants import Region, Variant, boundary_of

log = logging.getLogger(__name__)

__all__ = ["KarmaBackend", "Region", "Session", "karma_backend", "regions"]


# ---- Dynamo glue --------------------------------------------------------------------------------------------
def mutated_inputs(gm: fx.GraphModule, example_inputs: list[Any]) -> set[int]:
    """Indices of the graph inputs the region updates in place (BatchNorm running stats, counters).

    Read from the graph signature of a functional export of the region (what ``torch.export`` uses): op
    schemas alone miss BatchNorm, whose ``native_batch_norm`` does not mark its running stats as written. A
    recompute must read a snapshot of such an input, never its updated value."""
    from torch._functorch.aot_autograd import aot_export_module

    _, signature = aot_export_module(gm, list(example_inputs), trace_joint=False)
    position = {name: i for i, name in enumerate(signature.user_inputs)}
    return {position[name] for name in signature.user_inputs_to_mutate.values()}


def _primal_kinds(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Kind and name of every primal AOTAutograd will make: the graph's own parameters and buffers (Dynamo
    without inlined modules), then its inputs: parameters, inputs updated in place (buffers), other inputs."""
    params, buffers = list(dict(gm.named_parameters())), list(dict(gm.named_buffers()))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    mutated = mutated_inputs(gm, example_inputs)
    kinds = ["param"] * len(params) + ["buffer"] * len(buffers)
    for i, t in enumerate(example_inputs):
        kinds.append("param" if isinstance(t, nn.Parameter) else "buffer" if i in mutated else "input")
    names = params + buffers + [placeholders[i] if i < len(placeholders) else f"input[{i}]"
                                for i in range(len(example_inputs))]
    return tuple(kinds), tuple(names)


def _check_static(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        symbolic = isinstance(value, torch.SymInt) or (
            isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape))
        if node.op == "placeholder" and symbolic:
            raise UnsupportedModelError(
                "torch.compile traced this region with dynamic shapes, but a karma plan is made for concrete "
                "sizes: pass dynamic=False to torch.compile, so that a new input shape recompiles and re-plans")


def boxed_graph(gm: fx.GraphModule) -> Any:
    """The graph as a boxed function that clears its argument list on entry, so each input (a saved
    activation in the backward) is freed after its last use rather than at the end of the graph. Without
    this the backward holds every saved tensor to its end (measured: +32% peak on the tiny CNN)."""
    from functorch.compile import make_boxed_func

    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is None:  # older torch: correct, but inputs live until the graph returns
        return make_boxed_func(gm.forward)
    gm.graph.set_codegen(codegen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _break_reason() -> str:
    """Where in the user's code the region being compiled stops, when a graph break stops it: ``file:line
    (reason)``, from Dynamo's own record of why it compiled this graph (private API: "" where it is missing)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        reason = InstructionTranslator.current_tx().output.compile_subgraph_reason
        if not reason.graph_break or not reason.user_stack:
            return ""
        frame = reason.user_stack[-1]
        first = str(reason.reason).strip().splitlines()[0] if str(reason.reason).strip() else ""
        return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" + (f" ({first[:80]})" if first else "")
    except Exception:  # noqa: BLE001 - a message's detail, never worth failing a compile for
        return ""


class _Prepared(Exception):
    """Raised by the partitioner once a twin region is priced (``KarmaBackend._twins``), or once the plan chosen
    is one of the other trace's: the compile that raised it is abandoned."""


class KarmaBackend:
    """A Dynamo backend bound to one ``Session``: returns, per region, a callable that picks (and compiles on
    first need) the variant each run uses."""

    def __init__(self, session: Session) -> None:
        self.session = session
        session.twin_maker = self._twins

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        session = self.session
        _check_static(gm)
        with _friendly_errors("reading the compiled region"):
            kinds, names = _primal_kinds(gm, example_inputs)
        if len(kinds) != len(example_inputs):
            raise UnsupportedModelError("this region holds its parameters as graph attributes; karma_fx needs "
                                        "Dynamo to lift them as inputs (torch._dynamo.config."
                                        "inline_inbuilt_nn_modules=True, the default since torch 2.5)")
        region = Region(index=len(session.regions), gm=gm, kinds=kinds, names=names,
                        offload_weights=session.config.offload_weights, ends_at=_break_reason())
        session.regions.append(region)

        def run(*args: Any) -> Any:
            try:
                return session.run(region, list(args), self._compile)
            except BaseException:  # a budget refused: stop measuring the step (as the front door does)
                session.step_failed()
                raise

        return run

    def _twins(self, region: Region, args: list) -> list[Region]:
        """The region traced with its loss head chunked (``karma_fx.passes.loss_head``) at each of
        ``chunk_sizes`` and priced as the region is, for the session to plan beside it; none where no head was
        recognised. Their variants join the region's, each plan saying which trace it names
        (``Plan.loss_chunk``)."""
        from karma_fx.passes.loss_head import chunk_sizes

        twins: list[Region] = []
        sizes: list[int | None] = [None]
        while sizes:
            twin = Region(index=region.index, gm=region.gm, kinds=region.kinds, names=region.names,
                          offload_weights=region.offload_weights, ends_at=region.ends_at, parent=region)
            try:
                self._compile(twin, None, args, twin_chunk=sizes.pop(0))
            except Exception as exc:  # noqa: BLE001 - an optional trace: the region as written still runs
                log.warning("karma_fx: region %d traced with its loss head chunked failed (%s: %s); it is planned "
                            "with the head as written", region.index, type(exc).__name__, str(exc)[:200])
                break
            if twin.prepared is None or not twin.prepared.loss_chunk:
                break
            if not twins:
                sizes = list(chunk_sizes(twin.prepared.loss_chunk, twin.prepared.tokens)[1:])
            twins.append(twin)
        return twins

    def _compile(self, region: Region, plan: Plan | None, args: list, twin_chunk: int | None = -1) -> Variant:
        """AOTAutograd over the region with our partitioner: plan (first run, ``plan`` None) or apply ``plan``.
        The loss head is traced chunked as ``plan`` says, or on a first run as the configuration says. For
        ``_twins`` (``twin_chunk`` a chunk size, or ``None``: the default one) it is traced chunked and only
        priced, not planned or compiled."""
        from torch._functorch.aot_autograd import aot_module_simplified

        from karma_fx.api import Prepared, timed_as
        from karma_fx.passes.gradient_hooks import insert_gradient_hooks
        from karma_fx.passes.loss_head import ChunkedHead, set_aside
        from karma_fx.passes.partition import hand_over
        from karma_fx.pricing import as_written, price
        from karma_fx.simulate import simulate

        session = self.session
        chosen: dict[str, Any] = {}
        only_price = twin_chunk != -1
        if plan is not None:
            chunk: int | None = plan.loss_chunk
        elif only_price:
            chunk = twin_chunk
        else:
            chunk = session.config.loss_chunk or 0
        head = ChunkedHead(chunk) if chunk != 0 else None

        def plan_fn(problem: Any, step: Any) -> Plan:
            if plan is not None:
                chosen["variant"] = next(v for v in region.variants if v.plan is plan)
                return plan
            if only_price and (head is None or not head.rewritten):
                chosen["no_head"] = True  # nothing was chunked: the trace is the region's own, not a twin
                raise _Prepared
            # The step runs here: priced on this device, on the tensors of this run (``karma_fx.pricing``).
            primals = [a for a in args if isinstance(a, torch.Tensor)]
            started = time.perf_counter()
            with set_aside(head):
                problem, costs, pricing = price(step, problem, session.config.pricing(runs_here=True), primals,
                                                 known=session.measured_ops)
            keep = simulate(problem, (), costs)
            region.boundary = boundary_of(step, problem, region.kinds)
            prepared = Prepared(problem=problem, costs=costs, keep=keep, step=step, pricing=pricing,
                                seconds={"costs": time.perf_counter() - started},
                                loss_chunk=head.chunk if head is not None and head.rewritten else 0,
                                tokens=head.tokens if head is not None else 0)
            with set_aside(head):
                prepared.keep_all_excess = as_written(step, pricing, primals, known=session.measured_ops)
            if only_price:
                region.prepared = prepared
                raise _Prepared
            for twin in region.twins:  # traced first: what they share with this trace costs what it costs here
                if twin.prepared is not None:
                    twin.prepared = timed_as(twin.prepared, prepared)
            variant = session.decide(region, args, prepared)
            if variant.plan.loss_chunk != prepared.loss_chunk:  # a plan of the twin's trace: compile that one
                chosen["other_trace"] = variant
                raise _Prepared
            chosen["variant"] = variant
            return variant.plan

        def on_done(problem: Any, done_plan: Plan, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
            chosen["graphs"] = (fw, bw)
            output = next(n for n in bw.graph.nodes if n.op == "output")
            # the backward's outputs are the primals' gradients, in order: those handed over to the pipeline
            chosen["grad_params"] = tuple(i for i, o in enumerate(output.args[0])
                                          if isinstance(o, fx.Node) and o.target is hand_over)

        pipeline = session.pipeline
        inductor = session.config.compiler == "inductor"
        keep_all: Callable | None = None
        keep_all_excess: Callable | None = None
        if inductor:
            from karma_fx.inductor import min_cut_excess, min_cut_partition

            def inductors_own(*args: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
                # the step as written where the plan is that step and its footprint counts Inductor's own
                # partition; otherwise min-cut only where it holds no more than the partition planned
                variant = chosen.get("variant")
                return min_cut_partition(*args, as_written=variant is not None and variant.inductors_own,
                                         **kwargs)

            keep_all = inductors_own
            # a step handing gradients over is always split as planned (``save_params``): no min-cut to count
            keep_all_excess = min_cut_excess if pipeline is None else None
        planned = make_partition_fn(plan_fn, region.kinds, region.names, on_done,
                                    save_params=pipeline is not None, keep_all=keep_all,
                                    keep_all_excess=keep_all_excess, dropout_backward=not inductor)

        def partition(*args: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            fw, bw = planned(*args, **kwargs)
            if pipeline is not None:  # in the partition, so that Inductor compiles the calls too
                insert_gradient_hooks(bw, pipeline, order_reads=inductor)
            if inductor:  # Inductor computes a pointwise result where it is read: past a prefetch, a recompute
                recomputations_end_their_functions(bw)  # and a recompute's loops end with it
                computed_where_planned(fw)
                computed_where_planned(bw)
            return fw, bw

        def forward_compiler(graph: fx.GraphModule, _: Any) -> Any:
            return boxed_graph(graph)

        def backward_compiler(graph: fx.GraphModule, _: Any) -> Any:
            inner = boxed_graph(graph)

            def backward(boxed_args: list) -> Any:
                session.saw_backward()
                return inner(boxed_args)

            backward._boxed_call = True  # type: ignore[attr-defined]
            return backward

        # Traced on fake copies of the inputs inside a tracing context, as at Dynamo's own compile time: traced
        # on the real tensors, AOTAutograd leaves a dead copy of a forward random op (dropout) in the backward,
        # which would draw from the RNG again.
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
        with _friendly_errors("compiling the region"), torch._guards.tracing(torch._guards.TracingContext(fake_mode)), \
                head if head is not None else contextlib.nullcontext():
            try:
                if inductor:
                    from karma_fx.inductor import compile_region

                    # a graph that hands gradients over is compiled as a planned one (no reordering, no
                    # buffer reuse): no read of a parameter moves past its hand-over, and no buffer the
                    # pipeline holds is written again by a later kernel
                    fn = compile_region(region.gm, fake, partition, on_backward=session.saw_backward,
                                        moves=lambda: pipeline is not None or (
                                            "variant" in chosen and bool(chosen["variant"].plan.decisions
                                                                         or chosen["variant"].plan.splits)),
                                        as_written=lambda: "variant" in chosen and chosen["variant"].inductors_own)
                else:
                    fn = aot_module_simplified(region.gm, fake, fw_compiler=forward_compiler,
                                               bw_compiler=backward_compiler, partition_fn=partition)
            except Exception:  # noqa: BLE001 - Inductor wraps what the partitioner raised
                if not (only_price and (region.prepared is not None or "no_head" in chosen)) \
                        and "other_trace" not in chosen:
                    raise
        if only_price:
            return None  # type: ignore[return-value]
        if "other_trace" in chosen:
            return self._compile(region, chosen["other_trace"].plan, args)
        variant = chosen.get("variant")
        if variant is None:  # inference: the partitioner was never called
            return Variant(plan=Plan("keep", 0), fp=Footprint(0, 0, 0, 0), fn=fn)
        variant.fn, variant.graphs = fn, chosen.get("graphs")
        variant.grad_params = chosen.get("grad_params", ())
        return variant


# ---- the entry point and its registry ---------------------------------------------------------------------
_sessions: "weakref.WeakValueDictionary[int, Session]" = weakref.WeakValueDictionary()
"""Sessions by ``id`` of the options dict. Weak: a session lives as long as the compiled code that uses it
(Dynamo's cache holds the region callables, which hold the session), never longer; an options dict is not
kept alive here (a session keeps a copy of its contents to tell a reused id from the same dict)."""
_contents: "weakref.WeakKeyDictionary[Session, dict]" = weakref.WeakKeyDictionary()


def _session_for(options: dict | None) -> Session:
    config = KarmaConfig.from_options(options)
    key = id(options) if options is not None else 0
    session = _sessions.get(key)
    if session is None or _contents.get(session) != dict(options or {}):
        session = Session(config)
        _sessions[key] = session
        _contents[session] = dict(options or {})
    return session


def karma_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None) -> Any:
    """The Dynamo backend behind ``backend="karma"``."""
    session = _session_for(options)
    backend = KarmaBackend(session)
    return backend(gm, example_inputs)


def regions(options: dict | None) -> list[Region]:
    """What the backend planned for the ``torch.compile`` call given ``options``, in compile order."""
    session = _sessions.get(id(options) if options is not None else 0)
    if session is None or _contents.get(session) != dict(options or {}):
        return []
    return list(session.regions)
