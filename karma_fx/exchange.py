"""Gradients leave backward as soon as they are final: bucketed all-reduce across ranks and the host optimizer.

``karma_fx.compile(model, ..., optimizer=..., data_parallel=True)`` makes each emitted backward graph call
``gradient_ready(grad, param, pipeline)`` (``karma_fx.passes.gradient_hooks``) right after a parameter's gradient is produced and after the
parameter's last read in that graph (so updating it in place cannot change what backward still reads), and
returns no gradient for it: the ``GradientPipeline`` takes it from there.

- Parameters are known by identity, not by position: a region of a graph-broken model that runs several
  times (one compiled block, six layers) hands over a different parameter on each run. Each forward run of a
  region announces the parameters whose gradients its backward will produce (``expect``); a gradient is
  final when every announced use has reported (a weight read by two runs gets the sum of both).
- Final gradients fill buckets of ``bucket_bytes`` in the order they become final; a full bucket is
  flattened and all-reduced with ``torch.distributed.all_reduce(async_op=True)`` at once (data parallel), so
  the exchange runs while backward goes on, and handed to a worker thread that applies the optimizer to
  those parameters (one PyTorch optimizer over every parameter: a step only touches parameters with a
  ``.grad``, so stepping it bucket by bucket is exact and its state and ``param_groups`` are the usual ones,
  for LR schedulers and ``state_dict()``).
- The step's backward is over when every announced gradient is final: the last partial bucket is sent, and
  the call waits for the exchange and the updates, so when ``loss.backward()`` returns the parameters are
  updated (with an optimizer) or ``.grad`` holds the global average (without one), as with
  ``DistributedDataParallel``.
- ``no_sync()``: gradients are added to ``.grad`` and nothing is exchanged or updated (gradient
  accumulation); the next step outside it takes the accumulated ``.grad`` into its update.
- ``max_grad_norm``: updates wait for the whole backward, the global norm is computed (after the exchange),
  gradients are scaled as ``torch.nn.utils.clip_grad_norm_`` does, then the optimizer steps.

- Lifetime: Dynamo keeps every compiled module's backend and graphs (until ``torch._dynamo.reset()``), and
  they reach the pipeline; ``tie_to(module)`` makes the module's deletion ``close`` it, which lets go of the
  parameters, the optimizer state, the master copies and the worker thread.

On CUDA the host update works on fp32 master copies in pinned host memory: the reduced gradient is copied
out, the master is updated, and the parameter is refreshed from it. On the CPU the parameter is its own
master. Events with wall-clock times are kept per step (``trace_events``) as evidence of the overlap.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from karma_fx.caller_state import mark_host_optimizer
from karma_fx.errors import KarmaError
from karma_fx.runtime import landed

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
DEFAULT_BUCKET_BYTES = 25 << 20

_pipelines: "weakref.WeakValueDictionary[int, GradientPipeline]" = weakref.WeakValueDictionary()
"""Held weakly: a deleted compiled module takes its pipeline, optimizer state and master copies with it."""
_ids = itertools.count()


class ExchangeError(KarmaError):
    """A collective failed: a rank died, or did not answer within the process group's timeout."""


@dataclass
class _Bucket:
    slots: list[int] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    size_bytes: int = 0
    handle: Any = None
    flat: torch.Tensor | None = None


class GradientPipeline:
    """Per compiled module: which parameters, how to exchange their gradients and how to update them."""

    def __init__(self, params: list[torch.nn.Parameter], *, optimizer: OptimizerFactory | None = None,
                 data_parallel: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 max_grad_norm: float | None = None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise KarmaError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise KarmaError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        self.params = list(params)
        self._slot = {id(p): i for i, p in enumerate(self.params)}
        self.bucket_bytes = bucket_bytes
        self.max_grad_norm = max_grad_norm
        self.group: Any = None
        self.world_size = 1
        if data_parallel:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise KarmaError("data_parallel=True needs torch.distributed initialised first: launch with "
                                 "torchrun and call torch.distributed.init_process_group('nccl' or 'gloo')")
            self.group = dist.group.WORLD
            self.world_size = dist.get_world_size()
        self.id = next(_ids)
        _pipelines[self.id] = self
        self._masters: dict[int, torch.Tensor] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        if optimizer is not None:
            masters = [self._master(i) for i in range(len(self.params))]
            try:
                built = optimizer(masters)
            except Exception as exc:  # noqa: BLE001 - a bad factory is the user's to fix
                raise KarmaError(f"the optimizer factory failed on the model's {len(masters)} parameters: "
                                 f"{type(exc).__name__}: {exc}") from exc
            if not isinstance(built, torch.optim.Optimizer):
                raise KarmaError(f"optimizer must build a torch.optim.Optimizer, got {type(built).__name__}")
            mark_host_optimizer(built)  # its state is host memory: no step's device budget counts it
            self.optimizer = built
        self._worker_threads: set[int] = set()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="karma-host-update",
                                          initializer=_note_thread, initargs=(self._worker_threads,)) \
            if optimizer is not None else None
        weakref.finalize(self, _shutdown, self._worker)
        self.closed = False
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._expected: dict[int, int] = {}
        self._partial: dict[int, torch.Tensor] = {}
        self._bucket = _Bucket()
        self._sent: list[_Bucket] = []
        self._final: list[tuple[int, torch.Tensor]] = []
        self.accumulating = False
        self._read: set[int] = set()
        """ids of the tensors this step's forward runs read (``expect``)."""
        self.buckets: list[list[int]] = []
        """Parameter indices per bucket, in the order the last step sent them."""
        self.trace_events: list[tuple[str, str, float, float]] = []
        """(name, category, start s, end s) of the last step: all-reduces, host updates, backward."""
        self._backward_start: float | None = None

    # ---- lifetime ---------------------------------------------------------------------------------------
    def tie_to(self, owner: object) -> None:
        """Close this pipeline when ``owner`` (the compiled module) is garbage collected.

        Deleting the compiled module does not free the pipeline itself: Dynamo keeps the backend and the
        compiled graphs of every module it compiled (its backend cache, and the cache entries on the model
        class's ``forward`` code) until ``torch._dynamo.reset()``, and those reach the pipeline. Tied to its
        owner, the pipeline lets go of what is large (parameters, optimizer state, master copies, the worker
        thread) when the owner goes, whoever still holds the empty shell."""
        weakref.finalize(owner, _close, weakref.ref(self))

    def close(self) -> None:
        """Let go of the parameters, the optimizer and its state, the master copies and the worker thread
        (ended, after the update it is running if any; queued ones are cancelled: nobody can see them now).
        Idempotent; a pipeline closed cannot take gradients any more."""
        if self.closed:
            return
        self.closed = True
        _pipelines.pop(self.id, None)
        worker, self._worker = self._worker, None
        if worker is not None:
            # A finalizer may run on any thread, the worker's own included, and a thread cannot wait for itself.
            worker.shutdown(wait=threading.get_ident() not in self._worker_threads, cancel_futures=True)
        self.params, self._slot, self._masters, self.optimizer = [], {}, {}, None
        self._pending, self._expected, self._partial, self._final = [], {}, {}, []
        self._bucket, self._sent = _Bucket(), []

    def _check_open(self) -> None:
        if self.closed:
            raise KarmaError("this compiled module was deleted: its host optimizer and gradient pipeline are "
                             "closed; keep the module karma_fx.compile returned alive while you train with it")

    def _master(self, slot: int) -> torch.Tensor:
        p = self.params[slot]
        if p.device.type == "cpu":
            return p
        master = torch.nn.Parameter(p.detach().to("cpu", torch.float32).pin_memory())
        self._masters[slot] = master
        return master

    def knows(self, param: torch.Tensor) -> bool:
        return id(param) in self._slot

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients into ``.grad``: no exchange, no update, until the first step outside."""
        previous, self.accumulating = self.accumulating, True
        try:
            yield
        finally:
            self.accumulating = previous

    # ---- announced by each forward run of a region ----------------------------------------------------
    def expect(self, params: list[torch.Tensor], inputs: list[Any] = ()) -> None:
        """A forward run whose backward will produce gradients for ``params``; ``inputs``: all it reads. A held
        ``.grad`` among them (a forward that reads a gradient) may be saved for the backward, so it is not added
        into in place (``_accumulated``) before this backward is over."""
        self._check_open()
        self.wait_updates()
        self._read.update(id(t) for t in inputs if isinstance(t, torch.Tensor))
        for p in params:
            slot = self._slot.get(id(p))
            if slot is None:
                raise KarmaError("a parameter that was not in the model when karma_fx.compile was called "
                                 "reached the host optimizer; build the optimizer again (karma_fx.compile "
                                 "the model anew) after adding or replacing parameters")
            self._expected[slot] = self._expected.get(slot, 0) + 1

    def unexpect(self, param_ids: list[int]) -> None:
        """Take back a forward run's ``expect`` (by the ids of the parameters it announced): its outputs were
        dropped with no backward (an evaluation with gradients on), so its gradients will never come."""
        for pid in param_ids:
            slot = self._slot.get(pid)
            if slot is not None and slot in self._expected:
                self._expected[slot] -= 1
                if self._expected[slot] <= 0:
                    del self._expected[slot]
                    self._partial.pop(slot, None)

    # ---- during backward --------------------------------------------------------------------------
    def ready(self, grad: torch.Tensor, param: torch.Tensor) -> None:
        self._check_open()
        slot = self._slot.get(id(param))
        if slot is None or slot not in self._expected:
            raise KarmaError("a gradient reached the host pipeline for a parameter no forward announced; "
                             "this is a bug in karma_fx, please report it")
        if self._backward_start is None:
            self._backward_start = time.perf_counter()
            self.trace_events = []
        # Keep the very tensor the graph hands over (no .detach()): a host copy made by karma.offload goes back
        # to the host-buffer pool when that Python tensor dies, and a view of it would then be overwritten.
        # A gradient sent to the host (weights out of core) may still be in flight: every read of it on the host
        # waits for its copy first (``landed``); the bucket's host update does so on its worker, off backward.
        if slot in self._partial:
            grad = landed(self._partial.pop(slot)) + landed(grad)
        self._expected[slot] -= 1
        if self._expected[slot] > 0:
            self._partial[slot] = grad
            return
        del self._expected[slot]
        p = self.params[slot]
        read = p.grad is not None and id(p.grad) in self._read
        if self.accumulating:
            p.grad = landed(grad).clone() if p.grad is None else _accumulated(p.grad, landed(grad), read)
        else:
            if p.grad is not None:  # accumulated under no_sync(): this step's update takes it in
                grad = _accumulated(p.grad, landed(grad), read)
                p.grad = None
            self._add(slot, grad)
        if not self._expected:
            self._end_of_backward()

    def _add(self, slot: int, grad: torch.Tensor) -> None:
        if self.max_grad_norm is not None and self.group is None:
            self._final.append((slot, grad))
            return
        bucket = self._bucket
        bucket.slots.append(slot)
        bucket.grads.append(grad)
        bucket.size_bytes += grad.numel() * grad.element_size()
        if bucket.size_bytes >= self.bucket_bytes:
            self._send()

    def _send(self) -> None:
        bucket, self._bucket = self._bucket, _Bucket()
        if not bucket.slots:
            return
        k = len(self._sent)
        self._sent.append(bucket)
        if self.group is not None:
            import torch.distributed as dist

            bucket.flat = torch.cat([landed(g).reshape(-1) for g in bucket.grads])
            start = time.perf_counter()
            try:
                bucket.handle = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            except RuntimeError as exc:
                raise _exchange_error(f"the gradient all-reduce of bucket {k}", exc) from exc
            self.trace_events.append((f"all-reduce bucket {k} issued", "allreduce", start, time.perf_counter()))
        if self._worker is not None and self.max_grad_norm is None:
            self._pending.append(self._worker.submit(self._update, k))

    def _reduced(self, k: int) -> list[torch.Tensor]:
        """Bucket ``k``'s gradients, averaged over the ranks (waits for its all-reduce)."""
        bucket = self._sent[k]
        if bucket.handle is None:
            return [landed(g) for g in bucket.grads]
        start = time.perf_counter()
        try:
            bucket.handle.wait()
        except RuntimeError as exc:
            raise _exchange_error(f"the gradient all-reduce of bucket {k}", exc) from exc
        self.trace_events.append((f"all-reduce bucket {k} done", "allreduce", start, time.perf_counter()))
        assert bucket.flat is not None
        bucket.flat.div_(self.world_size)
        out, offset = [], 0
        for g in bucket.grads:
            out.append(bucket.flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.handle, bucket.grads = None, out
        return out

    def _apply(self, slots: list[int], grads: list[torch.Tensor], label: str) -> None:
        assert self.optimizer is not None
        start = time.perf_counter()
        masters = [self._masters.get(s, self.params[s]) for s in slots]
        for master, g in zip(masters, grads):
            master.grad = g.detach().to(master.device, master.dtype)
        self.optimizer.step()
        for slot, master in zip(slots, masters):
            master.grad = None
            if slot in self._masters:
                with torch.no_grad():
                    self.params[slot].copy_(master, non_blocking=True)
        self.trace_events.append((label, "update", start, time.perf_counter()))

    def _update(self, k: int) -> None:
        with self._lock:
            self._apply(self._sent[k].slots, self._reduced(k), f"host update bucket {k}")

    def _end_of_backward(self) -> None:
        """Every announced gradient is final: send the last bucket, then wait for what is in flight."""
        self._read = set()
        self._send()
        end = time.perf_counter()
        self.trace_events.append(("backward", "backward", self._backward_start or end, end))
        self._backward_start = None
        if self.accumulating:
            # no_sync(): every gradient went to ``.grad``; nothing was sent, nothing is clipped or updated. The
            # first backward outside takes ``.grad`` in, and clips the accumulated total, as eager training does.
            return
        self.buckets = [list(b.slots) for b in self._sent]
        try:
            if self.max_grad_norm is not None:
                self._clip_and_update()
            elif self.optimizer is None:
                for k, bucket in enumerate(self._sent):
                    for slot, avg in zip(bucket.slots, self._reduced(k)):
                        self.params[slot].grad = avg.to(self.params[slot].dtype)
            self.wait_updates()
        finally:
            self._sent = []

    def _clip_and_update(self) -> None:
        slots, grads = [s for s, _ in self._final], [landed(g) for _, g in self._final]
        for k, bucket in enumerate(self._sent):
            slots += bucket.slots
            grads += self._reduced(k)
        self._final = []
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        grads = [g * scale.to(g.dtype) for g in grads]
        self.last_grad_norm = float(norm)
        if self.optimizer is None:
            for slot, g in zip(slots, grads):
                self.params[slot].grad = g
        else:
            self._apply(slots, grads, "host update (clipped)")

    def wait_updates(self) -> None:
        """Block until every host update in flight has been applied."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        if self._masters and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    def chrome_trace(self) -> dict:
        """The last step's events as a Chrome/Perfetto trace (one row per category)."""
        base = min((e[2] for e in self.trace_events), default=0.0)
        rows = {"backward": 0, "allreduce": 1, "update": 2}
        return {"traceEvents": [
            {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": rows[cat], "ts": (s - base) * 1e6,
             "dur": max((e - s) * 1e6, 1.0)} for name, cat, s, e in self.trace_events]}


def _accumulated(held: torch.Tensor, grad: torch.Tensor, read: bool = False) -> torch.Tensor:
    """``held + grad``, added into ``held`` where autograd's own accumulation would add in place (same shape,
    dtype and device, dense, no graph being built): the accumulated gradient keeps its storage, as ``.grad``
    does in eager training, and the step holds no third tensor of the parameter's size while it adds. Never
    into a ``held`` that a forward of the step ``read`` (its backward may read it after this call)."""
    if (not read and held.shape == grad.shape and held.dtype == grad.dtype and held.device == grad.device
            and held.layout == grad.layout == torch.strided and not torch.is_grad_enabled()):
        return held.add_(grad)
    return held + grad


def _shutdown(worker: ThreadPoolExecutor | None) -> None:
    if worker is not None:
        worker.shutdown(wait=False)


def _close(pipeline: "weakref.ref[GradientPipeline]") -> None:
    alive = pipeline()
    if alive is not None:
        alive.close()


def _note_thread(threads: set[int]) -> None:
    """The worker's initializer: remember its thread, so ``close`` never waits for the thread it runs on."""
    threads.add(threading.get_ident())


def _exchange_error(what: str, exc: Exception) -> ExchangeError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ExchangeError(f"{what} failed: a rank died or did not answer within the process group's timeout "
                         f"({type(exc).__name__}: {first})")


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Start every rank from rank 0's weights and buffers, as ``DistributedDataParallel`` does."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            try:
                dist.broadcast(t.data, src=0)
            except RuntimeError as exc:
                raise _exchange_error("the initial broadcast of rank 0's weights", exc) from exc


def gradient_ready(grad: torch.Tensor, param: torch.Tensor, pipeline: int,
                   read_before: list[torch.Tensor] | tuple = ()) -> None:
    """Called from the backward graph: ``grad`` of ``param`` is produced and backward reads neither any more.
    ``read_before``: results computed from ``param`` that must exist before it is updated (under Inductor they
    would otherwise be computed later, inside the kernels that read them); the call only has to follow them."""
    target = _pipelines.get(pipeline)
    if target is None:  # closed with its module, or collected: the backward outlived the compiled module
        raise KarmaError("the compiled module this backward belongs to was deleted before its backward ran: its "
                         "host optimizer and gradient pipeline are closed; keep the module karma_fx.compile "
                         "returned alive until loss.backward() has returned")
    target.ready(grad, param)


# ``karma::gradient_ready``: the call the backward graph makes, as an operator, so that Inductor compiles the
# graph that makes it (a Python function in an FX graph is not something Inductor lowers). It returns nothing
# and is registered as having a side effect, so neither FX's dead-code elimination nor Inductor's scheduler
# drops it. It declares no mutation of ``param`` although the host optimizer updates the parameter after it:
# a declared mutation would bump the parameter's version, and another region's backward that saved the same
# parameter would then refuse to run; the hand-over is placed after the parameter's last read in its graph
# (``karma_fx.passes.partition.hand_over_gradients``), a graph that makes it is compiled with Inductor's
# reordering off (``karma_fx.inductor.PLAN_SAFE_CONFIG``), and the backward's results computed from the
# parameter are its inputs (``read_before``), so that Inductor computes them before the call, not inside a
# later kernel. Inductor before 2.10 drops an extern kernel without outputs unless its schema mutates
# something (it does not consult the side-effect registry): ``karma_fx.compiler`` keeps those versions eager.
_lib = torch.library.Library("karma", "FRAGMENT")
_lib.define("gradient_ready(Tensor grad, Tensor param, int pipeline, Tensor[] read_before) -> ()")
_lib.impl("gradient_ready", gradient_ready, "CompositeExplicitAutograd")
_lib.impl("gradient_ready", lambda grad, param, pipeline, read_before: None, "Meta")
torch.fx.node.has_side_effect(torch.ops.karma.gradient_ready.default)
