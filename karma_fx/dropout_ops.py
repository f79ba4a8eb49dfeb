"""Dropout as two ops, so that its output can be rebuilt instead of kept.

``aten.native_dropout`` returns the output and the mask from one random op, and a random op is never
recomputed (a second run would draw a different mask), so every dropout output the backward reads had to be
kept or swapped out. Split in two, only the mask is random:

* ``karma.dropout_mask(x, p)`` draws the keep-mask (1 byte per element), consuming the random stream exactly
  as ``native_dropout`` does, so masks equal eager's bit for bit;
* ``karma.masked_scale(x, mask, scale)`` is ``x * mask * scale``, deterministic and cheap: the planner may
  rebuild the output from ``x`` and the mask in the backward, and keep, offload or drop the 1-byte mask.

On a CPU both ops compute what ``native_dropout`` computes, bit for bit, in fp32, bf16 and fp16.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("karma::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The keep-mask of ``native_dropout(x, p, train=True)``, drawn from the same random stream."""
    if x.device.type == "cpu":  # what native_dropout does on a CPU, without computing the output
        return torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
    # Elsewhere the fused kernel draws mask and output together; keep its draw (same masks as eager). Its
    # output is a transient of the size that masked_scale allocates next, so the peak does not move.
    return torch.ops.aten.native_dropout.default(x, p, True)[1]


@dropout_mask.register_fake
def _dropout_mask_fake(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.bool)


@torch.library.custom_op("karma::masked_scale", mutates_args=())
def masked_scale(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * mask * scale``, rounded as ``native_dropout`` rounds it (the mask is scaled in ``x``'s dtype)."""
    return x.mul(mask.to(x.dtype).mul_(scale))


@masked_scale.register_fake
def _masked_scale_fake(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)
