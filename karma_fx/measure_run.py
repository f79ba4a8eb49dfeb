"""Measure a real training step: device bytes of live storages while it runs, host copies excluded.

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

import weakref
from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import karma_fx.runtime  # noqa: F401 - registers torch.ops.karma


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
        host = func is torch.ops.karma.offload.default
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, host)
        if self.baseline_bytes + self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.baseline_bytes + self.current_bytes
            self.peak_op = str(func)
        return out


def measure_step_peak(model: torch.nn.Module, step: Any, args: tuple, kwargs: dict, loss_fn: Any) -> LiveBytes:
    """Run ``loss_fn(step(*args, **kwargs)).backward()`` once under ``LiveBytes`` (after dropping old
    gradients), counting the model's weights, buffers and the tensor inputs as what existed before."""
    import gc

    for param in model.parameters():
        param.grad = None
    gc.collect()
    inputs = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    with LiveBytes(model.parameters(), model.buffers(), inputs) as live:
        loss = loss_fn(step(*args, **kwargs))
        loss.backward()
        del loss
    return live
