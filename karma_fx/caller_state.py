"""The state of the caller's optimizers, counted as held by every step of the model they update.

A step's plans leave room for what it holds when it begins. On a GPU that is at least what the caching allocator
holds then (``torch.cuda.memory_allocated``), the caller's optimizer state included. A CPU keeps no such count,
so an optimizer the user steps outside karma was invisible there: SGD with momentum over a small LM (0.63 MiB of
buffers, two micro-batches accumulated) broke a 6.48 MiB budget by 5.2% with every plan exact to the byte.

PyTorch calls a process-wide hook after every optimizer step (``register_optimizer_step_post_hook``). A watch
remembers, weakly, each optimizer seen stepping one of its model's parameters; asked at a step's start, it sums
the bytes of their state on a device (the storages, each once), again only where a state dict is another or has
more entries (an update that made state, ``load_state_dict``). Karma's own host optimizer (``optimizer=``) is not
counted: its state is host memory (``mark_host_optimizer``).

Example::

    watch = OptimizerWatch(params_by_id)   # a mapping id(parameter) -> parameter
    opt.step()
    watch.bytes_on("cpu")                  # the momentum buffers of ``opt``
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch

__all__ = ["OptimizerWatch", "mark_host_optimizer"]

_watches: "weakref.WeakSet[OptimizerWatch]" = weakref.WeakSet()
_host_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook: Any = None


def mark_host_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` updates host copies (karma's host optimizer): its state is not device memory."""
    _host_optimizers.add(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _host_optimizers:
        return
    for watch in list(_watches):
        watch.stepped(optimizer)


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Device type -> bytes of the storages of ``optimizer``'s state tensors on it, each storage once."""
    seen: dict[int, tuple[str, int]] = {}
    for state in optimizer.state.values():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                local = getattr(value, "_local_tensor", value)  # a DTensor's (FSDP2's) shard on this rank
                try:
                    storage = local.untyped_storage()
                except (RuntimeError, NotImplementedError):  # another wrapper subclass: no storage to count
                    continue
                seen.setdefault(storage.data_ptr(), (local.device.type, storage.nbytes()))
    out: dict[str, int] = {}
    for device, nbytes in seen.values():
        out[device] = out.get(device, 0) + nbytes
    return out


class OptimizerWatch:
    """The optimizers seen stepping the parameters of ``params`` (a mapping ``id(parameter) -> parameter``,
    read at each step of an optimizer not yet judged), and the bytes of their state after their last step."""

    def __init__(self, params: Mapping[int, Any]) -> None:
        global _hook
        self._params = params
        self._judged: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[bool, tuple[int, int]]]" = \
            weakref.WeakKeyDictionary()
        """Optimizer -> (whether it steps a parameter of ``params``; how many ``params`` and parameter groups there
        were then): one judged before the model's first run, or before ``add_param_group``, is judged again."""
        self._bytes: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, int], dict[str, int]]]" = \
            weakref.WeakKeyDictionary()
        """Optimizer -> (its state dict's identity and length when summed, the sums): summed again only where those
        changed (a step that makes state, ``load_state_dict``, which puts a new dict in), not each step."""
        _watches.add(self)
        if _hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _hook = register_optimizer_step_post_hook(_after_step)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        params = self._params
        seen = (len(params), len(optimizer.param_groups))
        judged = self._judged.get(optimizer)
        if judged is None or (not judged[0] and judged[1] != seen):  # (more parameters or groups since)
            judged = self._judged[optimizer] = (any(params.get(id(p)) is p for group in optimizer.param_groups
                                                    for p in group["params"]), seen)
        if judged[0] and optimizer not in self._bytes:
            self._bytes[optimizer] = ((0, -1), {})

    def bytes_on(self, device_type: str) -> int:
        """What the watched optimizers' state holds on ``device_type`` now (state loaded since their last step
        included), read on the calling thread."""
        total = 0
        for optimizer, (key, sums) in list(self._bytes.items()):
            now = (id(optimizer.state), len(optimizer.state))
            if now != key:
                sums = state_bytes(optimizer)
                self._bytes[optimizer] = (now, sums)
            total += sums.get(device_type, 0)
        return total
