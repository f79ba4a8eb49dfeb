"""Runtime ops: ``torch.ops.karma.offload`` / ``prefetch`` / ``wait`` (names are a public contract: tools
outside the project recognise host-tier tensors as the outputs of ``karma.offload``).

On CUDA the copies run on two dedicated streams, ordered with events:

* ``offload(x)``: the D2H stream waits for the compute stream (``x`` is produced), copies ``x`` into a pinned
  host buffer from a pool, and ``x.record_stream(d2h)`` keeps the source's memory from being reused until the
  copy is done even if the graph drops ``x`` right away; the copy's completion event is remembered.
* ``prefetch(host, device)``: the H2D stream waits for that offload's event, copies into a device buffer
  allocated on the compute stream (``record_stream`` again), and remembers its completion event.
* ``wait(t)``: the compute stream waits for ``t``'s copy event; returns ``t`` (an alias), so a graph orders
  the first use after the wait.

On a CPU the same ops copy synchronously (no streams, no pinning), so every graph that uses them runs and is
tested here. Every op has a fake kernel, so graphs containing them trace under ``FakeTensorMode``.

Example::

    host = torch.ops.karma.offload(x)            # CPU tensor, a copy of x
    back = torch.ops.karma.prefetch(host, x.device)
    y = torch.ops.karma.wait(back) * 2
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostPool", "host_pool", "is_host_tier"]


class HostPool:
    """Host buffers reused across steps, keyed by (bytes, pinned): re-pinning memory every step is slow, and a
    pool that stops growing after the first step is how a steady training loop should look."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.hits = 0
        self.misses = 0

    def take(self, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        """An uninitialised host tensor with ``like``'s shape, dtype and strides (when dense), so views that
        the backward takes of the tensor work on its copy too."""
        nbytes = like.numel() * like.element_size()
        key = (nbytes, pinned)
        with self._lock:
            storage = self._free[key].pop() if self._free[key] else None
            if storage is None:
                self.misses += 1
                self.allocated_bytes += nbytes
            else:
                self.hits += 1
        if storage is None:
            storage = torch.UntypedStorage(nbytes, device="cpu")
            if pinned:
                storage = storage.pin_memory()
        out = torch.empty(0, dtype=like.dtype, device="cpu").set_(storage, 0, like.shape, dense_strides(like))
        weakref.finalize(out, self._give_back, key, storage)
        return out

    def _give_back(self, key: tuple[int, bool], storage: torch.UntypedStorage) -> None:
        with self._lock:
            self._free[key].append(storage)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.allocated_bytes = 0


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides if its elements fill a dense block (any dimension order), else contiguous strides."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda e: e[1]):
        if stride != expected:
            break
        expected *= size
    else:
        return tuple(t.stride())
    contiguous, running = [], 1
    for size in reversed(t.shape):
        contiguous.append(running)
        running *= max(size, 1)
    return tuple(reversed(contiguous))


host_pool = HostPool()
_copy_done: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → CUDA event of the copy that made it
_streams: dict[tuple[int, str], object] = {}


def _side_stream(device: torch.device, which: str):
    key = (device.index if device.index is not None else torch.cuda.current_device(), which)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=device)
    return _streams[key]


def is_host_tier(t: torch.Tensor) -> bool:
    """Whether ``t`` came out of ``karma.offload`` (and is still alive)."""
    return t in _host_tier


_host_tier: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _copy_on(stream, dst: torch.Tensor, src: torch.Tensor, keep_alive: torch.Tensor):
    """Copy ``src`` into ``dst`` on ``stream`` (already ordered after what produced ``src``); the caching
    allocator does not reuse ``keep_alive``'s memory until the copy is done. Returns the copy's event."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        keep_alive.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return done


@torch.library.custom_op("karma::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """Copy ``x`` to host memory (pinned, asynchronous on CUDA); returns the host tensor."""
    if x.is_cuda:
        compute = torch.cuda.current_stream(x.device)
        d2h = _side_stream(x.device, "d2h")
        d2h.wait_stream(compute)
        host = host_pool.take(x, pinned=True)
        _copy_done[host] = _copy_on(d2h, host, x, keep_alive=x)
    else:
        host = host_pool.take(x, pinned=False)
        host.copy_(x)
    _host_tier[host] = True
    return host


@offload.register_fake
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, dense_strides(x), dtype=x.dtype, device="cpu")


@torch.library.custom_op("karma::prefetch", mutates_args=())
def prefetch(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor back to ``device`` (asynchronous on CUDA, after its offload landed)."""
    device = torch.device(device)
    if device.type == "cuda":
        compute = torch.cuda.current_stream(device)
        h2d = _side_stream(device, "h2d")
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)  # compute stream's
        h2d.wait_stream(compute)
        landed = _copy_done.get(host)
        if landed is not None:
            h2d.wait_event(landed)
        _copy_done[out] = _copy_on(h2d, out, host, keep_alive=out)
        return out
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    return out.copy_(host)


@prefetch.register_fake
def _prefetch_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


_lib = torch.library.Library("karma", "FRAGMENT")
_lib.define("wait(Tensor(a) t) -> Tensor(a)")


def _wait(t: torch.Tensor) -> torch.Tensor:
    """Make the compute stream wait for the copy that produced ``t``; returns ``t`` (an alias)."""
    event = _copy_done.get(t) if t.is_cuda else None
    if event is not None:
        torch.cuda.current_stream(t.device).wait_event(event)
    return torch.ops.aten.alias(t)


_lib.impl("wait", _wait, "CompositeExplicitAutograd")
