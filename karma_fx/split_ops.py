"""Convolutions run a piece of the batch at a time, so that their kernels' scratch is a piece's.

A convolution's kernel allocates scratch that grows with the batch: on a CPU, ``convolution_backward`` of a
16x16x32x32 activation takes 2 MiB beside its 1 MiB result, which is what sets the floor of a small CNN's step
(the working set of that one op). Run on a quarter of the batch at a time, the scratch is a quarter, and so is
the piece's own result before it is copied into place; the weight's and bias's gradients are summed over the
pieces. The planner offers this as a choice (``karma_fx.split``) and the rewrite puts these ops where a plan
chose it (``Plan.splits``).

The results agree with the unsplit op to rounding, not bit for bit: a CPU kernel may pick another algorithm
for a smaller batch, and the weight's and bias's gradients are summed piece by piece (fp32: within 1e-5,
``tests/test_split.py``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

_aten = torch.ops.aten


def _pieces(batch: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ranges covering ``range(batch)``, as even as they come."""
    chunks = max(1, min(chunks, batch))
    bounds = [batch * i // chunks for i in range(chunks + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(chunks) if bounds[i + 1] > bounds[i]]


@torch.library.custom_op("karma::convolution_split", mutates_args=())
def convolution_split(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Sequence[int],
                      padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                      output_padding: Sequence[int], groups: int, chunks: int) -> torch.Tensor:
    """``aten.convolution`` on ``chunks`` pieces of the batch, one after another, into one output."""
    out: torch.Tensor | None = None
    for start, end in _pieces(input.shape[0], chunks):
        piece = _aten.convolution.default(input[start:end], weight, bias, stride, padding, dilation, transposed,
                                          output_padding, groups)
        if out is None:
            out = torch.empty((input.shape[0],) + tuple(piece.shape[1:]), dtype=piece.dtype, device=piece.device,
                              memory_format=_format_of(piece))
        out[start:end].copy_(piece)
        del piece
    assert out is not None
    return out


@convolution_split.register_fake
def _convolution_split_fake(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                            chunks):
    return _aten.convolution.default(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                                     groups)


@torch.library.custom_op("karma::convolution_backward_split", mutates_args=())
def convolution_backward_split(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                               bias_sizes: Optional[Sequence[int]], stride: Sequence[int], padding: Sequence[int],
                               dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                               groups: int, output_mask: Sequence[bool], chunks: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.convolution_backward`` on ``chunks`` pieces of the batch: the input's gradient piece by piece
    into one tensor, the weight's and bias's summed over the pieces. An output the mask leaves out is an
    empty tensor (ATen's is undefined, and nothing reads it).

    Each piece's input gradient is computed by a call of its own, put in place and freed before the weight's
    and bias's are: one call for all three holds the piece's input gradient with the buffers the weight's
    gradient needs (oneDNN's reordered copies of the piece's input and output gradient). A CPU's 16x16 3x3
    convolution backward (batch 16, 32x32) in 8 pieces: 0.39 MiB of scratch in one call, 0.27 MiB in two, 0-13%
    slower (channels-last: about the same scratch either way); the planner measures both, as it runs."""
    grad_input = grad_weight = grad_bias = None
    separately = output_mask[0] and (output_mask[1] or output_mask[2])
    first = [True, False, False] if separately else list(output_mask)
    for start, end in _pieces(input.shape[0], chunks):
        pieces = grad_output[start:end], input[start:end], weight, bias_sizes, stride, padding, dilation
        gi, gw, gb = _aten.convolution_backward.default(*pieces, transposed, output_padding, groups, first)
        if output_mask[0]:
            if grad_input is None:
                grad_input = torch.empty(input.shape, dtype=gi.dtype, device=gi.device, memory_format=_format_of(gi))
            grad_input[start:end].copy_(gi)
        del gi
        if separately:
            _, gw, gb = _aten.convolution_backward.default(*pieces, transposed, output_padding, groups,
                                                           [False, output_mask[1], output_mask[2]])
        if output_mask[1]:
            grad_weight = gw if grad_weight is None else grad_weight.add_(gw)
        if output_mask[2]:
            grad_bias = gb if grad_bias is None else grad_bias.add_(gb)
        del gw, gb
    def given(t: torch.Tensor | None) -> torch.Tensor:
        return input.new_empty(0) if t is None else t  # one empty tensor each: outputs may not alias
    return given(grad_input), given(grad_weight), given(grad_bias)


@convolution_backward_split.register_fake
def _convolution_backward_split_fake(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                                     output_padding, groups, output_mask, chunks):
    gi, gw, gb = _aten.convolution_backward.default(grad_output, input, weight, bias_sizes, stride, padding,
                                                    dilation, transposed, output_padding, groups, output_mask)
    return tuple(t if wanted else input.new_empty(0) for t, wanted in zip((gi, gw, gb), output_mask))


def _format_of(t: torch.Tensor) -> torch.memory_format:
    """The layout the piece came in (a CPU convolution may answer channels-last), for the whole output."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


SPLIT_OPS: dict[Any, Any] = {
    _aten.convolution.default: torch.ops.karma.convolution_split.default,
    _aten.convolution_backward.default: torch.ops.karma.convolution_backward_split.default,
}
"""Each op that may run a piece of the batch at a time, and the karma op that does (its arguments and then
the number of pieces)."""


def split_limit(node: fx.Node) -> int:
    """The most pieces ``node``'s kernel may be split into (its batch: ``input``'s first dimension for a
    convolution, ``grad_output``'s for its backward); 1 where it is not an op of ``SPLIT_OPS``."""
    if node.op != "call_function" or node.target not in SPLIT_OPS or not node.args:
        return 1
    first = node.args[0]
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 3:
        return 1
    batch = val.shape[0]
    return int(batch) if isinstance(batch, int) and batch > 1 else 1
