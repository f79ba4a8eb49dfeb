"""Plain-data description of one training step: the contract between the graph passes and the planner.

Everything downstream of capture — cost model, strategies, solver, simulator — sees only these frozen
dataclasses (names, ints, floats), never ``torch.fx`` nodes. That keeps the planner testable on hand-built
problems and lets a plan be replayed without the model.

Memory is accounted per *storage*: views alias their base, so a storage is named after the first graph node
that holds it, and every node that reads any alias of it counts as a user of that storage.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

Phase = Literal["fwd", "bwd"]
StorageKind = Literal["param", "buffer", "input", "tangent", "activation", "gradient", "temp"]


@dataclass(frozen=True)
class Op:
    """One executed graph node that computes something (pure view / getitem nodes are folded away)."""

    name: str
    target: str
    phase: Phase
    inputs: tuple[str, ...]
    """Storages read by this op (directly or through views), deduplicated, in argument order."""
    outputs: tuple[str, ...]
    """Storages this op allocates."""
    flops: int = 0
    bytes_accessed: int = 0
    dtype: str = "float32"
    random: bool = False
    """Draws random numbers (dropout, randn): never recomputed, its result would differ."""
    mutates: bool = False
    """Has a side effect (buffer update, in-place op): never run twice."""
    split_costs: tuple[tuple[int, int, float], ...] = ()
    """For a kernel that may run a piece of the batch at a time (``karma_fx.split``), as measured where the
    step runs: ``(pieces, its scratch then in bytes, its time then as a multiple of the whole op's, or 0.0 where
    not timed)``, for each number of pieces that lowers its scratch. Empty for every other op."""
    module: str = field(default="", compare=False)
    """The innermost ``nn.Module`` the op ran in, as ``model.named_modules()`` names it
    (``transformer.h.3.mlp.c_fc``); a backward op carries its forward op's module. "" when unknown. A label for
    people only: it takes no part in equality, so two captures of one graph are the same problem."""

    @property
    def recomputable(self) -> bool:
        return not (self.random or self.mutates)


@dataclass(frozen=True)
class Storage:
    """One device allocation: its size, who makes it and who reads it."""

    name: str
    size_bytes: int
    kind: StorageKind
    producer: int | None
    """Index into ``Problem.ops`` of the op allocating it; ``None`` for graph inputs."""
    users: tuple[int, ...]
    """Op indices reading it, ascending."""
    is_output: bool = False
    """Returned by the step (a gradient, the loss, an updated buffer): lives until the end."""
    arrives_at: int = 0
    """For graph inputs: the op before which it exists on the device (tangents arrive with the backward)."""

    @property
    def lives_to_end(self) -> bool:
        """Held outside the step (weights, buffers, user inputs) or returned by it."""
        return self.is_output or self.kind in ("param", "buffer", "input")


@dataclass(frozen=True)
class Problem:
    """The training step as the planner sees it: ops in execution order and the storages they touch."""

    ops: tuple[Op, ...]
    storages: tuple[Storage, ...]
    num_fwd_ops: int
    """Ops ``[0, num_fwd_ops)`` are the forward pass, the rest the backward."""
    cut_points: tuple[int, ...] = ()
    """Forward op indices after which no later op reads any activation made before it, except through that
    op's outputs: the natural layer boundaries (Chen et al.'s articulation points)."""
    aliases: tuple[tuple[str, str], ...] = ()
    """(graph node name, storage name) for every tensor-valued node, views included."""
    name: str = "model"
    fused_kernels: bool = False
    """Whether this is the step as Inductor runs it (``fusion.inductor_problem``): its kernels compute several
    ops each and may run a reader's half of an op late, which some moves need to know."""
    loop_ops: frozenset[str] = frozenset()
    """On the step Inductor runs: the ops it computes in its loops, or runs no kernel for where the graph has
    them (a dead op, a matmul its ``addmm`` rewrite runs later). A stretch of them, recomputed ops included, is
    one function of loops that holds what it reads and writes until it returns, which the simulator needs where
    a plan puts a recompute chain beside the backward's loops (``fusion.loop_ops``)."""
    held_by_runs: frozenset[tuple[str, str]] = frozenset()
    """On the step Inductor runs: (op, storage) for each read ``fusion.outputs_held_through_runs`` gave the last op
    of a run of loops, which holds the run's outputs to its end as if the run were one function. A recompute
    chain is cut into functions where it rebuilds a tensor (``passes.rewrite`` pins it there), so the simulator
    drops these reads from a chain's ops and holds what the chain's functions really hold instead."""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _op_index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {s.name: i for i, s in enumerate(self.storages)}
        if len(index) != len(self.storages):
            raise ValueError("storage names must be unique")
        op_index = {op.name: i for i, op in enumerate(self.ops)}
        if len(op_index) != len(self.ops):
            raise ValueError("op names must be unique")
        self._index.update(index)
        self._op_index.update(op_index)

    def storage(self, name: str) -> Storage:
        return self.storages[self._index[name]]

    def has_storage(self, name: str) -> bool:
        return name in self._index

    def op_index(self, name: str) -> int:
        return self._op_index[name]

    def is_backward(self, op_index: int) -> bool:
        return op_index >= self.num_fwd_ops

    def saved_activations(self) -> tuple[Storage, ...]:
        """Storages made in the forward pass and read in the backward: the candidates to offload or recompute
        (not the step's outputs, which the caller holds anyway)."""
        return tuple(
            s
            for s in self.storages
            if s.kind == "activation"
            and not s.is_output
            and s.producer is not None
            and s.producer < self.num_fwd_ops
            and s.users
            and s.users[-1] >= self.num_fwd_ops
        )

    @property
    def param_bytes(self) -> int:
        return sum(s.size_bytes for s in self.storages if s.kind == "param")


def short_target(target: str) -> str:
    """``aten.mm.default`` → ``aten.mm``: the default overload says nothing a reader needs."""
    return target[: -len(".default")] if target.endswith(".default") else target


def describe_op(op: Op) -> str:
    """An op named for a person: ``mm_12 (aten.mm in transformer.h.3.mlp.c_fc)``; what errors that name an
    op of a ``Problem`` should say."""
    return describe_node(op.name, op.target, op.module)


def describe_node(name: str, target: str = "", module: str = "") -> str:
    """``describe_op`` from a node's name, target and module, for errors raised before the ``Problem`` exists:
    ``mm_12 (aten.mm in transformer.h.3.mlp.c_fc)``, ``mm_12 (aten.mm)`` when the module is unknown."""
    what = short_target(target) if target and target != name else ""
    inner = f"{what} in {module}" if what and module else (f"in {module}" if module else what)
    return f"{name} ({inner})" if inner else name


def short_module(module: str, max_chars: int = 28) -> str:
    """``module`` cut to its last dotted components that fit in ``max_chars`` (at least the last two), behind
    a leading ``…`` when cut: ``encoder.block.11.layer.1.DenseReluDense.wi`` → ``…layer.1.DenseReluDense.wi``.
    A table column stays narrow while what tells layers apart, the layer number and the submodule, survives:
    GPT-2's ``transformer.h.11.mlp.c_proj`` fits whole, Llama's ``model.layers.7.self_attn.q_proj`` loses
    ``model.``."""
    parts = module.split(".")
    if len(module) <= max_chars or len(parts) <= 2:
        return module
    keep = 2
    while len(".".join(parts[-keep - 1:])) + 1 <= max_chars:
        keep += 1
    return "…" + ".".join(parts[-keep:])


def with_split_costs(problem: Problem, split: dict[str, tuple[tuple[int, int, float], ...]], *,
                     timed: bool = True) -> Problem:
    """``problem`` with each op's measured split costs (``Op.split_costs``, e.g. from
    ``karma_fx.passes.measure.scratch_and_split_costs``), for ops whose scratch is counted; ``timed`` false
    drops the measured times (0.0: modelled instead), as for a step priced on another device's roofline."""
    chosen = {op.name: split[op.name] for op in problem.ops
              if split.get(op.name) and f"{op.name}:scratch" in op.outputs}
    if not chosen:
        return problem
    if not timed:
        chosen = {name: tuple((k, b, 0.0) for k, b, _ in costs) for name, costs in chosen.items()}
    ops = tuple(replace(op, split_costs=chosen[op.name]) if op.name in chosen else op for op in problem.ops)
    return replace(problem, ops=ops, _index={}, _op_index={})


def with_scratch(problem: Problem, scratch: dict[str, int]) -> Problem:
    """``problem`` with each op's kernel scratch (op name → bytes, e.g. measured by
    ``karma_fx.passes.measure.scratch_bytes``) as one more output that nothing reads: it is on the device
    while the op runs, and again whenever the op is recomputed, so every strategy and the simulator count it
    without knowing it is there. No strategy can move it: nothing reads it after its op."""
    extra = {op.name: scratch[op.name] for op in problem.ops if scratch.get(op.name, 0) > 0}
    if not extra:
        return problem
    ops = tuple(replace(op, outputs=op.outputs + (f"{op.name}:scratch",)) if op.name in extra else op
                for op in problem.ops)
    storages = problem.storages + tuple(Storage(f"{name}:scratch", size, "temp", problem.op_index(name), ())
                                        for name, size in extra.items())
    return replace(problem, ops=ops, storages=storages, _index={}, _op_index={})


def with_outputs_released(problem: Problem, names: "set[str] | frozenset[str] | None" = None) -> Problem | None:
    """``problem`` with the forward's outputs that its backward reads (a language model's logits, saved for the
    loss's gradient; among ``names`` where given) no longer held to the end of the step, or ``None`` where there
    are none: what the step holds where the caller has let them go before the backward (``loss_fn(model(x))
    .backward()``, HuggingFace's ``Trainer``), so that a compiled backward frees them once it has read them.
    Counted as held, GPT-2's step as written (tiny, batch 8x128) was predicted 4.8% above the allocator's peak."""
    n = problem.num_fwd_ops
    released = {s.name for s in problem.storages
                if s.is_output and s.kind in ("activation", "temp") and s.producer is not None and s.producer < n
                and any(u >= n for u in s.users) and (names is None or s.name in names)}
    if not released:
        return None
    storages = tuple(replace(s, is_output=False) if s.name in released else s for s in problem.storages)
    return replace(problem, storages=storages, _index={}, _op_index={})
