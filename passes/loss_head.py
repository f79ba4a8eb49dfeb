"""The loss head, chunked: while a step is traced, ``F.cross_entropy`` over the logits of a ``F.linear`` becomes
``karma_fx.loss_ops.linear_cross_entropy``, which never holds more than a chunk of tokens' logits.

Why at trace time, over torch functions, and not by matching the captured aten graph: the same head reaches the
joint graph as ``_log_softmax`` and ``nll_loss_forward`` when traced for the eager runner and as a dozen
pointwise ops when traced with Inductor's decompositions (``amax``, ``sub``, ``exp``, ``sum``, ``log``, ``gather``,
``where``...), and its backward likewise. At the torch-function level it is always the same two calls, whatever
the model between them does to the logits: so ``ChunkedHead`` is a ``TorchFunctionMode`` pushed around the
trace (``karma_fx.passes.capture``). It follows each ``F.linear`` output through what language models do to
logits before their loss (``.float()``, ``.contiguous()``, a view or reshape to ``[tokens, vocabulary]``, a
slice of the leading dimensions: Hugging Face's ``logits[..., :-1, :]``), applying the same to the hidden states;
a ``F.cross_entropy`` over such a tensor with class indices as targets, no class weights and no label smoothing,
and a mean or sum reduction becomes the chunked head. Anything else passes through untouched, and the ``F.linear``
whose logits are no longer read is dropped by the trace's dead-code elimination.

Example::

    with ChunkedHead(chunk=1024) as head:
        ...  # trace the step
    head.rewritten  # how many heads were chunked
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

MIN_CLASSES = 2
"""Heads with fewer classes are left alone (a single logit is a regression, not a head to chunk). Whether a
head is worth chunking is the planner's call, priced like every other choice."""


@dataclass
class _Logits:
    """Where a tensor of logits came from: ``F.linear(h, weight, bias)``, then ``reshape`` applied to ``h``."""

    h: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    """The matmul's dtype (bf16 under autocast), before any upcast."""
    root: int
    """id of the ``F.linear`` output these logits derive from: any other use of one of them (an in-place edit,
    a view this module does not follow) taints them all."""


_LINEAR = {F.linear, torch._C._nn.linear}
_PASS_METHODS = {"float", "contiguous"}
_RESHAPE_METHODS = {"view", "reshape", "flatten"}


def _key(t: Any) -> int | None:
    return id(t) if isinstance(t, torch.Tensor) else None


def default_chunk(tokens: int, hidden: int, classes: int) -> int:
    """Tokens per chunk where none is asked for: a chunk's logits about as large as the hidden states they are
    made from (``tokens * hidden`` elements), a power of two of at least ``MIN_CHUNK`` tokens, so that the head
    never holds more than the step already does while each chunk's matmul stays large."""
    want = max(1, -(-tokens * hidden // classes))
    return min(tokens, max(MIN_CHUNK, 1 << (want - 1).bit_length()))


MIN_CHUNK = 64

FAST_CHUNK_FACTOR = 8
"""The second chunk size offered: this many times the default one. Each chunk reads the whole weight again (and
its backward reads and writes the weight's fp32 gradient), so small chunks are lean but slow where the
vocabulary is large (real GPT-2 on the H100 preset at 0.35 of its peak: 1.54x the unlimited step at 128 tokens a
chunk); the planner prices both."""


def chunk_sizes(default: int, tokens: int) -> tuple[int, ...]:
    """The chunk sizes a head is traced with for the planner: the default one, and ``FAST_CHUNK_FACTOR`` times it
    where that is still fewer than the tokens there are."""
    fast = default * FAST_CHUNK_FACTOR
    return (default, fast) if fast < tokens else (default,)


class ChunkedHead(TorchFunctionMode):
    """See the module docstring. ``chunk``: tokens per chunk (``None``: ``default_chunk`` of the first head
    seen; ``chunk`` then says which, for a trace of the same step to repeat)."""

    def __init__(self, chunk: int | None = None, min_classes: int = MIN_CLASSES) -> None:
        super().__init__()
        self.chunk = chunk
        self.min_classes = min_classes
        self.rewritten = 0
        self.tokens = 0
        """Tokens of the (first) head chunked."""
        self._logits: dict[int, tuple[_Logits, torch.Tensor]] = {}
        """id(tensor) -> (its origin, the tensor itself: held so that the id is not reused while tracing)."""
        self._tainted: set[int] = set()
        """Roots (``_Logits.root``) whose logits something else read or edited: never chunked."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy or func is torch._C._nn.cross_entropy_loss:
            chunked = self._cross_entropy(args, kwargs)
            if chunked is not None:
                return chunked
        touched = [self._logits[id(t)][0].root for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and id(t) in self._logits] if self._logits else []
        out = func(*args, **kwargs)
        if func in _LINEAR:
            self._note_linear(args, kwargs, out)
        elif touched and _may_change(func, out) and not (
                isinstance(out, torch.Tensor) and _key(args[0] if args else None) in self._logits
                and self._follow(func, args, kwargs, out)):
            # an in-place edit (``logits /= T``, a masked vocabulary) or a tensor made from them that may be a
            # view this module does not follow: the chunked head would not see what it does to them, so such
            # logits stay as the model computes them
            self._tainted.update(touched)
        return out

    # ---- following the logits --------------------------------------------------------------------------
    def _note_linear(self, args: tuple, kwargs: dict, out: Any) -> None:
        h = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if not isinstance(out, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return
        if weight.shape[0] < self.min_classes or not isinstance(h, torch.Tensor):
            return
        self._logits[id(out)] = (_Logits(h, weight, bias, out.dtype, id(out)), out)

    def _follow(self, func: Callable, args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
        """Note ``out`` as the same logits, where ``func`` is one of the ways models reshape or upcast them;
        whether it was."""
        origin, logits = self._logits[id(args[0])]
        name = getattr(func, "__name__", "")
        classes = origin.weight.shape[0]
        if out.dim() == 0 or out.shape[-1] != classes:
            return False
        h = None
        if name in _PASS_METHODS and out.shape == logits.shape:
            h = origin.h
        elif name == "to" and out.shape == logits.shape and out.dtype.is_floating_point:
            h = origin.h
        elif name in _RESHAPE_METHODS or func in (torch.reshape, torch.flatten):
            if out.shape[-1] == logits.shape[-1] and out.numel() == logits.numel():
                h = origin.h.reshape(*out.shape[:-1], origin.h.shape[-1])
        elif name == "__getitem__" and len(args) > 1 and _keeps_last_dim(args[1], logits.dim()):
            h = origin.h[args[1]]
        if h is None:
            return False
        self._logits[id(out)] = (_Logits(h, origin.weight, origin.bias, origin.dtype, origin.root), out)
        return True

    # ---- the loss --------------------------------------------------------------------------------------
    def _cross_entropy(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        from karma_fx.loss_ops import linear_cross_entropy

        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                 "label_smoothing")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x, target = bound.get("input"), bound.get("target")
        entry = self._logits.get(_key(x)) if x is not None else None
        if entry is None or not isinstance(target, torch.Tensor):
            return None
        origin, _ = entry
        if origin.root in self._tainted or x.dim() != 2 or target.dim() != 1 or target.dtype != torch.int64:
            return None
        if bound.get("weight") is not None or bound.get("label_smoothing", 0.0) not in (0, 0.0):
            return None
        if bound.get("size_average") is not None or bound.get("reduce") is not None:
            return None
        reduction = bound.get("reduction", "mean")
        if reduction not in ("mean", "sum"):
            return None
        h = origin.h.reshape(-1, origin.h.shape[-1])
        if h.shape[0] != x.shape[0]:
            return None
        if self.chunk is None:
            self.chunk = default_chunk(h.shape[0], h.shape[1], origin.weight.shape[0])
        if not self.rewritten:
            self.tokens = int(h.shape[0])
        self.rewritten += 1
        loss = linear_cross_entropy(h, origin.weight, origin.bias, target, ignore_index=bound.get("ignore_index", -100),
                                    reduction=reduction, chunk=self.chunk, dtype=origin.dtype)
        return loss.to(x.dtype)  # a bf16 loss where the model's logits were bf16 (computed in fp32 here)


@contextlib.contextmanager
def set_aside(head: "ChunkedHead | None") -> Iterator[None]:
    """Run without ``head`` (when it is the innermost mode): measuring the step's ops under it would add its
    Python dispatch to each op timed, and bias the planner against the trace it is active for."""
    if head is None or torch.overrides._get_current_function_mode() is not head:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def _may_change(func: Callable, out: Any) -> bool:
    """Whether a call may edit the logits it reads, now or through what it returns: an in-place op, an item
    assignment, or any tensor it returns (perhaps a view). Reading their shape or dtype does not."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
        return True
    return isinstance(out, torch.Tensor)


def _keeps_last_dim(index: Any, dims: int) -> bool:
    """Whether ``tensor[index]`` indexes only leading dimensions with slices and integers (and takes the last
    one whole), so that the same index applies to the hidden states."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) or i is None for i in items):
        return False
    if Ellipsis in items:
        return items[-1] == slice(None) and items.count(Ellipsis) == 1
    return len(items) < dims or (len(items) == dims and items[-1] == slice(None))
