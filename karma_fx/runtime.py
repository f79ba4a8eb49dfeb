"""Runtime ops: ``torch.ops.karma.offload`` / ``prefetch`` / ``wait`` (names are a public contract: tools
outside the project recognise host-tier tensors as the outputs of ``karma.offload``).

Every copy is asynchronous and ordered by events, the same way on every device:

* ``offload(x)``: the D2H copy engine waits for ``x`` to be produced, copies it into a host buffer from a pool,
  and keeps ``x``'s memory from being reused until the copy is done even if the graph drops ``x`` right away;
  the copy's completion event is remembered for the host tensor.
* ``prefetch(host, device)``: the H2D copy engine waits for that offload's event, copies into a device buffer,
  and remembers its completion event for the device tensor.
* ``wait(t)``: compute waits for ``t``'s copy event; returns ``t`` (an alias), so a graph orders the first use
  after the wait. On a host tensor it waits for the offload that fills it (a swap-out that must land), and
  the source that offload held is let go right there.

Device memory a copy reads or writes is held by the compute thread, not by the copy engine: an offload's
source until compute waits for the copy (``wait(host)``, where the plan's ``release_before`` puts it), or
until a later copy op sees the copy done, or until the host tensor dies unwaited (then after
``record_stream`` on CUDA, recorded that late yet still covering the copy queued before it; after blocking on
the copy on a CPU). So a source is freed in compute order where the plan frees it. ``record_stream`` from
the start would free it only when the caching allocator, at some later allocation, sees the copy's event
done; the host runs ahead of the GPU, so that comes later than the plan frees it, by an amount nobody
controls. And a CPU copy thread that dropped the source itself would free it where neither the plan's order
nor the profiler's allocator events (recorded per thread) see it.

Copy engines: on CUDA, two dedicated streams with CUDA events and pinned host buffers; on a
CPU, either two worker threads with futures as events (``copy_mode("threads")``: the CUDA path's ordering logic
runs for real and copies overlap compute) or synchronous copies (``"sync"``, the default: memory is then freed
exactly where the graph drops a tensor, which the measured-peak tests rely on).

The host pool takes a buffer back when its tensor dies, but hands it out again only once every copy that reads
or writes it has finished and no view of it (``.detach()``, a slice) is alive: a buffer dropped by the graph
right after its prefetch was issued is still being read by that copy, and an offload writing into it would
corrupt the prefetched values (silently, on a GPU).

Example::

    host = torch.ops.karma.offload(x)            # CPU tensor, a copy of x
    back = torch.ops.karma.prefetch(host, x.device)
    y = torch.ops.karma.wait(back) * 2
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostPool", "copy_mode", "host_pool", "is_host_tier", "landed", "set_copy_delay"]

COPY_MODE_ENV = "KARMA_CPU_COPIES"


def _done(event: Any) -> bool:
    return event.done() if isinstance(event, Future) else bool(event.query())


def _block(event: Any) -> None:
    if isinstance(event, Future):
        event.result()
    else:
        event.synchronize()


class HostPool:
    """Host buffers reused across steps, keyed by (bytes, pinned): re-pinning memory every step is slow, and a
    pool that stops growing after the first step is how a steady training loop should look. A buffer comes
    back when its tensor dies and goes out again once the copies that touch it (``touch``) have finished."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[tuple[torch.UntypedStorage, list]]] = defaultdict(list)
        self._copies: dict[int, list] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.hits = 0
        self.misses = 0
        self.waited = 0
        """How many times a buffer had to wait for a copy still touching it before going out again."""

    def take(self, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        """An uninitialised host tensor with ``like``'s shape, dtype and strides (when dense), so views that
        the backward takes of the tensor work on its copy too."""
        nbytes = like.numel() * like.element_size()
        key = (nbytes, pinned)
        with self._lock:
            free = self._free[key]
            unshared = [i for i, (storage, _) in enumerate(free) if not _still_viewed(storage)]
            ready = next((i for i in unshared if all(_done(c) for c in free[i][1])), None)
            if ready is None and unshared:
                ready = unshared[0]  # its copies are still running: wait for them below
            entry = free.pop(ready) if ready is not None else None
            if entry is None:
                self.misses += 1
                self.allocated_bytes += nbytes
            else:
                self.hits += 1
        if entry is None:
            storage = torch.UntypedStorage(nbytes, device="cpu")
            if pinned:
                storage = storage.pin_memory()
        else:
            storage, copies = entry
            if not all(_done(c) for c in copies):
                self.waited += 1
            for event in copies:  # a copy still reading or writing this buffer: wait for it, never overwrite
                _block(event)
        out = torch.empty(0, dtype=like.dtype, device="cpu").set_(storage, 0, like.shape, dense_strides(like))
        pointer = storage.data_ptr()
        self._copies[pointer] = []
        weakref.finalize(out, self._give_back, key, storage, pointer)
        return out

    def touch(self, host: torch.Tensor, event: Any) -> None:
        """A copy reading or writing ``host`` (a tensor from ``take``, or a view of one) completes with
        ``event``."""
        copies = self._copies.get(host.untyped_storage().data_ptr())
        if copies is not None:
            copies.append(event)

    def _give_back(self, key: tuple[int, bool], storage: torch.UntypedStorage, pointer: int) -> None:
        with self._lock:
            copies = [c for c in self._copies.pop(pointer, []) if not _done(c)]
            self._free[key].append((storage, copies))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.allocated_bytes = 0


def _still_viewed(storage: torch.UntypedStorage) -> bool:
    """Whether a tensor other than the pool's own handle still holds ``storage`` (a view or ``.detach()`` of a
    host tensor outlives the tensor itself; its buffer must not be handed out again)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and count(storage._cdata) > 1


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
_copy_done: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → event of the copy that made it
_host_tier: WeakIdKeyDictionary = WeakIdKeyDictionary()
_streams: dict[tuple[int, str], object] = {}


def is_host_tier(t: torch.Tensor) -> bool:
    """Whether ``t`` came out of ``karma.offload`` (and is still alive)."""
    return t in _host_tier


# ---- CPU copy engines: worker threads with futures as events ------------------------------------------------
_mode = os.environ.get(COPY_MODE_ENV, "sync")
if _mode not in ("sync", "threads"):  # a typo must not pass unnoticed; importing must not fail either
    import warnings

    warnings.warn(f"karma_fx: {COPY_MODE_ENV}={_mode!r} is neither 'sync' nor 'threads'; copying synchronously",
                  stacklevel=2)
    _mode = "sync"
_workers: dict[str, ThreadPoolExecutor] = {}
_delay_s = {"d2h": 0.0, "h2d": 0.0}


@contextlib.contextmanager
def copy_mode(mode: str) -> Iterator[None]:
    """Run CPU copies ``"sync"`` (default) or on worker ``"threads"`` (one per direction, as CUDA streams)."""
    global _mode
    if mode not in ("sync", "threads"):
        from karma_fx.errors import KarmaError

        raise KarmaError(f"copy mode must be 'sync' or 'threads', got {mode!r}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def keep_freed_host_memory() -> bool:
    """Make the C library keep freed host memory for the next allocation, as CUDA's caching allocator keeps
    device memory; returns whether it took effect (glibc only).

    By default glibc hands blocks over a threshold back to the OS when they are freed and maps fresh pages for
    the next one, so every large tensor pays its page faults again. With a copy worker running beside compute,
    each such unmapping also interrupts the other thread's core (TLB shootdown). A CPU that stands in for a
    device while copies run on threads (``copy_mode("threads")``) then charges a plan for every tensor it
    brings back: on a 2-core machine one ResNet step that swaps 13 tensors took 137-151 ms with glibc's
    defaults and 126-133 ms with this. It changes the whole process's allocator, so nothing calls it for you:
    benchmarks that time steps on a CPU do, before they build anything."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all([mallopt(m_mmap_threshold, 32 << 20) == 1,  # glibc's largest: blocks under 32 MiB reuse the heap
                mallopt(m_trim_threshold, (1 << 31) - 1) == 1,  # and the heap is never shrunk
                mallopt(m_top_pad, 64 << 20) == 1])


def cpu_copies_are_synchronous() -> bool:
    """Whether CPU copies run on the calling thread now (``"sync"``): they then block compute, and plans made
    with measured costs say so."""
    return _mode == "sync"


def set_copy_delay(d2h_s: float = 0.0, h2d_s: float = 0.0) -> None:
    """Slow the CPU copy workers down (tests: a late copy must never be read early or overwritten)."""
    _delay_s.update(d2h=d2h_s, h2d=h2d_s)


def _worker(direction: str) -> ThreadPoolExecutor:
    if direction not in _workers:
        _workers[direction] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"karma-{direction}")
    return _workers[direction]


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """A view of a CPU tensor's memory that does not keep its storage alive: what a CUDA copy engine holds of a
    buffer (a raw pointer). The copy workers touch every tensor through such views, so what keeps a buffer
    from being reused is what does so on a GPU: the pool's copy events for host buffers, the compute thread's
    hold (``_hold``) for device-side tensors."""
    import ctypes

    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    nbytes = span * t.element_size()
    raw = torch.frombuffer((ctypes.c_byte * max(nbytes, 1)).from_address(t.data_ptr()), dtype=torch.uint8)
    return raw[:nbytes].view(t.dtype).as_strided(t.shape, t.stride())


def _threaded_copy(direction: str, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Future:
    """Copy ``src`` into ``dst`` on the ``direction`` worker once ``after`` (an event) is done, holding
    neither: the caller holds the device-side tensor until the copy is done (``_hold``)."""
    dst, src = _unowned(dst), _unowned(src)

    def copy() -> None:
        if after is not None:
            _block(after)
        if _delay_s[direction]:
            time.sleep(_delay_s[direction])
        dst.copy_(src)

    return _worker(direction).submit(copy)


# ---- device memory that copies in flight read or write: held by the compute thread -------------------------
_in_flight: dict[int, tuple[torch.Tensor, Any, Any, int]] = {}
"""id(tensor that ``wait`` is called on: an offload's host tensor, a prefetch's device tensor) → (the device
tensor its copy reads or writes, the copy's event, the CUDA copy stream or None, a serial number)."""
_issued: dict[Any, deque] = defaultdict(deque)
"""Copy engine → (key, serial) of its copies in issue order. An engine finishes its copies in that order (one
CUDA stream, one worker thread), so finished copies are found from the front, without scanning them all."""
_serials = itertools.count()
_in_flight_lock = threading.Lock()


def _hold(key: torch.Tensor, device_side: torch.Tensor, event: Any, stream: Any, engine: Any) -> None:
    """Keep ``device_side`` alive for the copy ``event`` until compute has waited for it (``wait(key)``), or
    until the copy is seen done at a later copy op, or, for an offload, until its host tensor dies unwaited."""
    serial = next(_serials)
    with _in_flight_lock:
        _in_flight[id(key)] = (device_side, event, stream, serial)
        _issued[engine].append((id(key), serial))
    if key is not device_side:
        weakref.finalize(key, _host_died, id(key)).atexit = False


def _let_go(key: torch.Tensor) -> None:
    """Compute has waited for ``key``'s copy: drop what it held, here, in compute order."""
    with _in_flight_lock:
        held = _in_flight.pop(id(key), None)
    del held


def _let_go_of_finished() -> None:
    """Drop what finished copies held (called by every copy op on the compute thread): from the front of each
    engine's copies, up to the first one still running; entries let go already are skipped."""
    held = []
    with _in_flight_lock:
        for issued in _issued.values():
            while issued:
                key, serial = issued[0]
                entry = _in_flight.get(key)
                if entry is not None and entry[3] == serial:
                    if not _done(entry[1]):
                        break
                    held.append(_in_flight.pop(key))
                issued.popleft()
    del held


def _host_died(key: int) -> None:
    """An offload's host tensor died before anything waited for its copy: drop the source once that is safe."""
    with _in_flight_lock:
        held = _in_flight.pop(key, None)
    if held is not None:
        source, event, stream, _ = held
        if stream is not None:  # recorded this late it still covers the copy, queued on that stream before
            source.record_stream(stream)
        elif not _done(event):
            _block(event)


# ---- CUDA copy engines: side streams with events -------------------------------------------------------------
def _side_stream(device: torch.device, which: str):
    key = (device.index if device.index is not None else torch.cuda.current_device(), which)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=device)
    return _streams[key]


def _copy_on(stream, dst: torch.Tensor, src: torch.Tensor):
    """Copy ``src`` into ``dst`` on ``stream`` (already ordered after what produced ``src``); returns the
    copy's event."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


@torch.library.custom_op("karma::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """Copy ``x`` to host memory (pinned, asynchronous on CUDA); returns the host tensor."""
    _let_go_of_finished()
    if x.is_cuda:
        compute = torch.cuda.current_stream(x.device)
        d2h = _side_stream(x.device, "d2h")
        d2h.wait_stream(compute)
        host = host_pool.take(x, pinned=True)
        event = _copy_on(d2h, host, x)
        _hold(host, x, event, d2h, d2h)
    else:
        host = host_pool.take(x, pinned=False)
        if _mode == "threads":
            event = _threaded_copy("d2h", host, x)
            _hold(host, x, event, None, "d2h")
        else:
            host.copy_(x)
            event = None
    if event is not None:
        _copy_done[host] = event
        host_pool.touch(host, event)
    _host_tier[host] = True
    return host


@offload.register_fake
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, dense_strides(x), dtype=x.dtype, device="cpu")


@torch.library.custom_op("karma::prefetch", mutates_args=())
def prefetch(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor back to ``device`` (asynchronous, after its offload landed)."""
    device = torch.device(device)
    _let_go_of_finished()
    landed = _copy_done.get(host)
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)  # compute stream's
    if device.type == "cuda":
        compute = torch.cuda.current_stream(device)
        h2d = _side_stream(device, "h2d")
        h2d.wait_stream(compute)
        if landed is not None:
            h2d.wait_event(landed)
        event = _copy_on(h2d, out, host)
        engine: Any = h2d
    elif _mode == "threads":
        event = _threaded_copy("h2d", out, host, after=landed)
        engine = "h2d"
    else:
        if landed is not None:
            _block(landed)
        return out.copy_(host)
    _copy_done[out] = event
    _hold(out, out, event, None, engine)
    host_pool.touch(host, event)  # the buffer is read until this copy is done
    return out


@prefetch.register_fake
def _prefetch_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@torch.library.custom_op("karma::host_cast", mutates_args=())
def host_cast(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``x`` (a host tensor) cast to ``dtype`` in a host buffer from the pool (pinned when it goes to a CUDA
    ``device``), ``karma_fx.wire``'s two casts: a weight's bf16 copy, which crosses the link instead of the fp32
    master, made once a step with the rounding the device's cast would use; and a gradient sent narrow, widened
    into the one the step returns once its copy has landed (on CUDA that blocks the host for the copy)."""
    landed = _copy_done.get(x)
    if landed is not None:  # ``x`` is a gradient sent to the host narrow (to widen): its copy must have landed
        _block(landed)
    like = torch.empty_like(x, dtype=dtype, device="meta")
    host = host_pool.take(like, pinned=torch.device(device).type == "cuda")
    host.copy_(x)
    _host_tier[host] = True
    return host


@host_cast.register_fake
def _host_cast_fake(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(x.shape, dense_strides(x), dtype=dtype, device="cpu")


def landed(t: torch.Tensor) -> torch.Tensor:
    """Block the calling thread until the copy that fills host tensor ``t`` (an ``offload`` output) has landed;
    returns ``t``. For host code that reads a host copy, such as the host optimizer reading a gradient sent
    to the host: ``wait`` orders compute after the copy, not the host thread (on CUDA it only makes the compute
    stream wait), and reading a pinned buffer that a copy is still filling gives garbage, silently."""
    if not isinstance(t, torch.Tensor):
        from karma_fx.errors import KarmaError

        raise KarmaError(f"landed() takes a tensor (a host copy made by karma.offload), got {type(t).__name__}")
    event = _copy_done.get(t)
    if event is not None:
        _block(event)
    return t


_lib = torch.library.Library("karma", "FRAGMENT")
_lib.define("wait(Tensor(a) t) -> Tensor(a)")


def _wait(t: torch.Tensor) -> torch.Tensor:
    """Make compute wait for the copy that produced ``t``; returns ``t`` (an alias)."""
    _let_go_of_finished()
    event = _copy_done.get(t)
    if event is not None:
        if t.is_cuda:
            torch.cuda.current_stream(t.device).wait_event(event)
        elif isinstance(event, Future):
            event.result()
        else:  # a CUDA event of an offload, waited on from the host tensor: a swap-out that must land
            torch.cuda.current_stream().wait_event(event)
        _let_go(t)
    out = torch.ops.aten.alias(t)
    if t in _host_tier:  # a waited swap-out is still the host tier (what is measured as device memory asks)
        _host_tier[out] = True
        if event is not None:  # host code reading the alias (``landed``, a widening) must still block for the
            _copy_done[out] = event  # copy: on CUDA this wait only made the compute stream wait
    return out


_lib.impl("wait", _wait, "CompositeExplicitAutograd")
