"""The chunked loss head: a projection to the vocabulary and its cross-entropy, a few tokens at a time.

A language model's last matmul makes ``[tokens, vocabulary]`` logits, and its cross-entropy keeps them, their
log-softmax and later their gradient alive together: at GPT-2's vocabulary (50257) and 8x1024 tokens that is
three 1.5 GiB tensors in fp32, the floor of the whole step whatever else is moved. These two ops never hold
more than ``chunk`` rows of logits:

* ``karma::linear_ce(h, weight, bias, target, ignore_index, chunk)`` -> ``(loss [N] fp32, lse [N] fp32)``: per
  token its negative log-likelihood (0 where the target is ``ignore_index``) and the logsumexp of its logits,
  the only thing of the head the backward needs besides ``h`` and ``weight``.
* ``karma::linear_ce_backward(grad, h, weight, bias, target, lse, ignore_index, chunk)`` ->
  ``(grad_h, grad_weight, grad_bias)``: recomputes each chunk's logits, turns them into their gradient
  (``softmax - one_hot``, scaled by the token's incoming gradient) and accumulates both matmuls' gradients.

Numerics follow the unchunked head as PyTorch runs it: the logits are made in ``h``'s dtype (bf16 under autocast)
and upcast to fp32 for the softmax, as Hugging Face's ``logits.float()`` does; their gradient is cast back to the
logits' dtype before the matmuls, as the upcast's backward does. The weight's gradient is accumulated across
chunks in fp32 and cast once (the unchunked matmul accumulates in fp32 inside one kernel).

The reduction (mean over the tokens not ignored, or sum) stays in the graph around these ops, so autograd
derives its backward as before (``karma_fx.passes.loss_head`` builds them into the captured step).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

CHUNK_ROWS = (256, 1024, 4096)
"""Chunk sizes (tokens) the planner may choose among; ``0`` is "not chunked"."""


def _chunks(n: int, chunk: int) -> range:
    return range(0, n, max(1, chunk))


def _logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """One chunk's logits as the unchunked head makes them: in ``dtype`` (the matmul's, bf16 under autocast),
    then in fp32."""
    with torch.autocast(h.device.type, enabled=False):
        b = bias.to(dtype) if bias is not None else None
        return torch.nn.functional.linear(h.to(dtype), weight.to(dtype), b).float()


@torch.library.custom_op("karma::linear_ce", mutates_args=())
def linear_ce(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
              chunk: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    n = h.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=h.device)
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    weight, bias = weight.to(dtype), (bias.to(dtype) if bias is not None else None)  # cast once, not per chunk
    for a in _chunks(n, chunk):
        b = min(n, a + chunk)
        z = _logits(h[a:b], weight, bias, dtype)
        t = target[a:b]
        valid = t != ignore_index
        s = torch.logsumexp(z, dim=1)
        picked = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        loss[a:b] = torch.where(valid, s - picked, 0.0)
        lse[a:b] = s
    return loss, lse


@linear_ce.register_fake
def _(h, weight, bias, target, ignore_index, chunk, dtype):
    n = h.shape[0]
    return h.new_empty(n, dtype=torch.float32), h.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("karma::linear_ce_backward", mutates_args=())
def linear_ce_backward(grad: Tensor, h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                       lse: Tensor, ignore_index: int, chunk: int, dtype: torch.dtype, weight_grad: bool
                       ) -> tuple[Tensor, Tensor, Tensor]:
    n = h.shape[0]
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros(weight.shape if weight_grad else (0,), dtype=torch.float32, device=weight.device)
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    w = weight.to(dtype)
    b_cast = bias.to(dtype) if bias is not None else None
    for a in _chunks(n, chunk):
        b = min(n, a + chunk)
        t = target[a:b]
        valid = t != ignore_index
        p = torch.exp(_logits(h[a:b], w, b_cast, dtype) - lse[a:b].unsqueeze(1))
        p.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1), torch.full_like(lse[a:b], -1.0).unsqueeze(1))
        g = p.mul_(torch.where(valid, grad[a:b], 0.0).unsqueeze(1)).to(dtype)  # the upcast's backward
        with torch.autocast(h.device.type, enabled=False):
            grad_h[a:b] = g @ w
            if weight_grad:  # a frozen head (LoRA) needs no [V, D] accumulator
                grad_w.add_(g.t() @ h[a:b].to(dtype))
        if bias is not None:
            grad_b.add_(g.sum(0, dtype=torch.float32))
    if bias is None:  # a new empty tensor: a view of the accumulator (``grad_b[:0]``) held its [V] bytes
        grad_b = grad_b.new_empty(0)
    return grad_h, grad_w.to(weight.dtype), grad_b.to(weight.dtype)


@linear_ce_backward.register_fake
def _(grad, h, weight, bias, target, lse, ignore_index, chunk, dtype, weight_grad):
    nb = weight.shape[0] if bias is not None else 0
    grad_w = weight.new_empty(tuple(weight.shape) if weight_grad else (0,))  # contiguous, as the real one
    return torch.empty_like(h), grad_w, weight.new_empty(nb)


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``cross_entropy(h @ weight.T + bias, target, reduction="none")``, chunked."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
                chunk: int, dtype: torch.dtype) -> Tensor:
        loss, lse = torch.ops.karma.linear_ce(h, weight, bias, target, ignore_index, chunk, dtype)
        ctx.save_for_backward(h, weight, bias, target, lse)
        ctx.ignore_index, ctx.chunk, ctx.dtype = ignore_index, chunk, dtype
        ctx.mark_non_differentiable(lse)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, bias, target, lse = ctx.saved_tensors
        weight_grad = ctx.needs_input_grad[1]
        grad_h, grad_w, grad_b = torch.ops.karma.linear_ce_backward(grad, h, weight, bias, target, lse,
                                                                    ctx.ignore_index, ctx.chunk, ctx.dtype,
                                                                    weight_grad)
        return (grad_h, grad_w if weight_grad else None, (grad_b if bias is not None else None), None, None, None,
                None)


def linear_cross_entropy(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean", chunk: int = 1024,
                         dtype: torch.dtype | None = None) -> Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias).float(), target, ignore_index=..., reduction=...)`` over
    ``h`` of shape ``[N, D]``, never holding more than ``chunk`` rows of logits; the logits are made in
    ``dtype`` (default: autocast's where it is on, else ``h``'s)."""
    if dtype is None:
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    loss = LinearCrossEntropy.apply(h, weight, bias, target, ignore_index, chunk, dtype)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
