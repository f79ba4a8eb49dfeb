"""Gradients leave backward as soon as they exist: bucketed all-reduce across ranks and the host optimizer.

``karma_fx.compile(model, ..., optimizer=..., data_parallel=True)`` inserts a call to ``gradient_ready`` into
the emitted backward graph right after each parameter's gradient is produced and the parameter's last
backward use (so updating it in place cannot change what backward still reads), and ``backward_done`` before
the graph returns. The ``GradientPipeline`` behind those calls:

- groups gradients, in the order backward produces them, into buckets of ``bucket_bytes``; a full bucket is
  flattened and all-reduced with ``torch.distributed.all_reduce(async_op=True)`` at once, so the exchange
  runs (on the process group's own threads with gloo, its own stream with NCCL) while backward goes on;
- with an optimizer, a worker thread takes each bucket once reduced, averages it and applies PyTorch's own
  optimizer (one instance per bucket, e.g. ``torch.optim.AdamW(..., fused=True)`` on the host) to those
  parameters while the rest of backward runs. Such parameters get no ``.grad`` from backward: the optimizer
  consumed it. The next forward waits for the updates;
- without an optimizer, ``backward_done`` waits for the exchange and writes the averaged gradients back
  before autograd sees them, so ``.grad`` is the global average, as with ``DistributedDataParallel``.

On CUDA the host update works on fp32 master copies in pinned host memory: the reduced gradient is copied
out, the master is updated, and the parameter is refreshed from it. On the CPU the parameter is its own
master. Events with wall-clock times are kept per step (``trace_events``) as evidence of the overlap.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from karma_fx.errors import KarmaError

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
DEFAULT_BUCKET_BYTES = 25 << 20

_pipelines: dict[int, "GradientPipeline"] = {}
_ids = itertools.count()


class ExchangeError(KarmaError):
    """A collective failed: a rank died, or did not answer within the process group's timeout."""


@dataclass
class _Bucket:
    slots: list[int]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    handle: Any = None
    flat: torch.Tensor | None = None


class GradientPipeline:
    """Per compiled module: which parameters, how to exchange their gradients and how to update them."""

    def __init__(self, params: list[torch.nn.Parameter], *, optimizer: OptimizerFactory | None = None,
                 data_parallel: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise KarmaError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.params = params
        self.optimizer_factory = optimizer
        self.bucket_bytes = bucket_bytes
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
        self._order: list[int] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._optimizer_of: dict[int, torch.optim.Optimizer] = {}
        self._masters: dict[int, torch.Tensor] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="karma-host-update") \
            if optimizer is not None else None
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self.trace_events: list[tuple[str, str, float, float]] = []
        """(name, category, start s, end s) of the last step: all-reduces, host updates, backward."""
        self._backward_start = 0.0

    @property
    def consumes_gradients(self) -> bool:
        return self.optimizer_factory is not None

    # ---- set up once the backward graph is known --------------------------------------------------
    def set_order(self, slots: list[int]) -> None:
        """Parameter slots in the order backward produces their gradients; makes the buckets.

        A tied weight has a slot per name, but its gradients are summed inside the graph
        (``sum_tied_gradients``), so backward hands each weight to the pipeline through one slot only."""
        if len({id(self.params[slot]) for slot in slots}) != len(slots):
            raise KarmaError("a tied weight reached the gradient pipeline through two slots: its gradients must "
                             "be summed in the graph first (karma_fx.passes.partition.sum_tied_gradients)")
        self._order = list(slots)
        self._buckets, current, size = [], [], 0
        for slot in slots:
            current.append(slot)
            size += self.params[slot].numel() * self.params[slot].element_size()
            if size >= self.bucket_bytes:
                self._buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self._buckets.append(_Bucket(current))
        self._bucket_of = {slot: k for k, b in enumerate(self._buckets) for slot in b.slots}
        if self.optimizer_factory is not None:
            # One optimizer per bucket, made the first time its parameters appear and kept for good (its state
            # is the training state). A later graph may bucket differently: stepping an optimizer only updates
            # the parameters that have a gradient, and its state is per parameter, so that stays exact.
            for bucket in self._buckets:
                new = [slot for slot in bucket.slots if slot not in self._optimizer_of]
                if not new:
                    continue
                masters = [self._master(slot) for slot in new]
                try:
                    optimizer = self.optimizer_factory(masters)
                except Exception as exc:  # noqa: BLE001 - a bad factory is the user's to fix
                    raise KarmaError(f"optimizer factory failed on a bucket of {len(masters)} parameters: "
                                     f"{type(exc).__name__}: {exc}") from exc
                if not isinstance(optimizer, torch.optim.Optimizer):
                    raise KarmaError(f"optimizer must build a torch.optim.Optimizer, got {type(optimizer).__name__}")
                self._optimizers.append(optimizer)
                self._optimizer_of.update({slot: optimizer for slot in new})

    def _master(self, slot: int) -> torch.nn.Parameter:
        p = self.params[slot]
        if p.device.type == "cpu":
            return p
        master = torch.nn.Parameter(p.detach().to("cpu", torch.float32).pin_memory())
        self._masters[slot] = master
        return master

    @property
    def buckets(self) -> list[list[int]]:
        return [list(b.slots) for b in self._buckets]

    # ---- during backward --------------------------------------------------------------------------
    def ready(self, grad: torch.Tensor, slot: int) -> None:
        if not self._buckets:
            return
        if slot == self._order[0]:
            self._backward_start = time.perf_counter()
            self.trace_events = []
        bucket = self._buckets[self._bucket_of[slot]]
        bucket.grads[slot] = grad
        if len(bucket.grads) < len(bucket.slots):
            return
        k = self._bucket_of[slot]
        if self.group is not None:
            import torch.distributed as dist

            bucket.flat = torch.cat([bucket.grads[s].reshape(-1) for s in bucket.slots])
            start = time.perf_counter()
            try:
                bucket.handle = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            except RuntimeError as exc:
                raise _exchange_error(k, exc) from exc
            self.trace_events.append((f"all-reduce bucket {k} issued", "allreduce", start, time.perf_counter()))
        if self._worker is not None:
            self._pending.append(self._worker.submit(self._update, k))

    def _reduced(self, k: int) -> list[torch.Tensor]:
        """Bucket ``k``'s gradients, averaged over the ranks (waits for its all-reduce)."""
        bucket = self._buckets[k]
        if bucket.handle is None:
            return [bucket.grads[s] for s in bucket.slots]
        start = time.perf_counter()
        try:
            bucket.handle.wait()
        except RuntimeError as exc:
            raise _exchange_error(k, exc) from exc
        self.trace_events.append((f"all-reduce bucket {k} done", "allreduce", start, time.perf_counter()))
        assert bucket.flat is not None
        bucket.flat.div_(self.world_size)
        out, offset = [], 0
        for s in bucket.slots:
            g = bucket.grads[s]
            out.append(bucket.flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.handle = None
        return out

    def _update(self, k: int) -> None:
        grads = self._reduced(k)
        start = time.perf_counter()
        bucket = self._buckets[k]
        masters = [self._masters.get(s, self.params[s]) for s in bucket.slots]
        for master, g in zip(masters, grads):
            master.grad = g.detach().to(master.device, master.dtype, non_blocking=False)
        for optimizer in {id(self._optimizer_of[s]): self._optimizer_of[s] for s in bucket.slots}.values():
            optimizer.step()
        for slot, master in zip(bucket.slots, masters):
            master.grad = None
            if slot in self._masters:
                with torch.no_grad():
                    self.params[slot].copy_(master, non_blocking=True)
        bucket.grads.clear()
        bucket.flat = None
        self.trace_events.append((f"host update bucket {k}", "update", start, time.perf_counter()))

    def done(self) -> None:
        """End of backward: without an optimizer, wait for the exchange and write the averages back."""
        end = time.perf_counter()
        self.trace_events.append(("backward", "backward", self._backward_start, end))
        if self._worker is not None:
            return
        for k, bucket in enumerate(self._buckets):
            if bucket.handle is not None:
                for s, avg in zip(bucket.slots, self._reduced(k)):
                    bucket.grads[s].copy_(avg)
            bucket.grads.clear()
            bucket.flat = None

    def wait_updates(self) -> None:
        """Block until every host update of the last step has been applied (called before the next forward)."""
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


def _exchange_error(bucket: int, exc: Exception) -> ExchangeError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ExchangeError(f"the gradient all-reduce of bucket {bucket} failed: a rank died or did not answer within "
                         f"the process group's timeout ({type(exc).__name__}: {first})")


def gradient_ready(grad: torch.Tensor, pipeline: int, slot: int) -> None:
    """Called from the backward graph: ``grad`` (of parameter ``slot``) is final and the parameter is no
    longer read by backward."""
    _pipelines[pipeline].ready(grad, slot)


def backward_done(pipeline: int) -> None:
    """Called from the backward graph just before it returns."""
    _pipelines[pipeline].done()


def _storage_of(node: fx.Node) -> Any:
    from karma_fx.passes.liveness import storage_key

    val = node.meta.get("val")
    return storage_key(val) if isinstance(val, torch.Tensor) else None


def _readers_by_storage(nodes: list[fx.Node]) -> dict[Any, list[fx.Node]]:
    """For each (fake) storage, the nodes reading any tensor that lives in it."""
    readers: dict[Any, list[fx.Node]] = {}
    for node in nodes:
        key = _storage_of(node)
        if key is not None:
            readers.setdefault(key, []).extend(u for u in node.users if u.op != "output")
    return readers


def param_storages_of(fw: fx.GraphModule, param_slots: list[int]) -> dict[int, Any]:
    """Storage identity of each parameter, read from the forward graph's placeholders (``primals_{slot+1}``)."""
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    return {slot: _storage_of(placeholders[slot]) for slot in param_slots if slot < len(placeholders)}


def insert_gradient_hooks(bw: fx.GraphModule, param_slots: list[int], pipeline: GradientPipeline,
                          param_storages: dict[int, Any]) -> fx.GraphModule:
    """Add the ``gradient_ready`` / ``backward_done`` calls to an emitted backward graph (in place).
    ``param_storages`` (from ``param_storages_of``) says which tensors in it are the parameters."""
    graph = bw.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    output = next(n for n in nodes if n.op == "output")
    outs = list(output.args[0])
    readers = _readers_by_storage(nodes)
    after: list[tuple[int, int, fx.Node]] = []
    for slot in param_slots:
        grad = outs[slot] if slot < len(outs) else None
        if not isinstance(grad, fx.Node):
            continue
        # The parameter may reach backward as itself or as views saved by the forward (``t`` of a weight):
        # every reader of its storage must have run before the optimizer may update it in place.
        users = readers.get(param_storages.get(slot), [])
        anchor = max([grad] + users, key=position.__getitem__)
        after.append((position[anchor], slot, anchor))
    after.sort(key=lambda e: (e[0], e[1]))
    for _, slot, anchor in reversed(after):
        with graph.inserting_after(anchor):
            graph.call_function(gradient_ready, (outs[slot], pipeline.id, slot))
    with graph.inserting_before(output):
        graph.call_function(backward_done, (pipeline.id,))
    if pipeline.consumes_gradients:
        consumed = {slot for _, slot, _ in after}
        output.args = (tuple(None if i in consumed else o for i, o in enumerate(outs)),)
    graph.lint()
    bw.recompile()
    pipeline.set_order([slot for _, slot, _ in after])
    return bw
