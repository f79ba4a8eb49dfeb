"""Attention with dropout as a GPU runs it, for plans made on a CPU.

On a CPU, ``scaled_dot_product_attention`` with dropout traces as the math path: the S×S probabilities and an
S×S dropout mask are saved per layer. A CUDA GPU runs a fused kernel that saves the output, the logsumexp and
the random generator's seed and offset, and redraws the mask in the backward. Planning a GPU from a model on
``meta`` (nothing runs here) must plan that graph, so while tracing, attention with dropout is routed to
``aten._scaled_dot_product_efficient_attention``: its fake kernel gives the CUDA kernel's saved state, its FLOP
formula is known, and its backward is the fused one. The graph is for planning only; it never runs on a CPU.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class GpuAttention(TorchFunctionMode):
    """Within this mode, ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` traces as the fused CUDA
    kernel (see the module docstring); every other call is untouched."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_NAMES, args), **kwargs)
        p = float(call.get("dropout_p", 0.0) or 0.0)
        if p <= 0.0 or call.get("enable_gqa", False):
            return func(*args, **kwargs)
        q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:  # the fused kernel takes an additive bias
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, p, bool(call.get("is_causal", False)), scale=call.get("scale"))
        return out[0]
