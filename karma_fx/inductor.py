"""``compiler="inductor"``: the planned forward and backward graphs compiled by Inductor.

The region goes through ``torch._inductor.compile_fx.compile_fx``, Inductor's own front door, so that
decompositions, joint-graph passes, post-grad passes and code generation are exactly what
``torch.compile(backend="inductor")`` does; only the partitioner is ours (Inductor's ``custom_partitioner_fn``
hook): it plans the decomposed joint graph, rewrites it with the ``karma`` ops and splits it. A plan that
moves nothing hands the joint graph to Inductor's min-cut partitioner, so such a step is Inductor's step.

The ``karma`` ops are custom ops with fake kernels; Inductor runs them as fallback (extern) kernels, in graph
order. Three of Inductor's scheduling passes could undo a plan that moves tensors and are switched off for its
graphs only (``PLAN_SAFE_CONFIG``): ``reorder_for_peak_memory`` reorders nodes by its own memory estimate (it
would move prefetches and recomputes away from the ops the plan anchors them to),
``reorder_for_compute_comm_overlap`` moves collectives and waits, ``reorder_for_locality`` moves producers
next to their consumers. What stays is fusion: a fused kernel runs where the earliest of its members ran,
after all its inputs, which pulls the later member's inputs, extern kernels included, ahead of it; for a
planned graph ``PlanOrder`` refuses a fusion across an extern kernel, so a copy, a wait or a matmul keeps its
place among the ops the plan put around it. No CSE runs after our partitioner (AOT's joint-graph CSE runs
before it, on the unplanned graph), so a recomputed op in the backward stays a separate, short-lived buffer.
The same graphs are compiled without buffer reuse (``PLANNED_CONFIG``). A plan that moves nothing is compiled
with Inductor's own settings, reordering and reuse included: its step is exactly Inductor's (before, with the
reordering off there too, a two-pass residual MLP peaked at 67.05 MiB where Inductor's own step peaks at
64.57 MiB).

Example::

    fn = compile_region(gm, fake_args, partition, on_backward=session.saw_backward)
"""
from __future__ import annotations

import bisect
import collections
import functools
import itertools
import operator
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import karma_fx.runtime  # noqa: F401 - registers torch.ops.karma before Inductor meets them

__all__ = ["COPY_SAFE_CONFIG", "PLAN_SAFE_CONFIG", "PLANNED_CONFIG", "PlanOrder", "compile_region",
           "KeepExcess", "min_cut_excess", "min_cut_partition", "phase_excess"]

PLAN_SAFE_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_locality": False,
}
"""Inductor settings patched for the graphs of a plan that moves tensors (and only for them): no pass may
reorder them."""


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, *, as_written: bool = False,
                      **options: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The partition of a plan that moves nothing. ``as_written``: the step as ``torch.compile(backend=
    "inductor")`` runs it, Inductor's own min-cut partition, whose footprint counts where that peaks above the
    partition planned (``min_cut_excess``). Otherwise (a plan that moves nothing made for a budget the step as
    written does not fit) min-cut only where it peaks no higher than the partition the plan counted, else that
    one (PyTorch's default partition: every forward value the backward reads is saved). Where
    ``passes.narrowing`` saves narrower values, karma's own split of that graph, which is what the plan counted.

    The plan, and the unplanned peak a fractional budget is a fraction of, count the default partition; the
    min-cut partitioner picks what to save by bytes saved, not by peak, and recomputes in the backward what it
    did not save. Usually that peaks lower; where it peaks higher (a two-layer GPT: it saves both embeddings,
    0.5 MiB + 64 KiB, to rebuild their 0.5 MiB sum in the backward, and peaks 52 KB higher), the step would
    run above the plan. Both are compared on Inductor's memory model (``karma_fx.fusion.partition_peaks``); if
    that cannot be built, the min-cut partition is kept."""
    import logging

    from torch._functorch.partitioners import default_partition

    from karma_fx.fusion import partition_peaks

    options.setdefault("compiler", "inductor")
    if as_written:
        return _min_cut(joint, joint_inputs, **options)
    from karma_fx.passes.narrowing import narrow_saved, narrowed
    from karma_fx.passes.partition import split

    num_fwd_outputs = options["num_fwd_outputs"]
    counted = None
    try:  # before min-cut, which replaces the joint's graph by its CSE'd copy
        narrow = narrow_saved(joint, num_fwd_outputs)
        if narrowed(narrow):  # the plan counted the narrower values saved (``passes.narrowing``): run that.
            # Compared with it on the model as Inductor compiles min-cut, min-cut was kept where the two came out
            # equal, and ran at 1,536,304 B over a budget of 1,515,000 (a two-stage CNN)
            return split(narrow, num_fwd_outputs, set())
        counted = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                    static_lifetime_input_indices=options.get("static_lifetime_input_indices"))
    except Exception:  # pragma: no cover - keep Inductor's partition rather than fail the compile
        logging.getLogger("karma_fx").debug("default partition failed; keeping min-cut", exc_info=True)
    fw, bw = _min_cut(joint, joint_inputs, **options)
    if counted is None:
        return fw, bw
    try:
        if not partition_peaks(fw, bw, num_fwd_outputs, as_compiled=True).no_more_than(
                partition_peaks(*counted, num_fwd_outputs, as_compiled=True)):
            return counted
    except Exception:  # pragma: no cover - same
        logging.getLogger("karma_fx").debug("partition peaks not comparable; keeping min-cut", exc_info=True)
    return fw, bw


@dataclass(frozen=True)
class KeepExcess:
    """What Inductor's own partition of a step (min-cut) holds above PyTorch's default partition, which the
    planned problem models (``min_cut_excess``): per phase, the difference of the two partitions' peaks (negative
    where min-cut holds less: it recomputes a GELU's intermediates a decoder's default partition saves, and a
    2-layer GPT-2's step peaked 9% under a model that kept the default partition's peak as the step's); the
    bytes it saves for the backward, exact, less where it saves less."""

    forward: int
    backward: int
    saved: int
    """Bytes saved for the backward, inputs and outputs aside: negative where min-cut saves less."""
    saved_edges: frozenset[tuple[str, int]] = frozenset()
    """Inputs and outputs min-cut saves for the backward, by position (``fusion.PartitionPeaks.saved_edges``):
    counted as held whether or not the default partition saves them."""
    as_written: tuple[tuple[str, bool, int], ...] = ()
    planned: tuple[tuple[str, bool, int], ...] = ()
    """Both partitions' bytes held per op (``fusion.PartitionPeaks.profile``), so that ``phase_excess`` takes
    the difference of their peaks with each op's scratch where the op runs."""
    channels_last: bool = False
    """The step as written runs its convolutions channels-last (Inductor's layout optimization)."""
    scratch: tuple[tuple[str, int], ...] = ()
    """Where it does, its convolutions' scratch measured so (``passes.measure.channels_last_scratch``), in
    place of the traced layout's in the step as written."""
    as_written_released: tuple[tuple[str, bool, int], ...] = ()
    planned_released: tuple[tuple[str, bool, int], ...] = ()
    """``as_written`` and ``planned`` where the caller lets go of the step's outputs before the backward
    (``fusion.PartitionPeaks.released``; empty: as held)."""


def phase_excess(excess: KeepExcess, problem: Any, released: bool = False) -> tuple[int, int]:
    """What to add to the forward and to the backward peak of ``problem`` (the partition planned, as priced: with
    the kernels' measured scratch, which ``partition_peaks`` does not count) for the step as written: per phase,
    the difference of the two partitions' peaks with each op's scratch added where it runs. The peaks may sit
    at different ops: 24 MiB of scratch on a forward matmul put the step as written 9% under it, counted as the
    difference without scratch, and ResNet-50's convolutions (0.14 MiB of scratch each) 12% over it, where the
    step as written peaks at a convolution holding channels-last copies the planned one does not. Without the
    profiles a positive difference is added as it is and a negative one only less the largest scratch of the
    phase (the step as written holds at most min-cut's peak plus that scratch). ``released``: where the caller
    lets go of the step's outputs before the backward (``KeepExcess.as_written_released``)."""
    if released:
        excess = replace(excess, as_written=excess.as_written_released or excess.as_written,
                         planned=excess.planned_released or excess.planned)
    if excess.as_written and excess.planned:
        sizes = {s.name[:-len(":scratch")]: s.size_bytes for s in problem.storages if s.name.endswith(":scratch")}

        written = {**sizes, **dict(excess.scratch)}

        def peak(profile: tuple[tuple[str, bool, int], ...], forward: bool, scratch: dict[str, int]) -> int:
            return max((b + scratch.get(name, 0) for name, fwd, b in profile if fwd == forward), default=0)

        return (peak(excess.as_written, True, written) - peak(excess.planned, True, sizes),
                peak(excess.as_written, False, written) - peak(excess.planned, False, sizes))
    nf = problem.num_fwd_ops
    scratch = [0, 0]
    for s in problem.storages:
        if s.name.endswith(":scratch") and s.producer is not None:
            phase = 0 if s.producer < nf else 1
            scratch[phase] = max(scratch[phase], s.size_bytes)
    return tuple(d if d >= 0 else min(0, d + scratch[k])  # type: ignore[return-value]
                 for k, d in enumerate((excess.forward, excess.backward)))


def min_cut_excess(joint: fx.GraphModule, joint_inputs: Any, **options: Any) -> KeepExcess:
    """What Inductor's own partition of ``joint`` (min-cut) holds above PyTorch's default partition, which the
    planned problem models. The step as written is Inductor's own (``min_cut_partition(as_written=True)``), so
    that at ``budget=1.0`` it is exactly ``torch.compile``'s step (before, the default partition ran wherever
    min-cut peaked higher: a 4-layer d=512 GPT peaked 303 KB lower than ``torch.compile``'s step and ran 2.5%
    slower). Min-cut's is counted as Inductor compiles it with its own settings, writing over saved activations
    the backward is done with (``partition_peaks(as_compiled=True)``: a d=256 decoder with an 8k vocabulary
    writes its logits' gradient over the saved logits, 32 MiB the model held twice, 13% over its peak); the
    default partition as the planned problem counts it (with ``passes.narrowing``'s narrower values saved,
    where the planned problem saves them). Both partitions run on copies of ``joint``, which is left as it is."""
    from torch._functorch.partitioners import default_partition

    from karma_fx.fusion import partition_peaks
    from karma_fx.passes.capture import copy_graph
    from karma_fx.passes.narrowing import narrow_saved, narrowed
    from karma_fx.passes.partition import split

    num_fwd_outputs = options["num_fwd_outputs"]
    options = {**options, "compiler": options.get("compiler", "inductor")}
    narrow = narrow_saved(joint, num_fwd_outputs)
    if narrowed(narrow):  # the planned problem saves the narrower values, as karma's own split does
        default = split(narrow, num_fwd_outputs, set())
    else:
        default = default_partition(copy_graph(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                    static_lifetime_input_indices=options.get("static_lifetime_input_indices"))
    theirs = partition_peaks(*_min_cut(copy_graph(joint), joint_inputs, **options),
                             num_fwd_outputs, as_compiled=True, layout_optimization=True)
    ours = partition_peaks(*default, num_fwd_outputs)
    return KeepExcess(forward=theirs.forward - ours.forward, backward=theirs.backward - ours.backward,
                      saved=theirs.saved - ours.saved, saved_edges=theirs.saved_edges,
                      as_written=theirs.profile, planned=ours.profile, channels_last=theirs.channels_last,
                      as_written_released=theirs.released, planned_released=ours.released)


def _min_cut(joint: fx.GraphModule, joint_inputs: Any, **options: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """PyTorch's min-cut partition of ``joint`` at its default activation memory budget (1.0), whatever the process
    or the model asked for. Karma plans the step's memory itself, and the step as written must be the one its model
    counts: with ``activation_memory_budget`` at 0.3, a two-pass MLP's step as written ran at 37.07 MiB where the
    model said 34.78, over a budget of 36 MiB for three steps, until a measured margin made karma plan. The knob, and
    the per-graph budgets a model can set (``region_activation_memory_budget``), are said to be ignored once per
    process (``passes.torch_partition.min_cut_at``, which ``torch-budget`` asks at the fractions it chooses)."""
    from karma_fx.passes.torch_partition import min_cut_at

    global _knob_said
    fw, bw, asked = min_cut_at(joint, joint_inputs, 1.0, **options)
    if asked and not _knob_said:
        _knob_said = True
        import warnings

        warnings.warn(f"karma_fx: PyTorch's activation memory budget ({asked[0]}: activation_memory_budget or "
                      "region_activation_memory_budget) is not applied to the steps karma_fx compiles: karma plans "
                      "their memory to its own budget (pass budget= instead)")
    return fw, bw


_knob_said = False


def _partitioner(partition: Callable) -> Any:
    """``partition`` as the ``CustomPartitionerFn`` Inductor's config takes. Its ``uuid`` is ``None``: the plan
    depends on the budget and on what the step's other regions hold, which no cache key of Inductor's sees,
    so AOTAutograd's cache must never hand back another plan's graphs (Inductor's per-graph code cache,
    keyed by the rewritten graphs themselves, still works).

    ``release()`` lets go of ``partition`` once the region is compiled (the object and its class hold only a
    key to it).
    Inductor keeps a copy of the first configuration it serialises for the life of the process, this object
    included; ``partition`` closes over the region's first inputs, the parameters among them, so a deleted
    compiled model kept its weights (and, with ``optimizer=``, its optimizer state) until the process ended,
    even after ``torch._dynamo.reset()``."""
    key = next(_partition_keys)
    _partitions[key] = partition
    return _partitioner_class()(key)


_partitions: dict[int, Callable] = {}
"""The partition functions of the regions being compiled, by key: a partitioner holds only its key, because
Inductor copies the configuration it keeps, and a copy of a partitioner holding the function would keep it."""
_partition_keys = itertools.count()


@functools.cache
def _partitioner_class() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class KarmaPartitioner(CustomPartitionerFn):
        def __init__(self, key: int) -> None:
            self.key = key

        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                     ) -> tuple[fx.GraphModule, fx.GraphModule]:
            partition = _partitions.get(self.key)
            if partition is None:  # pragma: no cover - Inductor partitions once, during the compile
                raise RuntimeError("karma_fx: a region's partitioner was called after its compile ended")
            return partition(gm, joint_inputs, **kwargs)

        def release(self) -> None:
            _partitions.pop(self.key, None)

        def uuid(self) -> None:
            return None

    return KarmaPartitioner


def _announcing(code: Any, on_call: Callable[[], None]) -> Callable:
    """A boxed callable running Inductor's compiled ``code`` after ``on_call`` (the session learns that the
    step's backward began)."""

    def run(args: list) -> Any:
        on_call()
        return code(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class PlanOrder:
    """Inductor's fusion choices (the handler it had, ``inner``) with one rule more, for a planned graph: two
    kernels never fuse across an extern kernel (a matmul, an attention, a ``karma`` op) that runs between
    them. A fused kernel runs where its earliest member ran, so Inductor pulls the later member's inputs
    ahead of it, extern kernels included: a recomputed softmax fused with the softmax backward it serves put
    the backward's S×S matmul before the recompute's, and a cpsat step (4-layer GPT with dropout, 0.6 of the
    peak) peaked 3.8% above its plan, past the budget; with the rule, +0.2%, and -4.5% once offloaded values
    kept their traced layout (``passes/rewrite.py``; ``bench/inductor_overhead.py``).
    It also bounds each kernel by a run of loop ops, as ``karma_fx.fusion.outputs_held_through_runs`` counts
    it. The waits that end a recompute chain run with backward loops (``karma_fx.joins``) are no anchors: the
    chain and its joined loops may fuse across them. Every other choice is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._anchors: "weakref.WeakKeyDictionary[Any, tuple[list[int], list[int]]]" = weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if self.crosses_extern(scheduler, node1, node2):
            return False
        return self._inner.can_fuse(scheduler, node1, node2, shared_data_score)

    def crosses_extern(self, scheduler: Any, node1: Any, node2: Any) -> bool:
        """Whether an extern kernel's place in the scheduler's original order lies strictly between the
        earliest and the latest of the two nodes' members (extern kernels never fuse, so their places stay);
        the waits ending a joined run (``_ends_a_joined_run``) count only for a node not of that run."""
        found = self._anchors.get(scheduler)
        if found is None:  # once per graph: this is asked for every candidate pair of a fusion round
            from torch._inductor.scheduler import ExternKernelSchedulerNode

            externs = [n for n in scheduler.nodes if isinstance(n, ExternKernelSchedulerNode)]
            found = (sorted(n.min_order for n in externs if not _ends_a_joined_run(n)),
                     sorted(n.min_order for n in externs if _ends_a_joined_run(n)))
            self._anchors[scheduler] = found
        anchors, joined = found
        low = min(node1.min_order, node2.min_order)
        high = max(node1.max_order, node2.max_order)
        if _any_between(anchors, low, high):
            return True
        return _any_between(joined, low, high) and not (_joined_run(node1) is not None
                                                         and _joined_run(node1) == _joined_run(node2))


def _any_between(places: list[int], low: int, high: int) -> bool:
    i = bisect.bisect_right(places, low)
    return i < len(places) and places[i] < high


def _joined_run(node: Any) -> int | None:
    """The recompute chain whose joined run (``karma_fx.joins``) every op a scheduler node computes belongs to
    (the ops of the graph Inductor lowered, views aside), or ``None``."""
    from karma_fx.passes.rewrite import chain_of

    runs = set()
    members = node.get_nodes() if hasattr(node, "get_nodes") else [node]
    for member in members:
        for origin in getattr(getattr(member, "node", None), "origins", ()) or ():
            if origin.target is operator.getitem or getattr(origin.target, "is_view", False):
                continue
            runs.add(chain_of(origin))
    return runs.pop() if len(runs) == 1 else None


def _ends_a_joined_run(node: Any) -> bool:
    """Whether an extern scheduler node is a ``karma.wait`` pinning a value of a recompute chain run with the
    backward loops that read what it reads (``passes.rewrite``, ``karma_fx.joins``): the run's loops may fuse
    across it, computing their shared work once, and the plan counts the run as one function of loops."""
    from karma_fx.passes.rewrite import JOINED_PIN

    origins = getattr(getattr(node, "node", None), "origins", ()) or ()
    return any(o.meta.get(JOINED_PIN) for o in origins)


PLANNED_CONFIG: dict[str, Any] = {"allow_buffer_reuse": False, "layout_optimization": False}
"""Inductor settings for the graphs of a plan that moves tensors. The plan frees each tensor after its last
reader; Inductor's buffer reuse instead holds a freed buffer until a later allocation of the same size takes
it, wherever its own estimate of the graph's peak allows, and that estimate is not the plan's: on a 4-layer
d=512 GPT (``bench/inductor_overhead.py``) a checkpoint plan's backward held one 8 MiB buffer per layer and
the step peaked 9.8% above the plan (cpsat at 0.75 of the peak: 8.8%, over the budget); with reuse off both
peak at the plan (-0.7%, +0.0%). A plan that moves nothing keeps Inductor's reuse, so that its step stays
exactly Inductor's. The cost: an allocator call per buffer (that checkpoint step
took 1.6% longer on a CPU, within its run-to-run spread). Nor do they get Inductor's layout optimization: for a
graph with convolutions it runs them channels-last and converts each output the plan offloads back to its traced
layout, a second copy of every such tensor that no plan counts (a residual CNN at a 0.6 budget, 2026-12-02: its
planned step peaked 12.45 MiB with it, 8.26 without; ``bench/budget_probes.py``)."""

COPY_SAFE_CONFIG: dict[str, Any] = {"allow_buffer_reuse": False, "inplace_buffers": False}
"""Inductor settings for a graph that swaps tensors out. ``karma.offload`` returns as soon as its copy is
queued; the copy reads the source afterwards (a CUDA side stream, or a CPU copy worker). Inductor only knows
the extern call returned, so it may hand the source's buffer to a later kernel (``buf9 = buf2  # reuse``) or let
the source's last reader write its result in place: either overwrites the tensor while it is being copied, and
the backward then reads garbage (measured: a 2-layer GPT with copies 3 ms late had gradients off by 300%). With
both off, every buffer is freed after its last reader, and a source being copied stays allocated until compute
has waited for its copy (``karma_fx.runtime`` holds it), as the plan counts it."""


def _keeps_buffers_after_calls(graph: fx.GraphModule) -> bool:
    """Whether the graph swaps tensors out, or hands gradients to the gradient pipeline
    (``karma::gradient_ready``): the pipeline keeps a gradient after the call (a bucket, an all-reduce in
    flight), so no later kernel may write its buffer (a bias's gradient the backward read on was overwritten
    in place by the next kernel's result), as with a copy's source."""
    ops = (torch.ops.karma.offload.default, _gradient_ready())
    return any(node.target in ops for node in graph.graph.nodes)


def _gradient_ready() -> Any:
    import karma_fx.exchange  # noqa: F401 - defines karma::gradient_ready

    return torch.ops.karma.gradient_ready.default


def compile_region(gm: fx.GraphModule, example_inputs: list[Any], partition: Callable,
                   on_backward: Callable[[], None], moves: Callable[[], bool] = lambda: False,
                   as_written: Callable[[], bool] = lambda: True) -> Callable:
    """Compile one Dynamo region with Inductor, partitioned (planned and rewritten) by ``partition``.

    ``example_inputs`` are fake tensors (inside a ``TracingContext`` of their fake mode, as at Dynamo's compile
    time). ``gm`` is left untouched (Inductor's pre-grad passes edit the graph they get, and a region is
    compiled once per plan it needs). ``moves``: whether the plan ``partition`` chose moves tensors (asked
    when each graph is compiled, after the partition: its graphs then get ``PLANNED_CONFIG``). ``as_written``:
    whether a plan that moves nothing is the step as written, Inductor's own (asked likewise): only that step
    gets Inductor's layout optimization, which its footprint counts (``min_cut_excess``); another plan that
    moves nothing is priced as the problem counts it, convolutions in their traced layout. Returns the
    callable Dynamo's cached code runs."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        import contextlib

        from torch._inductor.virtualized import V

        planned = moves()
        # the step as written is Inductor's own, compiled with Inductor's own settings
        settings = ({**PLAN_SAFE_CONFIG, **PLANNED_CONFIG} if planned
                    else {} if as_written() else {"layout_optimization": False})
        settings.update(COPY_SAFE_CONFIG if _keeps_buffers_after_calls(graph) else {})
        order = V.set_choices_handler(PlanOrder(V.choices)) if planned else contextlib.nullcontext()
        if kwargs.get("is_backward"):
            _donate_no_shared_storage(inputs)
        with torch._inductor.config.patch(settings), order:
            code = compile_fx_inner(graph, inputs, **kwargs)
        return _announcing(code, on_backward) if kwargs.get("is_backward") else code

    partitioner = _partitioner(partition)
    try:
        return compile_fx(_own_copy(gm), example_inputs, inner_compile=inner,
                          config_patches={"custom_partitioner_fn": partitioner})
    finally:
        partitioner.release()


def _donate_no_shared_storage(inputs: Sequence[Any]) -> None:
    """Take back the donation of every backward input that shares its storage with another input.

    AOTAutograd donates to the backward each saved tensor that aliases no input or output of the step
    (``torch._functorch.config.donated_buffer``), and Inductor may then write a kernel's result over it where
    it dies. It does not check saved tensors against one another: min-cut never saves a tensor beside a view of
    it, but a plan's partition may (a residual sum a recompute rebuilds from, and its 2-D view a weight's
    gradient reads). Inductor then wrote a rebuilt sum over the residual, the view read the new values, and a
    weight's gradient came out 70% off eager's with the loss unchanged. Such inputs are not donated: the
    planned problem never counts a write over a saved tensor anyway (``karma_fx.fusion.written_in_place``)."""
    from karma_fx.passes.liveness import storage_key

    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    donated = getattr(meta, "bw_donated_idxs", None)
    if not donated:
        return
    keys = [storage_key(t) if isinstance(t, torch.Tensor) else None for t in inputs]
    shared = {k for k, n in collections.Counter(k for k in keys if k is not None).items() if n > 1}
    kept = [i for i in donated if i < len(keys) and keys[i] is not None and keys[i] not in shared]
    if len(kept) != len(donated):
        meta.bw_donated_idxs = kept


def _own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo region with a graph of its own, keeping what AOTAutograd reads to know it came from
    Dynamo (where each input comes from, so that parameters are static inputs: without it the partitioner
    saves other tensors and the step is no longer exactly Inductor's)."""
    from karma_fx.passes.capture import copy_graph

    own = copy_graph(gm)
    if hasattr(gm, "_param_name_to_source"):
        own._param_name_to_source = gm._param_name_to_source  # type: ignore[assignment]
    for mine, theirs in zip(own.graph.nodes, gm.graph.nodes):
        if hasattr(theirs, "_dynamo_source"):
            mine._dynamo_source = theirs._dynamo_source  # type: ignore[attr-defined]
    return own
