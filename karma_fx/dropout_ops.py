"""Dropout as two ops, so that its output can be rebuilt instead of kept.

``aten.native_dropout`` returns the output and the mask from one random op, and a random op is never
recomputed (a second run would draw a different mask), so every dropout output the backward reads had to be
kept or swapped out. Split in two, only the mask is random:

* ``karma.dropout_mask(x, p)`` draws the keep-mask (1 byte per element), consuming the random stream exactly
  as ``native_dropout`` does, so masks equal eager's bit for bit;
* ``karma.masked_scale(x, mask, scale)`` is ``x * mask * scale``, deterministic and cheap: the planner may
  rebuild the output from ``x`` and the mask in the backward, and keep, offload or drop the 1-byte mask.

On a CPU both ops compute what ``native_dropout`` computes, bit for bit, in fp32, bf16 and fp16.

``karma.dropout_backward(grad, mask, scale)`` is ``native_dropout_backward``, bit for bit. On a CPU both ATen
ops multiply by a copy of the mask cast to the data's dtype, scratch the size of their output (16 MiB on one
layer's attention probabilities in a 4-layer d=512 GPT at sequence 512), where a GPU's fused kernel needs
none; the karma ops multiply chunk by chunk, so that scratch is one chunk's.
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


_CHUNK = 1 << 18
"""Elements multiplied at a time on a CPU: the mask cast to the data's dtype is made a chunk at a time."""


def _masked_in_chunks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """``x * mask`` on a CPU with one chunk's scratch, or None where the layouts do not allow it. Bit for bit
    the product ATen computes: each element is ``x * 1`` or ``x * 0`` (signed zeros and NaNs kept)."""
    if x.device.type != "cpu" or x.shape != mask.shape or not (x.is_contiguous() and mask.is_contiguous()):
        return None
    out = torch.empty_like(x)
    flat_x, flat_mask, flat_out = x.view(-1), mask.view(-1), out.view(-1)
    for start in range(0, flat_x.numel(), _CHUNK):
        end = start + _CHUNK
        torch.mul(flat_x[start:end], flat_mask[start:end], out=flat_out[start:end])
    return out


@torch.library.custom_op("karma::masked_scale", mutates_args=())
def masked_scale(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * mask * scale``, rounded as ``native_dropout`` rounds it (the mask is scaled in ``x``'s dtype)."""
    masked = _masked_in_chunks(x, mask)
    if masked is None:
        return x.mul(mask.to(x.dtype).mul_(scale))
    return masked.mul_(torch.tensor(scale, dtype=x.dtype))  # (x * m) * s == x * (m * s) for m in {0, 1}, s > 0


@masked_scale.register_fake
def _masked_scale_fake(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("karma::dropout_backward", mutates_args=())
def dropout_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``native_dropout_backward(grad, mask, scale)``: ``grad * mask * scale``, the scale applied in the
    compute dtype as ATen applies it (for bf16 and fp16 not rounded to the data's dtype first)."""
    masked = _masked_in_chunks(grad, mask)
    if masked is None:
        return torch.ops.aten.native_dropout_backward.default(grad, mask, scale)
    return masked.mul_(scale)


@dropout_backward.register_fake
def _dropout_backward_fake(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(grad)
