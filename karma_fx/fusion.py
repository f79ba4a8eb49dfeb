"""Fusion-aware memory for ``compiler="inductor"``: the intermediates Inductor never allocates cost nothing.

The planner's ``Problem`` is built from the decomposed joint graph, one storage per tensor an op makes. Run op
by op (``compiler="eager"``) every such tensor is allocated. Inductor instead generates one loop nest per
group of fused nodes: a pointwise or reduction node whose every reader is fused with it is computed in
registers inside the reader's kernel (Inductor inlines it into its readers' loads, or realises it and then
drops it as a kernel-local buffer), so it is never allocated. A plan that counts those tensors budgets memory
Inductor does not use and moves more than it needs to.

``inductor_problem`` gives such storages 0 bytes and leaves everything else (names, producers, readers, op
times) as it was, so every strategy, the lower bound and the simulator count what Inductor allocates without
knowing why, and every decision still names a node of the graph the rewrite edits. A storage is *fused* when

* Inductor inlines the op that makes it (``inlined_ops``: a pointwise op, index load, fill or copy whose
  result Inductor's realise-on-reuse rules do not store; reductions always write a buffer), it is an
  activation or a backward temporary (not a weight, input, tangent or gradient) and the step does not return it;
* it has readers, and every one computes in Inductor's loops (``fusible_ops``), in the same phase as its
  maker: an extern kernel (a matmul, a convolution, a fallback or a ``karma`` op) reads a realised buffer, and
  a forward tensor the backward reads is saved by the partition, so it exists between the two graphs.

A fused value is computed inside each kernel that reads it, so what it is computed from is read there, not
where the graph computed it (``inlined_reads``): a residual block's ReLU mask is inlined into the skip
connection's gradient sum at the block's end, and the block's output stays allocated until then. Counted
where the mask was made, a residual CNN's planned backward held one output more per block than its plan (8.26
MiB measured against 5.26 predicted). Inductor then often writes a kernel's output over such an input, which
dies there, when the sizes match (``written_in_place``: a log-softmax over the logits it reads again). A result
an extern kernel reads only through a reshape Inductor stores by itself (a matmul's 2-D view of a 3-D result,
read by a bias gradient's sum too) is stored as that view, and its other loop readers compute it again
(``computed_again_past_views``; the conditions in ``passes.fusible.inlined_past_views``).

One rewrite moves memory the other way: Inductor's post-grad pass turns ``add(mm(a, b), c)`` into
``addmm(c, a, b)`` where the add was, so ``a`` and ``b`` live until then (``delayed_matmuls``; one matmul an
add).

And a fused kernel allocates every buffer it writes before it runs: Inductor's scheduler fuses the stored
results of neighbouring loop ops into one kernel (an attention's softmax and its dropout: the exponentials,
the random draws and the dropped-out probabilities, three S×S buffers written by one kernel), so none of
them is freed before the last is written. ``loop_runs`` are the ops it may fuse, each run a stretch of loop ops
between two extern kernels in one phase (``karma_fx.inductor.PlanOrder`` keeps Inductor from fusing across
an extern kernel for a planned graph, so a kernel never spans more than a run; a recompute chain joined by
backward loops is one run by design, ``karma_fx.joins``); ``outputs_held_through_runs``
keeps every buffer a run writes alive until the run's last op. A 4-layer d=512 GPT with dropout, on a CPU:
checkpoint and cpsat steps peaked 16% above their plans and cpsat past the budget; with both rules, -2.3% and
+0.2% (-4.5% once offloaded values kept their traced layout: ``bench/inductor_overhead.py``). What a run
reads is freed when its function returns too (``inputs_held_through_runs``): in the step as written all of it
but what Inductor fuses elsewhere, the backward's temporaries in a planned problem.

Fused storages are never candidates to offload or recompute (no backward op reads them); a recompute that
rebuilds a chain rebuilds it in the backward, where Inductor fuses the chain again.

Op times follow the same decisions (``kernel_groups``, ``kernel_costs``): the maker of a fused storage and
its readers run in one kernel, which reads the group's inputs from memory once, writes only the outputs that
are stored, and launches once. The decomposed joint graph Inductor hands the partitioner spells a log-softmax,
a layer norm or a GELU as 5-20 pointwise ops; timed one by one, each reads and writes its whole operand (a
4-layer GPT-medium-width step in bf16 autocast on a calibrated H200 roofline: the decomposed cross-entropy over
a 50304-word vocabulary alone cost 9.6 ms, as three fused kernels 1.6 ms) and pays its own launch (576 ops
where Inductor runs 236 kernels): the roofline predicted 37.9 ms for a step Inductor runs in 12.6 ms (13.3 ms
predicted with kernels), and plans believed their copies hid behind compute that does not exist. A group costs ``max(FLOP time, external bytes / HBM
bandwidth) + one launch`` on the roofline; measured op times (the unfused ops timed one by one) are scaled the
same way. Each member gets a share of its group's time in proportion to its own unfused time, so the times still
sum per op and a recompute of part of a chain costs its part. Not modelled, each only lowering the real peak
below the plan's: in-place writes over a graph input, a saved activation or within one kernel (only one-phase
temporaries are taken, so that no plan moves a buffer holding another value), and a realised buffer that later
fuses away. Not modelled either: the extern kernels'
own scratch (a CPU flash attention's 37 KB row buffers), counted only with ``costs="measured"`` (measured
op by op under eager, where a pointwise op that Inductor fuses may have scratch its fused kernel does not:
an overcount). Inductor's buffer reuse would hold a freed buffer past its last reader: a step that moves
nothing keeps it (Inductor's own estimate keeps it from raising the peak), a planned one is compiled without it
(``karma_fx.inductor.PLANNED_CONFIG``). ``bench/inductor_overhead.py``: the measured peak is the plan's.

``partition_peaks`` puts the same model on an already partitioned step (a forward and a backward graph),
so that two partitions of one joint graph can be compared: ``karma_fx.inductor.min_cut_excess`` counts what
Inductor's own partition (the step as written) holds above the one planned, and ``min_cut_partition`` keeps it
for another plan that moves nothing only where it holds no more.

What Inductor fuses is read from the FX graph by ``karma_fx.passes.fusible``; this module only prices it.

Example::

    graph = step.joint.graph
    problem = inductor_problem(build_problem(step), fusible_ops(graph), inlined_ops(graph))
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Collection, Mapping, Union

import torch
import torch.fx as fx

from karma_fx.passes.fusible import (CONCATENATIONS, SCATTER_OPS, SEEDED_LOOP_OPS, SHAPE_READS, STITCHED_FROM,
                                     addmm_adds, fusible_ops, inlined_ops, inlined_past_views, is_pointwise,
                                     is_reduction, layout_optimized, stitched, with_channels_last_copies,
                                     channels_last_nodes)
from karma_fx.problem import Problem, with_outputs_released

if TYPE_CHECKING:
    from karma_fx.costs import Costs
    from karma_fx.device import DeviceSpec

__all__ = ["computed_again_past_views", "delayed_matmuls", "fused_storages", "generated_reduction_costs",
           "inductor_model", "inductor_problem",
           "inlined_reads", "kernel_costs", "kernel_groups", "loop_ops", "loop_runs", "outputs_held_through_runs",
           "PartitionPeaks", "partition_peaks", "saved_for_shapes_held", "tangents_held", "written_in_place"]

_FUSED_KINDS = ("activation", "temp")


def fused_storages(problem: Problem, fusible: Collection[str], inlined: Collection[str]) -> frozenset[str]:
    """The storages of ``problem`` that Inductor would not allocate (the rule in the module docstring), given
    the names of the ops it computes in fusible loops and of those whose result it inlines into its readers."""
    fusible, inlined = frozenset(fusible), frozenset(inlined)
    run_of = _run_of(problem, fusible)
    fused = set()
    for s in problem.storages:
        if s.kind not in _FUSED_KINDS or s.is_output or s.producer is None or not s.users:
            continue
        maker = problem.ops[s.producer]
        if maker.target in SEEDED_LOOP_OPS:  # a random draw: only in its readers' kernel (``kernel_local_draws``)
            if maker.name in inlined and _read_in_its_run_only(problem, s, run_of, inlined):
                fused.add(s.name)
            continue
        if maker.name not in inlined or maker.name not in fusible or maker.mutates:  # not an addmm's add
            continue
        if all(problem.ops[u].name in fusible and problem.ops[u].phase == maker.phase for u in s.users):
            fused.add(s.name)
    return frozenset(fused)


def _read_in_its_run_only(problem: Problem, s: Any, run_of: Mapping[int, int], inlined: frozenset[str]) -> bool:
    """Whether every kernel that computes the value of ``s`` (a random draw) is in its own run of loop ops: its
    readers, and the readers of any of them Inductor inlines (which compute it again where they are read), up to
    a value another phase reads (saved, so stored where it is made). An input dropout with no mask saved has
    its ``rand > p`` inlined into kernels on both sides of a matmul: Inductor keeps the draw's buffer for them
    (a review's probe, 4 MiB held at the step's peak)."""
    run, phase = run_of.get(s.producer), problem.ops[s.producer].phase
    if run is None or any(problem.ops[u].phase != phase for u in s.users):
        return False
    stack, seen = [s.name], {s.name}
    while stack:
        for u in problem.storage(stack.pop()).users:
            op = problem.ops[u]
            if op.phase != phase:
                continue
            if run_of.get(u) != run:
                return False
            if op.name in inlined:
                stack.extend(o for o in op.outputs if o not in seen)
                seen.update(op.outputs)
    return True


def delayed_matmuls(problem: Problem, adds: Collection[str] | None = None) -> Problem:
    """``problem`` with Inductor's post-grad ``addmm`` rewrite applied: ``add(mm(a, b), c)`` becomes
    ``addmm(c, a, b)`` where the add was, so the matmul runs as late as its addend is ready (a tied weight's
    gradient waits for the embedding's backward at the end of the step) and its inputs live until then. The
    add reads ``a`` and ``b`` too, and the product, written into the add's output, has 0 bytes."""
    delayed: dict[int, tuple[str, ...]] = {}
    gone: set[str] = set()
    for k, a in _addmm_rewrites(problem, adds):
        op, add = problem.ops[k], problem.ops[a]
        delayed[a] = delayed.get(a, ()) + tuple(i for i in op.inputs if i not in add.inputs)
        gone.add(op.outputs[0])
    return _with_more_inputs(problem, delayed, gone)


def _addmm_rewrites(problem: Problem, adds: Collection[str] | None = None) -> list[tuple[int, int]]:
    """(matmul, add) op indices of each ``add(mm(a, b), c)`` Inductor's post-grad pass rewrites to ``addmm``.
    One matmul an add: its patterns try ``add(c, mm(a, b))`` first, so where both addends are matmuls (a weight
    used twice: its two gradients summed) the second becomes the ``addmm`` and the first runs where it is. Both
    delayed, a two-pass residual MLP's planned step held both passes' 4 MiB activations to the add, and its
    plan was predicted at 22.77 MiB where it measured 13.27. ``adds``: the adds the graph shows the pattern
    matches (``passes.fusible.addmm_adds``; ``None``: every add of a sole matmul reader of its size). The
    problem merges a view with what it views, so only the graph tells a matmul read directly from one read as
    a 3-D view, which Inductor does not rewrite: a residual MLP's gradient sums, counted as ``addmm`` outputs
    that freed both matmuls, were inlined into every later kernel, and its step as written ran 5.4% above its
    prediction, past ``budget=1.0``."""
    found = []
    for a, add in enumerate(problem.ops):
        if add.target != "aten.add.Tensor" or len(add.outputs) != 1 or len(add.inputs) != 2 or (
                adds is not None and add.name not in adds):
            continue
        for name in reversed(add.inputs):
            k = problem.storage(name).producer
            if k is not None and _rewritten_into(problem, k, a):
                found.append((k, a))
                break
    return sorted(found)


def _rewritten_into(problem: Problem, k: int, a: int) -> bool:
    """Whether op ``k`` is a matmul whose only reader is the add ``a``, in its phase, of the same size."""
    op, add = problem.ops[k], problem.ops[a]
    if op.target != "aten.mm.default" or len(op.outputs) != 1:
        return False
    out = problem.storage(op.outputs[0])
    return (not out.is_output and out.users == (a,) and add.phase == op.phase
            and problem.storage(add.outputs[0]).size_bytes == out.size_bytes)


def _without_addmm_adds(problem: Problem, fusible: Collection[str], adds: Collection[str] | None = None
                        ) -> frozenset[str]:
    """``fusible`` less the adds Inductor rewrites to ``addmm`` (``delayed_matmuls``): an extern kernel, which
    reads realised buffers, ends a run of loop ops and writes a buffer of its own. Counted as a loop op, a
    tied embedding's gradient sum joined the loop kernel before it (the embedding's scatter and its layer
    norm's backward), whose buffers were then held until it (a BERT step 4.7% over its peak)."""
    return frozenset(fusible) - {problem.ops[a].name for _, a in _addmm_rewrites(problem, adds)}


def loop_runs(problem: Problem, fusible: Collection[str]) -> tuple[tuple[int, ...], ...]:
    """The stretches of ops Inductor may fuse into one kernel: maximal runs of consecutive ops of one phase
    that it computes in its loops (``fusible``, names as ``fusible_ops`` returns them, or one of its seeded
    random draws), between extern kernels. Runs of one op are left out. An op Inductor drops (nothing reads
    it) or moves (a matmul its ``addmm`` rewrite runs at the add) runs no kernel where the graph has it, so
    it does not end a run: counted as an end, a backward's chain of in-place view updates looked like three
    kernels where Inductor wrote one function with four 1 MiB outputs (``tests/test_inductor.py``)."""
    fusible = frozenset(fusible)
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    for k, op in enumerate(problem.ops):
        if current and problem.ops[current[-1]].phase == op.phase and (
                _moved_to_its_add(problem, op) or _is_dead(problem, op)):
            continue
        loop = op.name in fusible or op.target in SEEDED_LOOP_OPS
        if loop and current and problem.ops[current[-1]].phase == op.phase:
            current.append(k)
            continue
        if len(current) > 1:
            runs.append(tuple(current))
        current = [k] if loop else []
    if len(current) > 1:
        runs.append(tuple(current))
    return tuple(runs)


def _run_of(problem: Problem, fusible: Collection[str]) -> dict[int, int]:
    """Op index -> the index of its run of loop ops (``loop_runs``), for the ops in one."""
    return {k: r for r, run in enumerate(loop_runs(problem, fusible)) for k in run}


def loop_ops(problem: Problem, fusible: Collection[str]) -> frozenset[str]:
    """The ops of ``problem`` that take part in a function of loops (``Problem.loop_ops``): those Inductor
    computes in its loops (``fusible``, or a seeded random draw) and those that run no kernel where the graph
    has them (``loop_runs``' dead ops and matmuls moved to their add), which do not end a stretch."""
    fusible = frozenset(fusible)
    return frozenset(op.name for op in problem.ops if op.name in fusible or op.target in SEEDED_LOOP_OPS
                     or _moved_to_its_add(problem, op) or _is_dead(problem, op))


def _is_dead(problem: Problem, op: Any) -> bool:
    """An op nothing reads and the step does not return (an empty buffer functionalization left behind):
    Inductor's dead-code elimination drops it, so it allocates nothing and runs no kernel."""
    return bool(op.outputs) and not op.mutates and not any(
        problem.storage(o).users or problem.storage(o).is_output for o in op.outputs)


def _moved_to_its_add(problem: Problem, op: Any) -> bool:
    """A matmul whose product ``delayed_matmuls`` wrote into its add's output (0 bytes left): Inductor runs it
    as an ``addmm`` where the add is, so where the graph has it no kernel runs."""
    return op.target == "aten.mm.default" and all(problem.storage(o).size_bytes == 0 for o in op.outputs)


def outputs_held_through_runs(problem: Problem, fusible: Collection[str]) -> Problem:
    """``problem`` with each buffer a run of loop ops writes (``loop_runs``; a stored, read result of any of
    its ops but the last) read by the run's last op too, so that it lives until the run ends, as when the run
    is one fused kernel that allocates all its outputs before it runs. A recompute of the run's last op then
    rebuilds those buffers as well, as the fused kernel would. Sizes and names are unchanged."""
    held: dict[int, tuple[str, ...]] = {}
    for run in loop_runs(problem, fusible):
        last = problem.ops[run[-1]]
        seen = set(last.inputs) | set(last.outputs)
        names = []
        for k in run[:-1]:
            for name in problem.ops[k].outputs:
                s = problem.storage(name)
                if name not in seen and s.size_bytes > 0 and s.users:
                    seen.add(name)
                    names.append(name)
        if names:
            held[run[-1]] = tuple(names)
    return _with_more_inputs(problem, held, ())


def _with_more_inputs(problem: Problem, more: dict[int, tuple[str, ...]], emptied: Collection[str]) -> Problem:
    """``problem`` with op ``k`` also reading ``more[k]``, every storage's readers recomputed, and the
    storages in ``emptied`` at 0 bytes."""
    if not more and not emptied:
        return problem
    return _with_ops(problem, [replace(op, inputs=op.inputs + tuple(dict.fromkeys(more[k]))) if k in more else op
                               for k, op in enumerate(problem.ops)], emptied)


def _with_ops(problem: Problem, ops: list[Any], emptied: Collection[str] = ()) -> Problem:
    """``problem`` with ``ops`` (the same ops, reading other storages), every storage's readers recomputed, and
    the storages in ``emptied`` at 0 bytes."""
    ops = tuple(ops)
    readers: dict[str, set[int]] = {}
    for k, op in enumerate(ops):
        for name in op.inputs:
            readers.setdefault(name, set()).add(k)
    emptied = frozenset(emptied)
    storages = tuple(replace(s, users=tuple(sorted(readers.get(s.name, ()))),
                             size_bytes=0 if s.name in emptied else s.size_bytes) for s in problem.storages)
    return replace(problem, ops=ops, storages=storages, _index={}, _op_index={})


def _allocated(problem: Problem, fused: frozenset[str], adds: Collection[str] | None = None) -> Problem:
    """``problem`` with each fused storage (``fused``, as ``fused_storages`` returns them) at 0 bytes and
    Inductor's ``addmm`` rewrite applied."""
    if fused:
        storages = tuple(replace(s, size_bytes=0) if s.name in fused else s for s in problem.storages)
        problem = replace(problem, storages=storages, _index={}, _op_index={})
    return delayed_matmuls(problem, adds)


def computed_again_past_views(problem: Problem, past_views: Mapping[str, Mapping[str, bool]]) -> Problem:
    """``problem`` with each loop op that computes a stored result again inline (``passes.fusible.
    inlined_past_views``: an extern kernel reads it only through a reshape Inductor stores by itself) reading
    what the result is computed from, and the result's storage (the stored reshape) only where it reads that too.
    Not for a result the step returns or saves for another phase: its graph stores it whole."""
    if not past_views:
        return problem
    by_name = {op.name: k for k, op in enumerate(problem.ops)}
    ops = list(problem.ops)
    for name in sorted((n for n in past_views if n in by_name), key=by_name.__getitem__):
        maker = ops[by_name[name]]
        if len(maker.outputs) != 1:
            continue
        stored = problem.storage(maker.outputs[0])
        if stored.is_output or any(problem.ops[u].phase != maker.phase for u in stored.users):
            continue
        for reader, reads_the_view in past_views[name].items():
            k = by_name.get(reader)
            if k is None or ops[k].phase != maker.phase or stored.name not in ops[k].inputs:
                continue
            inputs = [i for i in ops[k].inputs if reads_the_view or i != stored.name]
            inputs += [i for i in maker.inputs if i not in inputs and i not in ops[k].outputs]
            ops[k] = replace(ops[k], inputs=tuple(inputs))
    return _with_ops(problem, ops)


def inlined_reads(problem: Problem, fused: Collection[str]) -> Problem:
    """``problem`` with every reader of a fused storage also reading what that storage is computed from (through
    chains of fused storages): Inductor computes a fused value inside each kernel that reads it, so its
    sources are read there, not where the graph computed it. A residual block's ReLU mask (``le`` of the block's
    output) is inlined into the skip connection's gradient sum at the block's end, and the output it is computed
    from stays allocated until then; counted where the mask was made, each such output looked freed a block
    early (a residual CNN's planned backward held one 1 MiB output more per block than its plan)."""
    fused = frozenset(fused)
    if not fused:
        return problem
    memo: dict[str, tuple[str, ...]] = {}

    def sources(name: str) -> tuple[str, ...]:
        if name not in memo:
            memo[name] = ()  # a cycle cannot occur in a graph; this only stops a malformed one
            maker = problem.ops[problem.storage(name).producer]  # type: ignore[index]
            found: list[str] = []
            for i in maker.inputs:
                found.extend(sources(i) if i in fused else (i,))
            memo[name] = tuple(dict.fromkeys(found))
        return memo[name]

    more: dict[int, tuple[str, ...]] = {}
    for k, op in enumerate(problem.ops):
        extra = [src for i in op.inputs if i in fused for src in sources(i)]
        extra = [e for e in dict.fromkeys(extra) if e not in op.inputs and e not in op.outputs]
        if extra:
            more[k] = tuple(extra)
    return _with_more_inputs(problem, more, ())


def written_in_place(problem: Problem, fusible: Collection[str], saved_too: bool = False,
                     unheld: Problem | None = None) -> Problem:
    """``problem`` with Inductor's in-place writes: a kernel writes its output into an input buffer of the same
    size that dies there (``inplace_buffers``), so the output costs nothing and the input's buffer lives as long
    as the output. Once its readers read what a fused value is computed from (``inlined_reads``), an input often
    dies exactly where such an output is written: a log-softmax's logits, read again by the kernel that writes
    its result, which Inductor writes over them. Only a temporary of one phase is taken (never a saved
    activation, a graph input or an output: those are what plans move, and moving a buffer that holds another
    value would not free it), and only by a loop op of the same phase, from a value made outside its own run of
    loop ops (``loop_runs``): a run is one kernel, and one kernel's outputs do not overwrite each other. A
    scatter (``SCATTER_OPS``) is written only over the tensor it scatters into, its first input: its values and
    indices are read at positions it does not write in order. Written over the values (a matmul's output, in a
    backward that scatters it into a zero fill), the values' buffer looked freed a kernel early (11% under a
    step's peak).

    Not exact for a graph that swaps tensors out: Inductor compiles it without in-place buffers
    (``karma_fx.inductor.COPY_SAFE_CONFIG``), so under a plan that offloads in the forward, a forward write
    counted here as in place is a buffer of its own (the problem is built before any plan, so it cannot tell);
    the probes that offload held within their budgets (``bench/budget_probes.py``), but this is a known gap.

    ``saved_too``: a saved activation the backward reads for the last time may be written over as well, as in
    a step Inductor compiles with its own settings (the step as written, ``partition_peaks(as_compiled=True)``):
    the backward frees its inputs as it goes, and a decoder's logits gradient is written over the saved logits
    (``buf1 = mm; del mm  # reuse``). Not in a planned problem: a saved activation a plan offloads comes back in
    a buffer Inductor did not allocate (``karma.prefetch``'s), which it never writes over. Counted in place there
    too, a 4-layer d=512 GPT's plan at 0.5 of its peak ran 1.4% above it (a 2 MiB reload); a plan of which saved
    activations it offloads decides which writes happen, and the problem is built before any plan.

    With ``saved_too`` also, in the forward, within one run, a result written over an input made earlier in the run
    that the result's op (a pointwise one) reads for the last time (``unheld``: the problem before
    ``outputs_held_through_runs`` made the run's last op read every output of the run), and in the forward a saved
    activation written over a temporary: Inductor decides in-place writes op by op inside a fused kernel, and lets a
    graph's output take a dying buffer (a GPT's softmax, saved, written over its exponentials: ``buf52 = buf49; del
    buf49  # reuse``; counted as two 16 MiB buffers, the step as written at S=512 was predicted 10% above its peak).
    Not in a planned problem, for the reasons above. Nor in the backward: allowed there too, a two-stage CNN's step
    as written was predicted 32% under its peak.
    """
    fusible = frozenset(fusible)
    nf = problem.num_fwd_ops
    run_of = _run_of(problem, fusible)
    holder: dict[str, str] = {}
    readers = {s.name: list(s.users) for s in problem.storages}
    last_read = {s.name: max(s.users, default=-1) for s in (unheld or problem).storages}
    sizes = {s.name: s.size_bytes for s in problem.storages}

    def one_phase_temp(name: str, phase: str) -> bool:
        s = problem.storage(name)
        return (s.kind in _FUSED_KINDS and not s.is_output and s.producer is not None
                and problem.ops[s.producer].phase == phase and all(problem.ops[u].phase == phase for u in s.users))

    def free_to_write_into(name: str, phase: str) -> bool:
        s = problem.storage(name)
        return one_phase_temp(name, phase) or (
            saved_too and phase == "fwd" and s.kind == "activation" and not s.is_output and s.producer is not None
            and s.producer < nf)

    def free_to_write_over(name: str, phase: str) -> bool:
        s = problem.storage(name)
        return one_phase_temp(name, phase) or (
            saved_too and phase == "bwd" and s.kind in _FUSED_KINDS and not s.is_output and s.producer is not None
            and s.producer < nf and any(u >= nf for u in readers[name]))  # (a temporary holding a saved value too)

    emptied: set[str] = set()
    for k, op in enumerate(problem.ops):
        if op.name not in fusible or op.mutates or op.target in CONCATENATIONS:  # a buffer of its own, made first
            continue
        taken: set[str] = set()
        for out in op.outputs:
            if sizes[out] == 0 or not free_to_write_into(out, op.phase):
                continue
            for name in op.inputs[:1] if op.target in SCATTER_OPS else op.inputs:
                h = holder.get(name, name)
                made_by = problem.storage(name).producer
                same_run = made_by is not None and k in run_of and run_of.get(made_by) == run_of[k]
                if same_run and not (saved_too and op.phase == "fwd" and h == name and last_read[name] == k
                                     and is_pointwise(op.target)):
                    continue
                if (h in taken or not free_to_write_over(name, op.phase) or not free_to_write_over(h, op.phase)
                        or sizes[h] != sizes[out] or (max(readers[h], default=-1) != k and not same_run)):
                    continue
                taken.add(h)
                holder[out] = h
                readers[h] = sorted(set(readers[h]) | set(readers[out]))
                emptied.add(out)
                break
    if not emptied:
        return problem
    more: dict[int, list[str]] = {}
    for out, h in holder.items():
        for u in problem.storage(out).users:
            more.setdefault(u, []).append(h)
    return _with_more_inputs(problem, {k: tuple(v) for k, v in more.items()}, emptied)


def inductor_problem(problem: Problem, fusible: Collection[str], inlined: Collection[str], *,
                     saved_in_place: bool = False, past_views: Mapping[str, Mapping[str, bool]] | None = None,
                     addmm_adds: Collection[str] | None = None) -> Problem:
    """``problem`` as Inductor allocates it: each fused storage (``fused_storages``) has 0 bytes and its readers
    read what it is computed from (``inlined_reads``), the matmuls of ``addmm`` rewrites run late
    (``delayed_matmuls``), what a run of loop ops writes lives until the run ends
    (``outputs_held_through_runs``), and a temporary written over a dying input of its size costs nothing
    (``written_in_place``; ``saved_in_place``: a saved activation too, as in a step compiled with Inductor's
    own settings), and what a run reads lives until it ends too (``inputs_held_through_runs``: everything in
    the step as written, ``saved_in_place``; the backward's temporaries otherwise). Names and ops are unchanged
    (some ops read more, some storages are 0 bytes), so plans made on it apply to the graph ``problem`` was
    built from. ``addmm_adds``: the adds Inductor rewrites with a matmul (``_addmm_rewrites``)."""
    fusible = _without_addmm_adds(problem, fusible, addmm_adds)
    fused = fused_storages(problem, fusible, inlined) | {o for op in problem.ops if _is_dead(problem, op)
                                                           for o in op.outputs}
    allocated = computed_again_past_views(_allocated(problem, fused, addmm_adds), past_views or {})
    return replace(_as_kernels_hold_it(allocated, fused, fusible, saved_in_place), fused_kernels=True)


def _as_kernels_hold_it(allocated: Problem, fused: frozenset[str], fusible: Collection[str],
                        saved_in_place: bool = False) -> Problem:
    """``allocated`` (fused storages at 0 bytes) with the lifetimes Inductor's kernels give: sources read where
    a fused value is inlined, a run's outputs held to its end, buffers written over (a buffer written over lives
    as long as what was written into it), and, last, what a run reads held to its end."""
    inlined = inlined_reads(allocated, fused)
    held = outputs_held_through_runs(inlined, fusible)
    written = written_in_place(tangents_held(saved_for_shapes_held(held)), fusible, saved_in_place, unheld=inlined)
    kept = inputs_held_through_runs(written, fusible, inlined, backward_only=not saved_in_place)
    by_runs = frozenset((after.name, name) for before, after in zip(inlined.ops, held.ops)
                        for name in set(after.inputs) - set(before.inputs))
    return replace(kept, loop_ops=loop_ops(kept, fusible), held_by_runs=by_runs)


def inputs_held_through_runs(problem: Problem, fusible: Collection[str], links: Problem, *,
                             backward_only: bool = False) -> Problem:
    """``problem`` with every buffer a run of loop ops reads from outside the run read by the run's last op too:
    Inductor writes a run as one function on a CPU and frees what it read only after the function returns
    (``del buf0`` after the call), so a value read by the run's first op is still allocated while its last op
    writes. A backward that scatters a matmul's output into a zero fill and then writes two more 256 KiB
    buffers in the same function held all three with the matmul's output; freed at its last reader, the step
    as written was predicted 11% under its measured peak.

    Except what an op of the run reads that links it to no other op of the run and that an earlier loop op of
    its phase read too: Inductor's scheduler fuses such an op with that earlier reader (they share a read), so
    it runs there, not in the run. A ResNet's forward ends with a run of batch-norm subtractions of different
    convolutions' outputs, each saved for the backward; held as one function, ResNet-1001's step as written (tiny)
    was predicted at 4.81 MB, 0.79 MB above the same model without this rule and 33% above the allocator's peak.

    ``backward_only`` (a planned problem): only the backward's runs, and what they read of its temporaries, and
    the saved activations a scatter of the run reads. Held only to its last reader, a max pooling's saved offsets
    were freed at the scatter that reads them, inside the function that then writes the ReLU mask's gradient,
    and a CNN's plan ran 1.6% over its budget. Other saved activations are not held: a plan may put a
    recomputation or a prefetch inside a run, which ends the function there (``passes.rewrite`` pins it), and
    every saved activation held to its run's end put the in-place-views probe's step as written 6.5% above its
    measured peak. A forward run is left as it is, since a recompute of its last op would then need everything the
    run read (no plan recomputes a backward op); the simulator holds a forward temporary to the end of the function
    that reads it, where the plan's copy ops cut the run (``simulate._forward_function_ends``). Without it, the
    scattering model's plan at 0.9 was predicted 10% under its measured peak, past its budget; with it, a temporary
    read before a recomputation placed inside a function is counted to the function's end (a 2-layer GPT with
    dropout, checkpointed at 0.9: a 128 KiB matmul output; its plans 5-8% above their measured peaks, where they
    were 4%).
    ``links``: the same ops with only what each reads for its values (before ``outputs_held_through_runs``, whose
    reads link every op of a run to its last), for the links and the earlier readers; what is held is read off
    ``problem``, where a value written over another buffer is read through that buffer."""
    fusible = frozenset(fusible)
    held: dict[int, tuple[str, ...]] = {}
    for run in loop_runs(problem, fusible):
        if backward_only and problem.ops[run[0]].phase != "bwd":
            continue
        made = {o: k for k in run for o in links.ops[k].outputs}
        linked = {k for k in run for name in links.ops[k].inputs if name in made} | {
            made[name] for k in run for name in links.ops[k].inputs if name in made}
        last = problem.ops[run[-1]]
        names = []
        for k in run[:-1]:
            reads = [name for name in problem.ops[k].inputs if problem.storage(name).size_bytes > 0]
            if k not in linked and reads and all(_read_earlier_in_loops(links, name, k, fusible) for name in reads):
                continue
            scatter = problem.ops[k].target in SCATTER_OPS
            names.extend(name for name in reads if name not in made and name not in last.inputs
                         and not (backward_only and problem.storage(name).kind != "temp"
                                  and not (scatter and problem.storage(name).kind == "activation")))
        if names:
            held[run[-1]] = tuple(dict.fromkeys(names))
    return _with_more_inputs(problem, held, ())


def _read_earlier_in_loops(problem: Problem, name: str, k: int, fusible: frozenset[str]) -> bool:
    """Whether a loop op of op ``k``'s phase reads storage ``name`` before ``k`` does."""
    phase = problem.ops[k].phase
    return any(u < k and problem.ops[u].phase == phase and problem.ops[u].name in fusible
               for u in problem.storage(name).users)


TANGENTS_HELD_TO_THE_END: bool = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
"""Whether AOTAutograd keeps the backward's tangents until the backward graph returns (torch before 2.13; 2.13
frees each after its last reader). Measured on a small GPT-2 returning its logits beside the loss: the logits'
tangent (zeros, made for the unused output) was held to the end on torch 2.9 (CPU, 3.0% of the peak) and
2.11 (an H200, 16%), freed at its last read on 2.13."""


def tangents_held(problem: Problem) -> Problem:
    """``problem`` with every tangent read by the backward's last op too, where the torch running the step holds
    them that long (``TANGENTS_HELD_TO_THE_END``)."""
    nf, last = problem.num_fwd_ops, len(problem.ops) - 1
    if not TANGENTS_HELD_TO_THE_END or last < nf:
        return problem
    tangents = tuple(s.name for s in problem.storages if s.kind == "tangent" and s.size_bytes and s.users
                     and last not in s.users)
    return _with_more_inputs(problem, {last: tangents} if tangents else {}, ())


def saved_for_shapes_held(problem: Problem) -> Problem:
    """``problem`` with each saved activation that the backward reads for its sizes only (``SHAPE_READS``) read
    by the backward's last op too. Inductor frees an input of the backward graph after the last kernel that
    reads it; a tensor no kernel reads is never freed and lives until the backward returns. A DenseNet-style
    CNN's transition convolution output (1 MiB, the input of its average pooling) was counted as freed at the
    pooling's backward: its planned Inductor steps peaked 1 MiB above their plans, 3.9% over the budget at 0.6
    (``bench/budget_probes.py``) until a measured step taught the session a margin."""
    nf, last = problem.num_fwd_ops, len(problem.ops) - 1
    if last < nf:
        return problem
    held = []
    for s in problem.storages:
        if s.kind != "activation" or s.is_output or s.producer is None or s.producer >= nf:
            continue
        readers = [k for k in s.users if k >= nf]
        if readers and last not in readers and all(
                problem.ops[k].target in SHAPE_READS
                and problem.ops[k].inputs.index(s.name) == SHAPE_READS[problem.ops[k].target] for k in readers):
            held.append(s.name)
    return _with_more_inputs(problem, {last: tuple(held)} if held else {}, ())


def kernel_groups(problem: Problem, fused: Collection[str]) -> tuple[tuple[int, ...], ...]:
    """The ops of ``problem`` grouped by the kernel Inductor runs them in, given its fused storages (``fused``:
    names, as ``fused_storages`` returns them): a fused storage is computed in registers inside its readers'
    kernels, so its maker and every reader are one group (transitively: a chain of fused pointwise ops ending
    in a reduction is one kernel). Every op is in exactly one group (most alone); groups are in the order of
    their first op, each sorted. A stored result separates kernels, as Inductor's buffers do."""
    parent = list(range(len(problem.ops)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for name in fused:
        if not problem.has_storage(name):
            continue
        s = problem.storage(name)
        if s.producer is None:
            continue
        for u in s.users:
            a, b = root(s.producer), root(u)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for k in range(len(problem.ops)):
        groups.setdefault(root(k), []).append(k)
    return tuple(tuple(g) for g in sorted(groups.values()))


def _group_bytes(problem: Problem, group: tuple[int, ...], fused: frozenset[str]) -> int:
    """Bytes one fused kernel moves: each storage its members read that none of them makes, once, and each
    stored (not fused) output they write; never more than the members move one by one (a member reading a
    slice of a large storage reads the slice, not the storage)."""
    members = set(group)
    read: set[str] = set()
    written = 0
    for k in group:
        op = problem.ops[k]
        for name in op.inputs:
            s = problem.storage(name)
            if name not in fused and (s.producer is None or s.producer not in members):
                read.add(name)
        written += sum(problem.storage(o).size_bytes for o in op.outputs
                       if o not in fused and not o.endswith(":scratch"))
    external = written + sum(problem.storage(name).size_bytes for name in read)
    return min(external, sum(problem.ops[k].bytes_accessed for k in group))


def kernel_costs(problem: Problem, costs: "Costs", fused: Collection[str],
                 device: Union["DeviceSpec", str, None] = None, *, measured: bool = False) -> "Costs":
    """``costs`` with each fused group's ops (``kernel_groups``) costing their kernel's time, shared among the
    members in proportion to their own times; ops alone in their group keep their time exactly.

    Roofline (``measured=False``, ``device`` the preset or spec ``costs`` was estimated for): a kernel costs one
    launch plus ``max(FLOP time of its members, external bytes / HBM bandwidth)`` (``_group_bytes``).

    Measured (``costs`` holds the unfused ops timed one by one on the device at hand, eager kernels or the CPU
    ops): each member's time less a launch (the 10th percentile of the step's non-zero op times, never more
    than the member's own) is its work; the kernel's work is the members' work scaled by the group's bytes over
    the bytes the members move one by one (pointwise and reduction ops are memory-bound: their time is their
    traffic), but never less than its slowest member's work (the kernel still does that member's arithmetic,
    which on a CPU core, an ``exp`` or an ``erf`` per element, outlasts its traffic), plus one launch. Without
    that floor a 4-layer d=512 GPT under Inductor on one CPU thread was predicted 21% faster than it ran, with
    it 11% (``bench/inductor_overhead.py --predict``); a 2-layer d=128 GPT stayed within 4%."""
    from karma_fx.device import get_device

    fused = frozenset(fused)
    groups = [g for g in kernel_groups(problem, fused) if len(g) > 1]
    if not groups:
        return costs
    times = list(costs.op_time_us)
    if measured:
        launch = _launch_us(times)
    else:
        spec = get_device(device)
    for group in groups:
        unfused = [times[k] for k in group]
        total = math.fsum(unfused)
        if total <= 0:
            continue
        moved = sum(problem.ops[k].bytes_accessed for k in group)
        external = _group_bytes(problem, group, fused)
        if measured:
            overhead = min(launch, min(unfused))
            work = [t - overhead for t in unfused]
            kernel = overhead + max(max(work), math.fsum(work) * (external / moved if moved else 1.0))
        else:
            compute_s = math.fsum(problem.ops[k].flops / (spec.flops_for(problem.ops[k].dtype) * spec.efficiency)
                                  for k in group)
            kernel = spec.kernel_overhead_us + 1e6 * max(compute_s, external / spec.hbm_bytes_per_s)
        kernel = min(kernel, total)  # fusing never makes a chain slower than its ops one by one
        for k, t in zip(group, unfused):
            times[k] = kernel * t / total
    return replace(costs, op_time_us=tuple(times))


def _launch_us(times: Collection[float]) -> float:
    """What one measured kernel costs beyond its work: the 10th percentile of the step's non-zero op times."""
    positive = sorted(t for t in times if t > 0)
    return positive[len(positive) // 10] if positive else 0.0


def generated_reduction_costs(problem: Problem, costs: "Costs", fusible: Collection[str]) -> "Costs":
    """Measured ``costs`` with each reduction Inductor computes in its own loops priced at the step's elementwise
    rate: its bytes over the median rate (bytes per µs of work) of the step's measured pointwise loop ops, where
    that is below its measured time.

    Why: the measured times are the ops run one by one, eager kernels, and Inductor does not run a reduction's
    eager kernel but loops it generates, as memory-bound as a pointwise op's. On a CPU ATen's ``var_mean`` over
    the last dimension is 25x slower than that: 2.16 ms against Inductor's 87 µs on a 1 MiB input, one thread,
    where a 1 MiB ``mul`` takes 98 µs. A layer norm recomputed was then priced as a matmul, and plans rebuilt
    matmuls where PyTorch's partitioner rebuilds the norm (a two-pass MLP 7-10% slower than PyTorch's step at
    its peak); the unplanned step was predicted 21% slower than it ran. A reduction that really is that slow
    per byte where Inductor compiles it (an eager GPU kernel near the memory's bandwidth) is left as it is."""
    times = list(costs.op_time_us)
    launch = _launch_us(times)
    fusible = frozenset(fusible)
    rates = sorted(op.bytes_accessed / (times[k] - launch) for k, op in enumerate(problem.ops)
                   if op.name in fusible and not is_reduction(op.target) and op.bytes_accessed > 0
                   and times[k] > launch)
    if not rates:
        return costs
    rate = rates[len(rates) // 2]
    for k, op in enumerate(problem.ops):
        if op.name in fusible and is_reduction(op.target) and op.bytes_accessed > 0:
            overhead = min(launch, times[k])
            times[k] = overhead + min(times[k] - overhead, op.bytes_accessed / rate)
    return replace(costs, op_time_us=tuple(times))


def inductor_model(problem: Problem, costs: "Costs", fusible: Collection[str], inlined: Collection[str],
                   device: Union["DeviceSpec", str, None] = None, *, measured: bool = False,
                   past_views: Mapping[str, Mapping[str, bool]] | None = None,
                   addmm_adds: Collection[str] | None = None) -> tuple[Problem, "Costs"]:
    """The problem and costs of a step Inductor compiles: memory as it allocates it (``inductor_problem``) and
    time as it runs the kernels (``kernel_costs``), both from the same fusion decisions. ``costs`` are those
    of the unfused ops of ``problem`` (a roofline on ``device``, or ``measured``)."""
    if measured:
        costs = generated_reduction_costs(problem, costs, fusible)
    fusible = _without_addmm_adds(problem, fusible, addmm_adds)
    fused = fused_storages(problem, fusible, inlined)
    allocated = _allocated(problem, fused, addmm_adds)
    # costed before the runs' held outputs are added as reads: a kernel reads its inputs, not those
    timed = kernel_costs(allocated, costs, fused, device, measured=measured)
    held = _as_kernels_hold_it(computed_again_past_views(allocated, past_views or {}), fused, fusible)
    return replace(held, fused_kernels=True), timed


@dataclass(frozen=True)
class PartitionPeaks:
    """What a partition of a training step into forward and backward graphs holds, nothing moved, as Inductor
    allocates it (``partition_peaks``). Only differences between partitions of one joint graph mean anything:
    every placeholder counts as held all step."""

    forward: int
    backward: int
    saved: int
    """Bytes the forward saves for the backward, the step's inputs and outputs aside (weights and inputs are
    held anyway, views of them included; its outputs are the caller's)."""
    saved_edges: frozenset[tuple[str, int]]
    """The placeholders (inputs, weights: ``("input", position)``) and the step's outputs (``("output",
    position)`` among the forward's first outputs) the forward saves for the backward, directly or through a
    view: in a step of several regions they live on to the backward too. By position, not name: the graph a
    plan counts may name them otherwise (a dropout split, ``passes.dropout``)."""

    profile: tuple[tuple[str, bool, int], ...] = ()
    """Per op in the order run: (the name of the op it is, in the forward, bytes held while it runs, kernel
    scratch aside), so that the peaks can be taken with the scratch measured later (``inductor.phase_excess``).
    A backward op the partitioner recomputes is named as the op it copies."""
    channels_last: bool = False
    """Counted with Inductor's layout optimization (``layout_optimization`` and a forward it applies to)."""
    released: tuple[tuple[str, bool, int], ...] = ()
    """``profile`` where the caller lets go of the step's outputs before the backward, which then frees those
    it reads after reading them (``problem.with_outputs_released``); empty where the backward reads none."""

    def no_more_than(self, other: "PartitionPeaks") -> bool:
        """Holds no more than ``other`` in any phase, and saves no input or output it does not save."""
        return (self.forward <= other.forward and self.backward <= other.backward and self.saved <= other.saved
                and self.saved_edges <= other.saved_edges)


def partition_peaks(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, *,
                    as_compiled: bool = False, layout_optimization: bool = False) -> PartitionPeaks:
    """What the training step already partitioned into ``fw`` and ``bw`` (what AOTAutograd's partitioners
    return; the first ``num_fwd_outputs`` forward outputs are the step's, the rest are saved for ``bw``, in its
    placeholders' order) holds, nothing moved, as Inductor allocates it (``inductor_problem``); ``as_compiled``:
    compiled with Inductor's own settings, which write over saved activations too (``written_in_place``), as
    the step as written is, or else as the planned problem counts it. ``layout_optimization``: with the
    channels-last copies Inductor's layout optimization makes wherever it would run the forward's convolutions
    channels-last (``passes.fusible.with_channels_last_copies``), as it does in the step as written only (every
    other plan is compiled without it)."""
    from karma_fx.costs import estimate_costs
    from karma_fx.passes.capture import CapturedStep
    from karma_fx.passes.liveness import build_problem, storage_key
    from karma_fx.passes.narrowing import saved_where_computable
    from karma_fx.simulate import simulate

    joint = stitched(saved_where_computable(fw), bw, num_fwd_outputs)
    gradient_copy = 0  # autograd's copy of a gradient the backward returns channels-last, after its last op
    channels_last = layout_optimization and layout_optimized(fw)
    if channels_last:
        joint, gradient_copy = with_channels_last_copies(joint, num_fwd_outputs, channels_last_nodes(fw))
    step = CapturedStep(joint=joint, primal_kinds=(), primal_names=(), num_fwd_outputs=num_fwd_outputs,
                        output_names=())
    problem = inductor_problem(build_problem(step), fusible_ops(joint.graph), inlined_ops(joint.graph),
                               saved_in_place=as_compiled, past_views=inlined_past_views(joint.graph),
                               addmm_adds=addmm_adds(joint.graph))

    def memory_of(counted: Problem) -> tuple[list[int], int]:
        timeline = simulate(counted, (), estimate_costs(counted), detail=False)
        memory = [b for _, b in timeline.memory]
        if gradient_copy and len(memory) > timeline.forward_items:
            memory[-1] += gradient_copy
        return memory, timeline.forward_items

    memory, split = memory_of(problem)
    released = with_outputs_released(problem)
    memory_released = memory_of(released)[0] if released is not None else []

    def tensor(node: Any) -> Any:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        return val if isinstance(val, torch.Tensor) else None

    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    edges: dict[Any, tuple[str, int]] = {storage_key(tensor(n)): ("input", i) for i, n in enumerate(placeholders)
                                         if tensor(n) is not None}
    output = next(n for n in fw.graph.nodes if n.op == "output")
    for j, node in enumerate(output.args[0][:num_fwd_outputs]):
        if tensor(node) is not None:
            edges.setdefault(storage_key(tensor(node)), ("output", j))
    storages: dict[Any, int] = {}
    saved_edges: set[tuple[str, int]] = set()
    for node in output.args[0][num_fwd_outputs:]:
        val = tensor(node)
        if val is None:
            continue
        key = storage_key(val)
        if key in edges:
            saved_edges.add(edges[key])
        else:
            storages[key] = val.untyped_storage().nbytes()
    source = {n.name: n.meta.get(STITCHED_FROM, n.name) for n in joint.graph.nodes}

    def profile_of(memory: list[int]) -> tuple[tuple[str, bool, int], ...]:
        return (tuple((source.get(op.name, op.name), i < split, b)
                      for i, (op, b) in enumerate(zip(problem.ops, memory))) if len(memory) == len(problem.ops) else ())

    return PartitionPeaks(forward=max(memory[:split], default=0), backward=max(memory[split:], default=0),
                          saved=sum(storages.values()), saved_edges=frozenset(saved_edges), profile=profile_of(memory),
                          channels_last=channels_last, released=profile_of(memory_released))
