"""Measure a real training step's device memory: allocator events (every path) or live storages (eager paths).

``AllocatorPeak`` reads the allocator's own events through ``torch.profiler`` (``profile_memory=True``): every
allocation and free during the block, in time order, whose running sum peaks where the allocator peaked. It
does not change how the code runs, so it measures ``torch.compile`` paths (``karma_fx.compile`` and
``backend="karma"``) as they really run. It counts bytes allocated *during* the block, so measure a
steady-state step (the host-buffer pool then reuses its buffers and allocates nothing) and add what existed
before it (``baseline_bytes``: weights, buffers, inputs, gradients that persist). On a CPU host copies and
"device" tensors share one allocator: a host buffer allocated during the block counts too.

``LiveBytes`` (below) counts live storages under a ``TorchDispatchMode``: exact to the byte and able to tell
host copies apart, but under a dispatch mode Dynamo runs the frame eagerly, so it only measures eager paths
(the joint graph run op by op, a model without ``torch.compile``).

A ``TorchDispatchMode`` sees every op of the step (the compiled forward and backward graphs, the autograd
engine's gradient seeds and accumulations) and tracks the storage of every tensor they create until the
last tensor holding it dies; storages made by ``karma.offload`` are host-tier and not counted. What existed
before the step (weights, buffers, inputs, old gradients) is counted as a baseline. On a CPU this stands in
for ``torch.cuda.max_memory_allocated()``; it counts exact storage bytes, without allocator rounding.

Example::

    with LiveBytes(model.parameters(), model.buffers(), inputs) as live:
        loss = loss_fn(step(x)); loss.backward()
    live.peak_bytes
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import karma_fx.runtime  # noqa: F401 - registers torch.ops.karma


def storage_bytes(*groups: Iterable[Any]) -> int:
    """Bytes of the distinct storages of the tensors in ``groups`` (and of their ``.grad``)."""
    seen: dict[int, int] = {}
    for group in groups:
        for t in pytree.tree_leaves(list(group) if not isinstance(group, torch.Tensor) else [group]):
            if isinstance(t, torch.Tensor):
                for x in (t, t.grad):
                    if x is not None and x.device.type != "meta":
                        storage = x.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def event_device(event: Any) -> str:
    """``"CPU"`` or ``"CUDA"``: where a torch.profiler event happened (for a memory event, which allocator it
    came from; a step on a GPU also allocates small host tensors, which are not the device memory budgeted)."""
    return str(event.device_type()).rsplit(".", 1)[-1]


class ProfilerBusy(RuntimeError):
    """A torch.profiler session is already running: a second one would break it (PyTorch's profiler does
    not nest: the outer session loses every event from the inner one's start on, and pausing it around the
    inner one crashed the process now and then, 2026-12-02, torch 2.13)."""


def _memory_deltas(prof: Any, device: str) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation (+) and free (-) of ``device``'s allocator that ``prof`` recorded."""
    events = prof.profiler.kineto_results.events()
    return sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and event_device(e) == device)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null for the block: this build of PyTorch's profiler prints two
    ``USDT: ... profiler_start`` / ``profiler_stop`` lines there each session, from C++, which no setting
    silences; a compile that measures its step would print them into the user's terminal."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (an embedding host): nothing to hide
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_warned = False


class _Profile:
    """torch.profiler recording CPU (and CUDA) activity with the allocator's events, started and stopped
    without the profiler's own lines on stderr."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self.profiler: Any = None

    def __enter__(self) -> "_Profile":
        global _warned
        with _quiet_stderr():
            early = None if _warned else torch.empty(1)
            self._prof.__enter__()
            # c10 warns, once a process, when a block allocated before a session is freed during it (as every
            # session over a running program sees); have it said here, where stderr is quiet.
            del early
            _warned = True
        return self

    def __exit__(self, *exc: Any) -> None:
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        self.profiler = self._prof.profiler


def _profile() -> _Profile:
    return _Profile()


def profiler_running() -> bool:
    """Whether a torch.profiler session (the user's, or an ``AllocatorPeak``) is recording on this process."""
    return bool(torch._C._autograd._profiler_enabled())


@contextlib.contextmanager
def allocator_events() -> Iterator[Any]:
    """A torch.profiler session that records the allocator's events, for code that measures memory itself
    (the planner measuring a step's kernel scratch while it compiles); ``ProfilerBusy`` where one is already
    running, rather than break it."""
    if profiler_running():
        raise ProfilerBusy("a torch.profiler session is already running")
    with _profile() as prof:
        yield prof


BEGIN_BYTES, END_BYTES = 1_234_567, 2_345_679
"""A ``GapMeter`` marks where the gap after run ``k`` begins and ends with allocations of ``BEGIN_BYTES + 2k``
and ``END_BYTES + 2k`` bytes (odd sizes no tensor of a step has), found again in the allocator's events."""
_gap_meters: "weakref.WeakSet[GapMeter]" = weakref.WeakSet()


def stop_gap_meters() -> None:
    """Stop every ``GapMeter`` still running (their gaps are read as far as they got): someone else is about to
    profile, from code that is not inside a compiled region."""
    for meter in list(_gap_meters):
        meter.stop()


class GapMeter:
    """How far the allocator climbs over code that is not ours, between the compiled calls of one step: the
    eager code at a graph break (after run ``k``'s forward until run ``k + 1``), the loss head (after the last
    forward until the backward begins). One profiler session spans the step; ``begin(k)`` and ``end(k)`` put
    markers in it; ``stop`` reads, for each ``k``, the highest running sum of the allocations and frees between
    the markers above the sum at ``begin(k)``, and hands them to ``done``.

    Where it starts and stops is the point of it (``karma_fx.compile``'s module starts it before the step's
    first compiled call; ``stop_after_backward`` stops it when the step's backward call returns):

    * the profiler records no free of a block allocated before it started, so it must already run when the
      outputs the loss head frees are made (the logits would read as held through its backward);
    * a profiler stopped inside the autograd engine is started again when the engine restores the caller's
      thread state, and PyTorch then refuses every new session;
    * one stopped inside a compiled region, while a range that region opened under it is still open, corrupted
      memory (the process crashed, and gradients came out wrong, 2026-12-02, torch 2.13).

    It starts only where nothing else profiles. ``AllocatorPeak`` stops a running one first; a region that
    compiles under it cannot measure its scratch and is measured again later (``karma_fx.session``)."""

    def __init__(self, device: str = "cpu", done: "Callable[[dict[int, int], int], None] | None" = None) -> None:
        self.device = device
        self.done = done
        self._prof: Any = None
        self._thread = 0
        self._watch: Any = None
        self._whole_step = False

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> bool:
        import threading

        if self._prof is not None or profiler_running():
            return False
        self._prof = _profile()
        self._prof.__enter__()
        self._thread = threading.get_ident()
        _gap_meters.add(self)
        return True

    def _marker(self, nbytes: int) -> None:
        if self._prof is not None:
            torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def begin(self, k: int) -> None:
        self._marker(BEGIN_BYTES + 2 * k)

    def end(self, k: int) -> None:
        self._marker(END_BYTES + 2 * k)

    def stop_after_backward(self) -> bool:
        """Stop when the next ``torch.autograd.backward`` or ``grad`` call on this thread returns: past the
        engine, and before the caller's own code after the step (its optimizer, a profiler of its own) runs
        under this session. A Python profile function watches for that return; none is installed over one in
        place (a profiler or debugger of the user's): the meter then runs until ``stop`` is called."""
        import sys

        if self._prof is None or sys.getprofile() is not None:
            return False
        watched = {torch.autograd.backward.__code__, torch.autograd.grad.__code__}

        def watch(frame: Any, event: str, arg: Any) -> None:
            if event == "return" and frame.f_code in watched:
                self._whole_step = True
                self.stop()

        self._watch = watch
        sys.setprofile(watch)
        return True

    def stop(self) -> dict[int, int]:
        """Per run ``k``: the gap after it, for each gap whose end was marked (none from another thread than
        the one that started the meter). ``done`` also gets the highest running sum over the whole session (the
        step's climb above what was allocated when it began), where the session spanned the step up to its
        backward's return; else 0 (stopped early, or late: after the caller's optimizer)."""
        import sys
        import threading

        if self._prof is None or threading.get_ident() != self._thread:
            return {}
        if self._watch is not None:
            if sys.getprofile() is self._watch:
                sys.setprofile(None)
            self._watch = None
        prof, self._prof = self._prof, None
        _gap_meters.discard(self)
        prof.__exit__(None, None, None)
        gaps: dict[int, int] = {}
        open_at: dict[int, tuple[int, int]] = {}  # run -> (running sum at its begin marker, highest since)
        running = climb = 0
        for _, nbytes in _memory_deltas(prof, self.device.upper()):
            size = abs(nbytes)
            if size >= BEGIN_BYTES and (size - BEGIN_BYTES) % 2 == 0 and (size - BEGIN_BYTES) // 2 < 1 << 16:
                k = (size - BEGIN_BYTES) // 2
                if nbytes > 0:
                    open_at[k] = (running, running)
                continue
            if size >= END_BYTES and (size - END_BYTES) % 2 == 0 and (size - END_BYTES) // 2 < 1 << 16:
                k = (size - END_BYTES) // 2
                if nbytes > 0 and k in open_at:
                    base, peak = open_at.pop(k)
                    gaps[k] = peak - base
                continue
            running += nbytes
            climb = max(climb, running)
            for k, (base, peak) in open_at.items():
                if running > peak:
                    open_at[k] = (base, running)
        climb = climb if self._whole_step else 0
        if self.done is not None and (gaps or climb):
            self.done(gaps, climb)
        return gaps


class AllocatorPeak:
    """Peak allocator bytes during a ``with`` block, from torch.profiler's raw memory events.

    ``peak_bytes`` = ``baseline_bytes`` (the storages passed in, counted once) + the highest running sum of
    allocations minus frees during the block; ``end_bytes`` the same at the block's end. Only the events of
    ``device``'s allocator count (``"cpu"`` or ``"cuda"``; by default the device of the tensors passed in):
    a GPU step also allocates small host tensors, and its pinned host buffers are not device memory.

    A karma step that compiles inside the block cannot measure its kernels' scratch (profiler sessions do not
    nest): it plans without, and measures and plans again at its first run outside a profiler. Measure steps
    after the first."""

    def __init__(self, *existing: Iterable[Any], device: str | None = None) -> None:
        groups = [[group] if isinstance(group, torch.Tensor) else list(group) for group in existing]
        self.baseline_bytes = storage_bytes(*groups)
        if device is None:
            types = {t.device.type for t in pytree.tree_leaves(groups) if isinstance(t, torch.Tensor)}
            device = "cuda" if "cuda" in types else "cpu"
        self.device = device.upper()
        self.peak_bytes = self.baseline_bytes
        self.end_bytes = self.baseline_bytes
        self._prof: Any = None

    def __enter__(self) -> "AllocatorPeak":
        stop_gap_meters()  # a karma step measuring the code after its forward: this block measures it all
        self._prof = _profile()
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        running = peak = 0
        for _, nbytes in _memory_deltas(self._prof, self.device):
            running += nbytes
            peak = max(peak, running)
        self.peak_bytes = self.baseline_bytes + peak
        self.end_bytes = self.baseline_bytes + running


class LiveBytes(TorchDispatchMode):
    """Peak and current bytes of live device storages during a ``with`` block (see the module docstring)."""

    def __init__(self, *existing: Iterable[Any]) -> None:
        super().__init__()
        self._holders: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._host: set[int] = set()
        self.current_bytes = 0
        self.baseline_bytes = 0
        seen: set[int] = set()
        for group in existing:
            for t in pytree.tree_leaves(list(group) if not isinstance(group, torch.Tensor) else [group]):
                if isinstance(t, torch.Tensor):
                    key = t.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        self.baseline_bytes += t.untyped_storage().nbytes()
                    if t.grad is not None and t.grad.untyped_storage().data_ptr() not in seen:
                        seen.add(t.grad.untyped_storage().data_ptr())
                        self.baseline_bytes += t.grad.untyped_storage().nbytes()
        self._preexisting = seen
        self.peak_bytes = self.baseline_bytes
        self.peak_op = ""

    def _track(self, t: torch.Tensor, host: bool) -> None:
        if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
            return  # tracing (a compile inside the block), not running
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._preexisting:
            return
        if host:
            self._host.add(key)
        if key not in self._holders:
            self._holders[key] = 0
            self._size[key] = storage.nbytes()
            if key not in self._host:
                self.current_bytes += self._size[key]
        self._holders[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            if key not in self._host:
                self.current_bytes -= self._size.pop(key)
            else:
                self._host.discard(key)
                self._size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host = func in (torch.ops.karma.offload.default, torch.ops.karma.host_cast.default)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, host)
        if self.baseline_bytes + self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.baseline_bytes + self.current_bytes
            self.peak_op = str(func)
        return out


def measure_step_peak(model: torch.nn.Module, step: Any, args: tuple, kwargs: dict, loss_fn: Any) -> AllocatorPeak:
    """Run ``loss_fn(step(*args, **kwargs)).backward()`` once under ``AllocatorPeak`` (after dropping old
    gradients), counting the model's weights, buffers and the tensor inputs as what existed before. Run a
    step first: the measured one should be a steady-state step."""
    import gc

    for param in model.parameters():
        param.grad = None
    gc.collect()
    inputs = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    with AllocatorPeak(model.parameters(), model.buffers(), inputs) as live:
        loss = loss_fn(step(*args, **kwargs))
        loss.backward()
        del loss
    return live
