"""Which outputs of a region the backward never differentiates, learnt from the backward itself, and a guard for
the step that does.

Why: a region returning its loss and its logits (every HuggingFace language model given ``labels``) makes
autograd fill the logits' missing gradient with zeros of their size, and the compiled backward runs the logits'
branch on them (``karma_fx.passes.unused_outputs`` says what that costs). Which outputs a training loop
differentiates is known only once its backward has run, so it is learnt: on each run, a hook on every output
that requires grad (where there are two or more) records what the backward gave it (autograd calls a tensor's
hooks with ``None`` where no gradient arrived, before it fills in the zeros). After a step whose backward gave
such an output nothing, and no step gave it anything, the session traces the region again with that output
detached (``Session._detach_unused``). The caller still gets a tensor that requires grad, through a guard node:
should a later loss differentiate it after all, the guard raises, and the region is traced as written from its
next run on. The step is lost; a gradient is never silently dropped.

Example::

    watch = OutputWatch()
    out = watch.returned(region, out, on_used=undo)   # hooks (or guards, once detached) on the run's outputs
    watch.unused(region.index)                        # -> (1,): detach output 1 at the next step
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from karma_fx.errors import KarmaError
from karma_fx.variants import Region

__all__ = ["OutputWatch"]

_ANCHOR = torch.zeros((), requires_grad=True)
"""A leaf that requires grad, so that a guarded output requires grad as it did before it was detached."""


class KarmaDetachedOutput(torch.autograd.Function):
    """The identity on an output the region returns detached; its backward runs only if a loss differentiates
    that output, and then raises. What it returns is a view made in a custom function, which autograd does not let
    be modified in place with gradients on (under ``torch.no_grad()`` it may be): a tensor of its own would need a
    copy, and marking the output dirty would bump the version of what the backward saved of it."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, anchor: torch.Tensor, on_used: Callable[[], str]) -> torch.Tensor:
        ctx.on_used = on_used
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        where = ctx.on_used()
        raise KarmaError(f"karma_fx: {where} got a gradient in this backward. The earlier steps' backwards gave it "
                         "none, so it was compiled without its backward (autograd would have filled its gradient "
                         "with zeros of its size and run its branch on them). It is compiled as written from its "
                         "next call. This backward stopped part way: gradients of compiled regions after it may "
                         "already be accumulated, so zero the gradients and run this step again (with gradient "
                         "accumulation, the micro-batches since the last update).")


@dataclass
class OutputWatch:
    """Per (region index, output position): whether some backward gave the output no gradient, or one."""

    none: set[tuple[int, int]] = field(default_factory=set)
    used: set[tuple[int, int]] = field(default_factory=set)

    def returned(self, region: Region, out: Any, on_used: Callable[[], str], watch: bool = True) -> Any:
        """A training run of ``region`` returned ``out``: guard the outputs it returns detached, or (``watch``:
        where what is learnt can be acted on) watch its outputs that require grad. Returns what the caller gets
        (``out``, or a copy with guarded tensors)."""
        flat = list(out) if isinstance(out, (list, tuple)) else [out]
        if region.detached:
            for k in region.detached:
                flat[k] = KarmaDetachedOutput.apply(flat[k], _ANCHOR, on_used)
            return type(out)(flat) if isinstance(out, (list, tuple)) else flat[0]
        if region.as_written_only or not watch:
            return out
        differentiable = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
                          and t.grad_fn is not None and t.is_floating_point()]
        if len(differentiable) < 2:  # one output: the loss, or what a loss is computed from
            return out
        for k in differentiable:
            key = (region.index, k)
            if key not in self.used:
                flat[k].register_hook(self._hook(key))
        return out

    def _hook(self, key: tuple[int, int]) -> Callable[[Any], None]:
        def seen(grad: Any) -> None:
            (self.none if grad is None else self.used).add(key)
        return seen

    def unused(self, region_index: int) -> tuple[int, ...]:
        """The outputs of the region some backward gave no gradient and none gave one."""
        return tuple(sorted(k for r, k in self.none if r == region_index and (r, k) not in self.used))
