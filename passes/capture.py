"""Capture: trace one training step of a module into a joint forward+backward aten graph.

AOTAutograd does the work, as ``torch.compile`` would: the module's parameters, buffers and tensor inputs
become ``primals``, the gradients of its outputs become ``tangents``, and the joint graph computes the outputs
and every gradient. We trace on fake tensors, so a 10-billion-parameter model is captured on a laptop: a
module built on the ``meta`` device is traced as if it lived on the CPU, and a real module's weights are
never read.

Example::

    step = capture(torch.nn.Linear(4, 2), (torch.randn(8, 4),))
    print(step.joint.graph)          # primals_1..3, tangents_1, addmm, mm, ...
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from karma_fx.errors import KarmaError, UnsupportedModelError
from karma_fx.passes.dropout import split_dropout
from karma_fx.passes.gpu_attention import GpuAttention
from karma_fx.passes.loss_head import ChunkedHead

PrimalKind = Literal["param", "buffer", "input"]


@dataclass
class CapturedStep:
    """The joint graph and what its placeholders and outputs mean."""

    joint: fx.GraphModule
    primal_kinds: tuple[PrimalKind, ...]
    """Kind of each ``primals_*`` placeholder, in order: parameters, then buffers, then tensor inputs."""
    primal_names: tuple[str, ...]
    """Parameter / buffer qualified names, ``input[i]`` for inputs."""
    num_fwd_outputs: int
    """Leading joint outputs computed by the forward (updated buffers first, then the model's outputs)."""
    output_names: tuple[str, ...]
    """What the captured forward outputs are (``loss`` or the flattened output leaves)."""
    joint_inputs: Any = None
    """The (fake) example inputs of the joint graph, as AOTAutograd handed them to the partitioner."""
    loss_chunk: int = 0
    """Tokens per chunk of the loss head where it was traced chunked (``passes/loss_head.py``), else 0."""
    loss_tokens: int = 0
    """The tokens of that loss head."""
    keep_all_excess: Any = None
    """Where a plan that moves nothing is partitioned otherwise than the graph is planned (Inductor's own
    partition): a callable returning what that partition holds above the one planned (``passes.partition``)."""


class _JointCaptured(Exception):
    """Raised from inside the partitioner once the joint graph is in hand."""


class _StepModule(nn.Module):
    """Holds fake copies of the model's parameters and buffers and calls the model functionally with them.

    The user's module is never modified; its tensors are swapped in for the call by ``functional_call``.
    """

    def __init__(self, model: nn.Module, fake_params: dict[str, torch.Tensor], fake_buffers: dict[str, torch.Tensor],
                 spec: pytree.TreeSpec, leaves: list[Any], tensor_slots: list[int], loss_only: bool,
                 detach_rest: bool = False) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        self._names: dict[str, str] = {}
        self._all_names: dict[str, str] = {}
        for name, p in fake_params.items():
            slot = f"p{len(self._names)}"
            self.register_parameter(slot, p)
            self._names[name] = slot
        for name, b in fake_buffers.items():
            slot = f"b{len(self._names)}"
            self.register_buffer(slot, b)
            self._names[name] = slot
        self._spec = spec
        self._leaves = leaves
        self._tensor_slots = tensor_slots
        self._loss_only = loss_only
        self._detach_rest = detach_rest

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for slot, t in zip(self._tensor_slots, tensors):
            leaves[slot] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        state = {name: getattr(self, slot) for name, slot in self._names.items()}
        out = torch.func.functional_call(self._model, state, tuple(args), kwargs, tie_weights=True, strict=False)
        flat = _flatten_outputs(out, self._loss_only)
        if self._detach_rest:  # the outputs beside the loss, as compile returns them once a backward showed
            loss = _loss_of(out)  # that the loss alone is differentiated (``karma_fx.unused_grads``)
            flat = tuple(t if t is loss else t.detach() for t in flat)
        return flat


def _fresh(head: Any) -> Any:
    """A second ``ChunkedHead`` like ``head`` (each trace follows its own tensors), or a null context."""
    return ChunkedHead(head.chunk, head.min_classes) if isinstance(head, ChunkedHead) else contextlib.nullcontext()


def copy_joint(step: "CapturedStep") -> fx.GraphModule:
    """A copy of ``step.joint`` whose graph a pass may edit (``copy_graph``)."""
    return copy_graph(step.joint)


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph a pass may edit: the graph and its nodes are copied, the module's tensor
    attributes (a model's constants) are shared, not cloned. Passes edit graphs, never constants, and cloning a
    real constant inside AOTAutograd's partitioner runs under its fake mode, which torch 2.11 refuses (T5's
    position-bias constant: "set the storage of a tensor on device meta to ... cpu")."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta.update(gm.meta)
    return copied


def _flatten_outputs(out: Any, loss_only: bool) -> tuple[torch.Tensor, ...]:
    if loss_only:
        return (_loss_of(out),)
    return tuple(leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor))


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["loss"]
    return out.loss


def _has_loss(out: Any) -> bool:
    try:
        loss = _loss_of(out)
    except (KeyError, AttributeError, TypeError):
        return False
    return isinstance(loss, torch.Tensor) and loss.dim() == 0


def _named_unique(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """First name of each distinct tensor (tied weights appear once, as in ``named_parameters()``)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _fakeify(fake_mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s metadata; meta tensors are traced as if they were on the CPU."""
    if t.device.type == "meta":
        converter = fake_mode.fake_tensor_converter
        return converter.from_meta_and_device(fake_mode, t, torch.device("cpu"))
    return fake_mode.from_tensor(t)


def capture(model: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None, *,
            gpu_attention: bool = False, inductor: bool = False, loss_chunk: int | None = 0) -> CapturedStep:
    """Trace ``model(*args, **kwargs)`` and the backward of its outputs into one joint aten graph.

    ``gpu_attention``: trace attention with dropout as a CUDA GPU's fused kernel (``passes/gpu_attention.py``),
    for a plan made here of a step that runs on a GPU; the graph then cannot run here. ``inductor``: trace the
    joint graph ``karma_fx.compile(compiler="inductor")`` plans: with Inductor's decompositions, its dropout
    backward left for Inductor to fuse (``split_dropout``). ``loss_chunk``: trace a cross-entropy over a
    linear layer's logits as the chunked loss head, ``loss_chunk`` tokens at a time (``passes/loss_head.py``;
    ``None``: its default size; ``0``: as the model computes it). ``CapturedStep.loss_chunk`` says which.

    Every tensor output that requires grad is differentiated, with its incoming gradient as a ``tangents_*``
    input, except beside a loss: a model that returns one (a HuggingFace model given ``labels``, whose logits
    come with it) is trained by ``loss.backward()``, and its other outputs are traced detached, as
    ``karma_fx.compile`` runs them once the first backward showed them undifferentiated (``torch.compile``
    instead fills their gradients with zeros of their size and runs their backward on them:
    ``karma_fx.passes.unused_outputs``).
    """
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"karma_fx plans nn.Module training steps, got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    if not isinstance(args, tuple):
        args = (args,)
    devices = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    devices |= {leaf.device.type for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
    if len(devices - {"meta"}) > 1:
        raise UnsupportedModelError(f"model parameters and inputs are on mixed devices {sorted(devices)}; "
                                    "move them to one device first")

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    attention = GpuAttention() if gpu_attention else contextlib.nullcontext()
    head = ChunkedHead(loss_chunk) if loss_chunk != 0 else contextlib.nullcontext()
    params = _named_unique(list(model.named_parameters(remove_duplicate=False)))
    buffers = _named_unique(list(model.named_buffers(remove_duplicate=False)))
    fake_params = {n: nn.Parameter(_fakeify(fake_mode, p.detach()), requires_grad=p.requires_grad)
                   for n, p in params.items()}
    fake_buffers = {n: _fakeify(fake_mode, b) for n, b in buffers.items()}
    leaves, spec = pytree.tree_flatten((list(args), kwargs))
    tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    fake_inputs = []
    for i in tensor_slots:
        t = leaves[i]
        f = _fakeify(fake_mode, t.detach())
        if t.requires_grad:
            f.requires_grad_(True)
        fake_inputs.append(f)
        leaves[i] = None

    # Decide whether the step differentiates a `loss` field: trace the forward once on fake tensors.
    probe = _StepModule(model, fake_params, fake_buffers, spec, leaves, tensor_slots, loss_only=False)
    scope = _ModuleScope(model)
    with fake_mode, _as_torch_compile_sees_it(), attention, _friendly_errors("tracing the forward", scope), scope, \
            _fresh(head):
        state = {name: getattr(probe, slot) for name, slot in probe._names.items()}
        call_leaves = list(leaves)
        for slot, t in zip(tensor_slots, fake_inputs):
            call_leaves[slot] = t
        a, k = pytree.tree_unflatten(call_leaves, spec)
        raw_out = torch.func.functional_call(model, state, tuple(a), k, tie_weights=True, strict=False)
    step = _StepModule(model, fake_params, fake_buffers, spec, leaves, tensor_slots, loss_only=False,
                       detach_rest=_has_loss(raw_out))
    names = [f"output[{i}]" for i in range(len(_flatten_outputs(raw_out, False)))]
    if _has_loss(raw_out) and names:
        names[0] = "loss"
    output_names: tuple[str, ...] = tuple(names)

    captured: dict[str, Any] = {}

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        # a dropout output can then be rebuilt from its mask
        if inductor:
            from karma_fx.inductor import min_cut_excess

            joint = _inductor_joint_passes(joint, joint_inputs)
            try:  # what the step as written (Inductor's own partition) holds above the partition planned
                excess = min_cut_excess(joint, joint_inputs, **kw)
                captured["keep_all_excess"] = lambda: excess
            except Exception:  # noqa: BLE001 - planned as the partition planned, as compile then runs it
                logging.getLogger("karma_fx").debug("Inductor's own partition not priced", exc_info=True)
        captured["joint"] = split_dropout(joint, not inductor)
        captured["joint_inputs"] = joint_inputs
        captured["num_fwd_outputs"] = kw["num_fwd_outputs"]
        # The joint graph is all we need: stop AOTAutograd before it partitions and code-generates wrappers
        # (that codegen recurses once per parameter and overflows on ResNet-1001's 3,000 tensors).
        raise _JointCaptured

    def identity_compiler(gm: fx.GraphModule, example_inputs: Any) -> fx.GraphModule:
        return gm

    with fake_mode, _as_torch_compile_sees_it(), attention, _friendly_errors("capturing the training step", scope), \
            scope, head:
        try:
            aot_module_simplified(step, tuple(fake_inputs), fw_compiler=identity_compiler,
                                  bw_compiler=identity_compiler, partition_fn=partition,
                                  decompositions=_inductor_decompositions() if inductor else None)
        except _JointCaptured:
            pass
    if "joint" not in captured:
        raise UnsupportedModelError("the model's outputs do not require grad: there is no backward to plan "
                                    "(put the model in training mode with parameters that require grad)")
    kinds: list[PrimalKind] = ["param"] * len(fake_params) + ["buffer"] * len(fake_buffers) + ["input"] * len(fake_inputs)
    names = list(fake_params) + list(fake_buffers) + [f"input[{i}]" for i in range(len(fake_inputs))]
    return CapturedStep(joint=captured["joint"], primal_kinds=tuple(kinds), primal_names=tuple(names),
                        num_fwd_outputs=captured["num_fwd_outputs"], output_names=output_names,
                        joint_inputs=captured["joint_inputs"],
                        loss_chunk=head.chunk if isinstance(head, ChunkedHead) and head.rewritten else 0,
                        loss_tokens=head.tokens if isinstance(head, ChunkedHead) else 0,
                        keep_all_excess=captured.get("keep_all_excess"))


def _inductor_decompositions() -> dict:
    """The decompositions ``torch.compile(backend="inductor")`` traces a joint graph with: the graph it plans
    is then op for op the one the compiled step runs. Some of them ask Inductor's lowerings whether to apply
    (max-pooling's), which only ``compile_fx`` imports: imported here too."""
    import torch._inductor.lowering  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _inductor_joint_passes(joint: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
    """``joint`` after the passes Inductor runs on every joint graph before partitioning it (pattern rewrites,
    no-op removal, constant folding), as ``torch.compile(backend="inductor")`` would. Private to Inductor, its
    signature has changed between releases: only the arguments it takes are passed; where it cannot run, the
    joint is planned as traced (a plan a little off the step, never a wrong step: the runtime checks each
    planned graph against the one Inductor compiles)."""
    import inspect
    import logging

    try:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import _recursive_joint_graph_passes
        from torch._inductor.virtualized import V

        devices = {t.device for t in pytree.tree_leaves(joint_inputs) if isinstance(t, torch.Tensor)}
        accepted = inspect.signature(_recursive_joint_graph_passes).parameters
        extra = {"input_device": next(iter(devices))} if "input_device" in accepted and len(devices) == 1 else {}
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # the passes trace their rewrites on it
            return _recursive_joint_graph_passes(joint, **extra)
    except Exception:  # pragma: no cover - depends on the torch release
        logging.getLogger("karma_fx").debug("Inductor's joint graph passes failed; planning the joint as traced",
                                            exc_info=True)
        return joint


@contextlib.contextmanager
def _as_torch_compile_sees_it():
    """Report ``torch.compiler.is_compiling()`` as True while tracing, as it is under ``torch.compile``.

    Libraries branch on it to skip value-dependent checks that fake tensors cannot answer (HF transformers'
    packed-sequence detection calls ``.all()`` on a tensor otherwise); a Dynamo trace takes the same branch.
    """
    import torch.compiler

    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling = original  # type: ignore[assignment]


class _ModuleScope:
    """The model's modules a trace is inside, outermost first, by their ``named_modules()`` names.

    While it is entered, every call of one of the model's submodules is pushed on the stack and popped on
    return, and the stack is written where FX copies node metadata from (``torch.fx.traceback``'s current meta,
    as ``nn_module_stack`` in Dynamo's format): AOTAutograd, tracing the step, then records on each forward
    node the module it ran in, as under ``torch.compile``, and hands it on to the backward nodes
    differentiating that node (``fwd_nn_module_stack``); the liveness pass reads both. Global module hooks, so
    the user's modules are not touched. A failing call never returns, so after an error ``where`` names the
    module it failed in."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {id(m): name for name, m in model.named_modules() if name}
        self._stack: list[tuple[str, type]] = []
        self._handles: list[Any] = []

    @property
    def where(self) -> str:
        """The innermost module the trace is (or was, when it failed) inside; "" for the model itself."""
        return self._stack[-1][0] if self._stack else ""

    def _publish(self) -> None:
        from torch.fx import traceback as fx_traceback

        if not fx_traceback.has_preserved_node_meta():  # not inside AOTAutograd's trace: no node to label
            return
        meta = fx_traceback.current_meta  # a copy AOTAutograd drops when its trace ends: look it up each time
        if self._stack:
            meta["nn_module_stack"] = {name: (name, cls) for name, cls in self._stack}
        else:
            meta.pop("nn_module_stack", None)

    def _enter(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append((name, type(module)))
            self._publish()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is None:
            return
        # Pop to this module's own entry: an inner call whose error the model caught never returned.
        for k in range(len(self._stack) - 1, -1, -1):
            if self._stack[k][0] == name:
                del self._stack[k:]
                self._publish()
                return

    def __enter__(self) -> "_ModuleScope":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._stack.clear()
        self._handles = [register_module_forward_pre_hook(self._enter), register_module_forward_hook(self._leave)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []  # the stack stays as it is, for ``where``


@contextlib.contextmanager
def _friendly_errors(what: str, scope: _ModuleScope | None = None):
    """Turn tracing failures (data-dependent ops, dynamic shapes, unsupported ops) into UnsupportedModelError,
    naming the module the trace failed in when ``scope`` knows it."""
    try:
        yield
    except KarmaError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes one actionable error
        name = type(exc).__name__
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = ""
        if "data-dependent" in str(exc).lower() or "DataDependent" in name or "Unbacked" in name:
            hint = (" The model uses a data-dependent op (e.g. .item(), nonzero, boolean indexing) inside the "
                    "step; move it out of the captured region or make it shape-static.")
        elif "DynamicOutputShape" in name:
            hint = " An op's output shape depends on tensor values; karma_fx needs static shapes."
        where = f" in {scope.where}" if scope is not None and scope.where else ""
        raise UnsupportedModelError(f"karma_fx could not capture the model while {what}{where}: {name}: {first}."
                                    f"{hint}") from exc
