"""``karma_fx.compile``: the model's training step, planned under a budget and rewritten to follow the plan.

Built on ``torch.compile(model, backend=<karma>, dynamic=False)``: Dynamo's guards decide when a compiled step
no longer matches the model or the call (``model.eval()``, a frozen or unfrozen layer, a replaced module or
parameter, grad mode, autocast, other input shapes, strides or dtypes) and recompile, and the karma backend
plans each region (``karma_fx.backend``). What this module adds on top: the host optimizer, data-parallel
gradient exchange and weight streaming (``karma_fx.exchange``), the step boundary the backend accounts runs
by, and a module that behaves like the model (``state_dict()`` keys, attributes such as ``config`` or
``generate``).

Example::

    step = karma_fx.compile(model, budget=0.5, strategy="karma")
    loss = loss_fn(step(x), y); loss.backward()
    print(step.plan.table()); fw, bw = step.graphs[0]
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

from karma_fx.backend import KarmaBackend
from karma_fx.session import Session, parameters_and_buffers
from karma_fx.variants import Region
from karma_fx.config import KarmaConfig
from karma_fx.device import DeviceSpec
from karma_fx.errors import KarmaError, UnsupportedModelError
from karma_fx.exchange import DEFAULT_BUCKET_BYTES, GradientPipeline, OptimizerFactory, broadcast_from_rank0
from karma_fx.plan import Plan
from karma_fx.strategies import Strategy

log = logging.getLogger("karma_fx.compile")
_OWN = ("_orig_mod", "_session", "_compiled", "pipeline", "_parameters_seen", "_made_with", "_walked")


class KarmaModule(nn.Module):
    """What ``karma_fx.compile`` returns: the model, run through its planned, compiled training step."""

    def __init__(self, model: nn.Module, config: KarmaConfig, optimizer: OptimizerFactory | None = None,
                 data_parallel: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 max_grad_norm: float | None = None) -> None:
        super().__init__()
        self._orig_mod = model
        if config.offload_weights and any(p.device.type != "cpu" for p in model.parameters()):
            raise UnsupportedModelError(
                "offload_weights=True is implemented for models whose weights are in host memory and run on the "
                "CPU (where it is tested); streaming CUDA weights from pinned host memory is not implemented yet")
        pipeline = None
        if optimizer is not None or data_parallel:
            params = [p for p in model.parameters() if p.requires_grad]
            pipeline = GradientPipeline(params, optimizer=optimizer, data_parallel=data_parallel,
                                        bucket_bytes=bucket_bytes, max_grad_norm=max_grad_norm)
            if data_parallel:
                broadcast_from_rank0(model)
        elif max_grad_norm is not None:
            raise KarmaError("max_grad_norm applies to the host optimizer (optimizer=...); without it, clip .grad "
                             "yourself with torch.nn.utils.clip_grad_norm_ after backward, as usual")
        session = Session(config, model=model, pipeline=pipeline)
        object.__setattr__(self, "_made_with", (config, optimizer, data_parallel, bucket_bytes, max_grad_norm))
        object.__setattr__(self, "pipeline", pipeline)
        if pipeline is not None:  # Dynamo's caches keep the session; the pipeline's state goes with this module
            pipeline.tie_to(self)
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_compiled", torch.compile(model, backend=KarmaBackend(session), dynamic=False))
        object.__setattr__(self, "_parameters_seen", _parameter_signature(parameters_and_buffers(model)[0]))
        object.__setattr__(self, "_walked", None)

    # ---- behave like the model ----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _OWN:
                raise
            return getattr(self._orig_mod, name)

    def __reduce__(self) -> tuple:
        """Pickled as the model and how it was compiled (``torch.save(step)`` works, as for a plain
        ``torch.compile`` module): compiled code and plans are made again on the first call after loading; the
        host optimizer's state travels with it."""
        state = self.pipeline.optimizer.state_dict() if self.pipeline is not None and \
            self.pipeline.optimizer is not None else None
        return _restore, (self._orig_mod, *self._made_with, state)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``state_dict`` (keys unchanged, as if it had not been compiled)."""
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._orig_mod.load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- what was planned ---------------------------------------------------------------------------------
    @property
    def config(self) -> Any:  # the model's config (HF), not ours: ours is ``karma_config``
        return getattr(self._orig_mod, "config")

    @property
    def karma_config(self) -> KarmaConfig:
        return self._session.config

    @property
    def regions(self) -> list[Region]:
        """Every region compiled for training, in compile order (one unless the model has graph breaks or was
        recompiled for other inputs)."""
        return [r for r in self._session.regions if r.last is not None]

    @property
    def plan(self) -> Plan:
        """The plan of the region compiled most recently."""
        trained = self.regions
        if not trained:
            raise KarmaError("call the compiled module once first (in training mode, with gradients on): plans "
                             "are made for concrete inputs; a model Dynamo runs eagerly (e.g. nn.LSTM) has none")
        return trained[-1].plan

    @property
    def graphs(self) -> list[tuple[fx.GraphModule, fx.GraphModule]]:
        return [r.graphs for r in self.regions]

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget known to work for the step that ran last: every run of every region with its
        leanest plan, with what the step holds besides (weights, gradients held, the batch, the loss head)."""
        return self._session.step_figures()[2]

    @property
    def unplanned_peak_bytes(self) -> int:
        """The device peak of the step that ran last with nothing moved (what a fractional budget is of)."""
        return self._session.step_figures()[1]

    @property
    def predicted_peak_bytes(self) -> int:
        """The device peak of the step that ran last, as planned: its plans, and what the step holds besides."""
        return self._session.step_figures()[0]

    def _last_region(self) -> Region:
        trained = self.regions
        if not trained:
            raise KarmaError("call the compiled module once first: plans are made for concrete inputs")
        return trained[-1]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The host optimizer (for LR schedulers, ``state_dict()`` and ``load_state_dict()``)."""
        if self.pipeline is None or self.pipeline.optimizer is None:
            raise KarmaError("this module has no host optimizer: pass optimizer= to karma_fx.compile")
        self.pipeline.wait_updates()
        return self.pipeline.optimizer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as with ``DistributedDataParallel.no_sync``: backward passes inside add to
        ``.grad``; the host optimizer and the all-reduce wait for the first backward outside."""
        if self.pipeline is None:
            yield
            return
        with self.pipeline.no_sync():
            yield

    def clip_grad_norm_(self, *args: Any, **kwargs: Any) -> None:
        raise KarmaError("with optimizer=, gradients are consumed by the host optimizer as backward produces them, "
                         "so there is no .grad to clip afterwards: pass max_grad_norm= to karma_fx.compile instead")

    # ---- the call ----------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        session = self._session
        params, buffers, devices = self._weights(session)
        _check_runnable(devices, args, kwargs)
        self._recompile_if_parameters_changed(params)
        if torch.is_grad_enabled() and session.step_over():  # a call before the last one's backward is
            session.begin_step((params, buffers), outside=True)  # another run of the same step; no_grad, none
        # Each compiled module has its own backend, so Dynamo keeps one cache entry per module on the model
        # class's code; past its recompile limit it would run the model eagerly, unplanned, without a word.
        # Raised by hand for the call, not with ``config.patch``: that builds a class on every call, a quarter
        # of this method's own time on a small model.
        dynamo_config = torch._dynamo.config
        limit = dynamo_config.recompile_limit
        if limit < RECOMPILE_LIMIT:
            dynamo_config.recompile_limit = RECOMPILE_LIMIT
        try:
            try:
                out = self._compiled(*args, **kwargs)
            except BackendCompilerFailed as exc:
                inner = getattr(exc, "inner_exception", None)
                if isinstance(inner, KarmaError):
                    raise inner from None
                raise UnsupportedModelError(f"karma_fx could not compile the model: {type(inner).__name__}: "
                                            f"{_first_line(inner)}") from exc
            except TorchDynamoException as exc:  # Dynamo's own tracing errors (its message says what in it)
                raise UnsupportedModelError(f"torch.compile could not trace the model: {_first_line(exc)}") from exc
        except BaseException:
            session.step_failed()
            raise
        finally:
            if limit < RECOMPILE_LIMIT:
                dynamo_config.recompile_limit = limit
        if not session.ran_training_region() and torch.is_grad_enabled() and _trains(self._orig_mod, args, kwargs):
            if not session.warned_eager:
                session.warned_eager = True
                log.warning("karma_fx: Dynamo ran %s without compiling a training region (graph breaks around "
                            "every op, e.g. nn.LSTM, or its recompile limit); the step ran eagerly, unplanned, "
                            "and the budget is not enforced", type(self._orig_mod).__name__)
        return out

    def _weights(self, session: Session) -> tuple[list[nn.Parameter], list[torch.Tensor], set[str]]:
        """The model's parameters, buffers and the device types they are on, walked again only after a compile:
        a module or parameter replaced, moved or cast makes Dynamo's guards compile the step anew, so between
        compiles the walk (a tenth of a millisecond a call on a 300-weight model) finds what it found before."""
        cached = self._walked
        if cached is None or cached[0] != session.compiles:
            params, buffers = parameters_and_buffers(self._orig_mod)
            devices = {d.type for d in {t.device for t in params} | {t.device for t in buffers}}
            cached = (session.compiles, params, buffers, devices)
            object.__setattr__(self, "_walked", cached)
        return cached[1], cached[2], cached[3]

    def _recompile_if_parameters_changed(self, params: list[nn.Parameter]) -> None:
        """Compile afresh when a parameter was unfrozen, frozen, replaced or added since the last call.

        Dynamo guards on these itself, but not on every torch this package supports: torch 2.11 reuses a graph
        compiled with a frozen layer after ``requires_grad_(True)``, and that layer then silently gets no
        gradient (plain ``torch.compile`` too). A new backend object makes Dynamo's cached code for the old one
        miss, so the region is captured again with the parameters as they are now. Where Dynamo guards on it
        itself (``_DYNAMO_GUARDS_PARAMETERS``), nothing is checked here."""
        if _DYNAMO_GUARDS_PARAMETERS:
            return
        seen = _parameter_signature(params)
        if seen != self._parameters_seen:
            object.__setattr__(self, "_compiled", torch.compile(self._orig_mod, backend=KarmaBackend(self._session),
                                                                dynamic=False))
            object.__setattr__(self, "_parameters_seen", seen)


def _restore(model: nn.Module, config: KarmaConfig, optimizer: OptimizerFactory | None, data_parallel: bool,
             bucket_bytes: int, max_grad_norm: float | None, optimizer_state: Any) -> "KarmaModule":
    """A pickled ``KarmaModule`` loaded: compiled anew around the unpickled model (``KarmaModule.__reduce__``)."""
    module = KarmaModule(model, config, optimizer, data_parallel, bucket_bytes, max_grad_norm)
    if optimizer_state is not None and module.pipeline is not None and module.pipeline.optimizer is not None:
        module.pipeline.optimizer.load_state_dict(optimizer_state)
    return module


RECOMPILE_LIMIT = 64

_DYNAMO_GUARDS_PARAMETERS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
"""Whether this torch's Dynamo compiles anew when a parameter is frozen or unfrozen (2.13 does, 2.11 does not):
where it does, the front door leaves that to Dynamo's guards and reads nothing of the parameters per call."""


def _parameter_signature(params: list[nn.Parameter]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Which parameters there are and which train: two flat tuples (a tuple per parameter cost three times
    as much, every call)."""
    return tuple(map(id, params)), tuple([p.requires_grad for p in params])


def _first_line(exc: object) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _trains(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    import torch.utils._pytree as pytree

    return any(p.requires_grad for p in model.parameters()) or any(
        t.requires_grad for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


def _check_runnable(weight_devices: set[str], args: tuple, kwargs: dict) -> None:
    import torch.utils._pytree as pytree

    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call, without pytree's walk
        tensors = list(args)
    else:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # the device objects first, their type names from the few distinct ones: a name costs five times a device
    devices = {d.type for d in {t.device for t in tensors}} | weight_devices
    if "meta" in devices:
        raise UnsupportedModelError(
            "the model or its inputs are on the meta device: they have no values to train on. Plan it without "
            "running it with karma_fx.plan(model, args, budget=...), or build it on a real device to compile it")
    if len(devices) > 1:
        raise UnsupportedModelError(f"inputs and parameters are on mixed devices {sorted(devices)}; move them to "
                                    "one device first")


def inductor_keeps_hand_overs() -> bool:
    """Whether this torch's Inductor keeps an extern kernel that returns nothing and mutates nothing but is
    registered as having a side effect (``karma::gradient_ready``): from 2.10 its ``FallbackKernel`` asks the
    registry; before, it asked only the schema, and dropped the call."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) >= (2, 10)


def compile(model: nn.Module, *, budget: str | int | float, device: str | DeviceSpec | None = None,
            strategy: str | Strategy | None = None, optimizer: OptimizerFactory | None = None,
            data_parallel: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            offload_weights: bool = False, time_limit_s: float | None = None,
            max_grad_norm: float | None = None, plan_cache: str | None = None, costs: str | None = None,
            compiler: str | None = None, loss_chunk: int | None = None) -> KarmaModule:
    """Plan ``model``'s training step under ``budget`` and return a drop-in module that runs the plan.

    ``budget``: bytes (``"12GiB"``, ``12e9``) or a fraction (``0.5``) of the unplanned step as training runs
    it (gradients held from earlier micro-batches and the loss head included), growing with it: the fraction of
    the largest such step seen (``karma_fx.session``). ``optimizer``: a callable building a PyTorch
    optimizer from a list of parameters (e.g. ``functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)``);
    the update then runs on the host, bucket by bucket, while backward goes on, and those parameters get no
    ``.grad`` (do not step an optimizer yourself; ``step.optimizer`` is the one built, for LR schedulers and
    checkpoints; ``with step.no_sync():`` accumulates; ``max_grad_norm`` clips). ``data_parallel``:
    all-reduce gradients across the ``torch.distributed`` world in buckets of ``bucket_bytes`` as backward
    produces them (launch with ``torchrun``); rank 0's weights are broadcast first. ``offload_weights``:
    parameters stay in host memory and stream through the device window by window (CPU-tested, not
    implemented for CUDA weights yet). ``time_limit_s``: wall-clock limit for planning each region.
    ``plan_cache``: a directory of plans keyed by the captured graph, device, strategy and budget (default
    ``$KARMA_PLAN_CACHE``), so a restarted job does not plan again. ``costs``: by default each region is
    measured on the tensors of its first run, on the device it runs on (each kernel's scratch and each op's
    time, and the copy ops' speed); ``"roofline"`` (or a ``device`` preset named) times the ops on the preset's
    roofline instead, the scratch still measured (``karma_fx.pricing``). ``compiler``: ``"inductor"`` (the default, or
    ``$KARMA_COMPILER``) compiles the planned graphs with Inductor, as ``torch.compile`` would, the copies and
    waits kept where the plan put them (``karma_fx.inductor``); ``"eager"`` runs them op by op. With
    ``optimizer=`` or ``data_parallel=`` the backward graph hands each gradient to the pipeline through the
    operator ``karma::gradient_ready``, which Inductor compiles as an extern kernel; such graphs are compiled
    as planned ones (no reordering, neither buffer nor in-place reuse). Inductor before torch 2.10 drops an extern kernel
    that returns nothing, so there those doors run op by op by default, and ``compiler="inductor"`` with them is
    refused. ``loss_chunk``: a cross-entropy over a linear layer's logits computed
    that many tokens at a time (``karma_fx.loss_ops``), never holding the whole ``[tokens, vocabulary]`` logits,
    their log-softmax or their gradient; ``0`` never; ``None`` (default) as the planner decides.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"karma_fx.compile takes an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not callable(optimizer):
        raise KarmaError("optimizer must be a callable that builds a torch.optim.Optimizer from a parameter list, "
                         "e.g. functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)")
    if (optimizer is not None or data_parallel) and not inductor_keeps_hand_overs():
        if compiler == "inductor":
            raise UnsupportedModelError(
                f'compiler="inductor" takes optimizer= and data_parallel= from torch 2.10 on (this is torch '
                f'{torch.__version__}): an older Inductor drops the call that hands each gradient to the pipeline, '
                'and the parameters would silently not be updated; use compiler="eager" or a newer torch')
        compiler = "eager"
    config = KarmaConfig.make(budget=budget, strategy=strategy, device=device, offload_weights=offload_weights,
                              time_limit_s=time_limit_s, plan_cache=plan_cache, costs=costs, compiler=compiler,
                              loss_chunk=loss_chunk)
    return KarmaModule(model, config, optimizer, data_parallel, bucket_bytes, max_grad_norm)
