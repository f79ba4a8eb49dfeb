"""Per-node statistics of a captured aten graph: FLOPs, bytes moved, dtype, randomness, aliasing.

The cost model turns these into times, so they must be cheap (graphs have 20,000+ nodes), never fail on an
unknown op, and never call an op that does arithmetic "free": a zero would make the planner think that
recomputing it costs nothing. Everything is read from ``node.meta["val"]`` (fake or real tensors) and the
op's schema; no op is executed.

FLOPs come from three sources, in order:

1. Attention ops (``_scaled_dot_product_*``, including the CPU-only ``..._flash_attention_for_cpu`` that CPU
   traces lower to, which ``torch.utils.flop_counter`` does not know): our own formula, so that every backend
   is counted alike and causal masking halves the work (the torch formulas ignore causality).
2. ``torch.utils.flop_counter.flop_registry``: matmuls and convolutions, exact.
3. Everything else: ``k × elements``, where *elements* is the larger of the total output elements and the
   largest input (so a reduction counts what it reads, a broadcast what it writes) and *k* is a rough
   per-element cost, see ``_POINTWISE_FLOPS`` etc. below. These ops are memory-bound on any GPU, so the
   roofline model barely looks at this number; it only has to be non-zero and of the right order.

Pure data movement (copies, concatenation, gathers, factory ops) is counted as 0 FLOPs but its bytes are
counted, which is what bounds its time.
"""
from __future__ import annotations

import math
import operator
from functools import lru_cache
from typing import Any, Callable, Iterator

import torch
import torch.fx

try:  # public module, but the registry itself is an implementation detail: stay working without it
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except Exception:  # pragma: no cover - very old / stripped builds
    _FLOP_REGISTRY = {}

__all__ = [
    "DATA_MOVEMENT_OPS",
    "VIEW_OPS",
    "node_flops",
    "node_bytes_accessed",
    "node_dtype",
    "is_random",
    "is_view_op",
]

# Per-element FLOP constants for ops without an exact formula. Deliberately coarse.
_POINTWISE_FLOPS = 1
"""add, mul, relu, where, masked_fill, threshold_backward, dropout's mask-multiply, ..."""
_REDUCTION_FLOPS = 1
"""sum, mean, amax, cumsum: one add/compare per element read."""
_TRANSCENDENTAL_FLOPS = 5
"""exp, tanh, erf, gelu, silu, softmax (max, sub, exp, sum, div per element) and their backwards."""
_NORM_FLOPS = 8
"""layer/batch/group/rms norm: mean, variance, normalise and affine (~2 each), forward or backward."""

VIEW_OPS: frozenset[str] = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "t", "transpose", "expand", "expand_as", "permute",
    "alias", "detach", "lift_fresh", "as_strided", "slice", "select", "narrow", "unsqueeze", "squeeze",
    "split", "split_with_sizes", "unbind", "chunk", "tensor_split", "diagonal", "unfold", "view_as",
    "view_as_real", "view_as_complex", "flatten", "unflatten", "movedim", "_conj", "_neg_view", "real", "imag",
})
"""Op names (schema name without namespace/overload) whose output aliases an input. ``_unsafe_view`` has no
alias annotation in its schema but does alias at runtime, hence the explicit list on top of the schema check."""

DATA_MOVEMENT_OPS: frozenset[str] = frozenset({
    "clone", "copy", "_copy_from", "_to_copy", "contiguous", "lift_fresh_copy", "cat", "stack", "hstack",
    "vstack", "constant_pad_nd", "repeat", "index", "_unsafe_index", "index_select", "gather", "embedding",
    "flip", "roll", "scatter", "masked_scatter", "slice_scatter", "select_scatter", "diagonal_scatter",
    "as_strided_scatter", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
    "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "fill",
    "scalar_tensor", "arange", "resize", "set", "_local_scalar_dense", "item",
})
"""Ops that move or materialise data without arithmetic: 0 FLOPs, their cost is their bytes. Functional
``*_copy`` variants of view ops (``view_copy``, ``permute_copy``, ...) are treated the same way."""

_TRANSCENDENTAL_OPS = frozenset({
    "gelu", "gelu_backward", "silu", "silu_backward", "sigmoid", "sigmoid_backward", "tanh", "tanh_backward",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "erf", "erfc", "erfinv", "pow", "rsqrt", "sqrt",
    "sin", "cos", "tan", "softplus", "softplus_backward", "elu", "elu_backward", "mish", "mish_backward",
    "log_sigmoid_forward", "log_sigmoid_backward", "logsumexp", "_softmax", "_log_softmax", "softmax",
    "log_softmax", "_safe_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "hardswish",
    "hardswish_backward", "var", "std", "var_mean", "std_mean",
})

_NORM_OPS = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "layer_norm", "native_batch_norm",
    "native_batch_norm_backward", "batch_norm", "batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "_batch_norm_with_update",
    "_batch_norm_with_update_functional", "_batch_norm_no_update", "cudnn_batch_norm",
    "cudnn_batch_norm_backward", "miopen_batch_norm", "miopen_batch_norm_backward", "native_group_norm",
    "native_group_norm_backward", "group_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "rms_norm",
    "instance_norm",
})

_ATTENTION_FWD = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
})
_ATTENTION_BWD = frozenset(name + "_backward" for name in _ATTENTION_FWD)

_DROPOUT_PROB_ARGS = ("dropout_p", "p")
_RANDOM_NAME_HINTS = ("philox_rand", "run_and_save_rng_state")


def _op_name(target: Any) -> str:
    """Schema name without namespace or overload (``aten::add.Tensor`` → ``add``), '' if not an aten-style op."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return ""
    return schema.name.split("::")[-1]


def _classify(target: Any) -> tuple[str, float]:
    """(kind, per-element constant) of an op, cached per overload. Kinds: view, data, attn_fwd, attn_bwd,
    registry, matvec, elementwise, unknown (not an aten-style op)."""
    try:
        return _classify_cached(target)
    except TypeError:  # unhashable callable
        return _classify_uncached(target)


def _classify_uncached(target: Any) -> tuple[str, float]:
    if target is operator.getitem:
        return "view", 0
    name = _op_name(target)
    if not name:
        return "unknown", _POINTWISE_FLOPS
    base = name[:-1] if name.endswith("_") and not name.startswith("__") else name
    if _schema_is_view(target) or base in VIEW_OPS:
        return "view", 0
    if base in _ATTENTION_FWD:
        return "attn_fwd", 0
    if base in _ATTENTION_BWD:
        return "attn_bwd", 0
    packet = getattr(target, "overloadpacket", None)
    if packet in _FLOP_REGISTRY or target in _FLOP_REGISTRY:
        return "registry", 0
    if base in ("mv", "addmv", "dot", "vdot", "addbmm", "_int_mm", "linear"):
        return "matvec", 0
    if base in DATA_MOVEMENT_OPS or base.endswith("_copy"):
        return "data", 0
    if base in _NORM_OPS:
        return "elementwise", _NORM_FLOPS
    if base in _TRANSCENDENTAL_OPS:
        return "elementwise", _TRANSCENDENTAL_FLOPS
    return "elementwise", _POINTWISE_FLOPS  # pointwise, reductions, losses, anything new


_classify_cached = lru_cache(maxsize=None)(_classify_uncached)


def _schema_is_view(target: Any) -> bool:
    """True when some return is annotated as a (non-written) alias of an argument, e.g. ``Tensor(a)``."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    for ret in schema.returns:
        info = ret.alias_info
        if info is not None and not info.is_write:
            return True
    return False


def _as_int(value: Any) -> int:
    """Concrete int of an int or SymInt without adding guards: use the size hint when symbolic."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    return int(value)


def _iter_values(value: Any) -> Iterator[Any]:
    """Leaves of nested tuples/lists/dicts: cheaper than pytree for the shallow structures fx args use."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _iter_values(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _iter_values(item)
    else:
        yield value


def _is_tensor_like(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _numel(t: Any) -> int:
    return math.prod(_as_int(s) for s in t.shape)


def _itemsize(dtype: torch.dtype) -> int:
    try:
        return dtype.itemsize
    except AttributeError:  # pragma: no cover - torch < 2.1
        return torch.empty((), dtype=dtype).element_size()


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Distinct fx nodes among the args/kwargs, in order (``x * x`` reads ``x`` once)."""
    seen: dict[torch.fx.Node, None] = {}
    for value in _iter_values((node.args, node.kwargs)):
        if isinstance(value, torch.fx.Node):
            seen.setdefault(value, None)
    return list(seen)


def _val(node: Any) -> Any:
    meta = getattr(node, "meta", None) or {}
    return meta.get("val", meta.get("tensor_meta"))


def _tensors(value: Any) -> list[Any]:
    return [v for v in _iter_values(value) if _is_tensor_like(v)]


def _input_tensors(node: torch.fx.Node) -> list[Any]:
    out: list[Any] = []
    for arg in _input_nodes(node):
        out.extend(_tensors(_val(arg)))
    return out


def _materialize(value: Any) -> Any:
    """Replace fx nodes in an args structure by their ``meta['val']`` (what the flop formulas expect)."""
    if isinstance(value, torch.fx.Node):
        return _val(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items()}
    return value


def _arg(node: torch.fx.Node, name: str, default: Any = None) -> Any:
    """Value of a named schema argument, whether passed positionally, by keyword or left at its default."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, arg in enumerate(schema.arguments):
        if arg.name != name:
            continue
        if i < len(node.args) and not arg.kwarg_only:
            return node.args[i]
        if name in node.kwargs:
            return node.kwargs[name]
        try:
            return arg.default_value if arg.has_default_value() else default
        except Exception:  # pragma: no cover - older Argument API
            return default
    return default


def _element_count(node: torch.fx.Node) -> int:
    """max(total output elements, largest input): what a pointwise op writes or a reduction reads."""
    out = sum(_numel(t) for t in _tensors(_val(node)))
    biggest_in = max((_numel(t) for t in _input_tensors(node)), default=0)
    return max(out, biggest_in)


def _attention_flops(node: torch.fx.Node, backward: bool) -> int:
    """Matmul FLOPs of fused attention. Forward: S = QKᵀ and O = PV, i.e. 2·BH·Lq·Lk·(Dqk + Dv) (= 4·BH·Lq·Lk·D).
    Backward: recompute S, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q, i.e. 2·BH·Lq·Lk·(3·Dqk + 2·Dv)
    (= 2.5× forward). Causal masking skips half of the score matrix. Softmax work is ignored (≪ matmuls)."""
    first = 1 if backward else 0  # backwards take grad_out first, then query, key, value
    q, k, v = (_val(a) for a in node.args[first:first + 3])
    *batch, lq, dqk = (_as_int(s) for s in q.shape)
    lk = _as_int(k.shape[-2])
    dv = _as_int(v.shape[-1])
    per_dim = 2 * math.prod(batch) * lq * lk  # batch = B·H_q: GQA key/value heads are broadcast
    flops = per_dim * ((3 * dqk + 2 * dv) if backward else (dqk + dv))
    if _arg(node, "is_causal", False):
        flops //= 2
    return flops


def _matvec_flops(node: torch.fx.Node) -> int:
    """2 FLOPs per multiply-add: mv/addmv/dot read every matrix element once, addbmm/_int_mm/linear via shapes."""
    name = _op_name(node.target).rstrip("_")
    tensors = [_val(a) for a in node.args if isinstance(a, torch.fx.Node)]
    if name in ("mv", "dot", "vdot"):
        return 2 * _numel(tensors[0])
    if name == "addmv":
        return 2 * _numel(tensors[1])
    if name == "addbmm":  # (self, batch1 [b,n,m], batch2 [b,m,p])
        b, n, m = (_as_int(s) for s in tensors[1].shape)
        return 2 * b * n * m * _as_int(tensors[2].shape[-1])
    if name == "linear":  # (input [..., k], weight [n, k])
        return 2 * _numel(tensors[0]) * _as_int(tensors[1].shape[0])
    a, b = tensors[0], tensors[1]  # _int_mm
    return 2 * _numel(a) * _as_int(b.shape[-1])


def _registry_flops(node: torch.fx.Node) -> int:
    target = node.target
    formula: Callable[..., Any] | None = _FLOP_REGISTRY.get(getattr(target, "overloadpacket", None))
    if formula is None:
        formula = _FLOP_REGISTRY[target]
    args = _materialize(node.args)
    kwargs = _materialize(dict(node.kwargs))
    return _as_int(formula(*args, out_val=_val(node), **kwargs))


def node_flops(node: torch.fx.Node) -> int:
    """Floating-point operations one execution of ``node`` performs (0 for views, data movement, non-calls).

    Never raises for an unusual op: if an exact formula fails, the per-element estimate is used instead.
    """
    if node.op != "call_function":
        return 0
    head = _loss_head(node)
    if head is not None:
        return head[0]
    kind, per_element = _classify(node.target)
    if kind in ("view", "data"):
        return 0
    try:
        if kind == "attn_fwd":
            return _attention_flops(node, backward=False)
        if kind == "attn_bwd":
            return _attention_flops(node, backward=True)
        if kind == "registry":
            return _registry_flops(node)
        if kind == "matvec":
            return _matvec_flops(node)
    except Exception:
        per_element = _POINTWISE_FLOPS
    if not _tensors(_val(node)):  # SymInt arithmetic, sym_size, ...: no kernel
        return 0
    return int(per_element * _element_count(node))


def _loss_head(node: torch.fx.Node) -> tuple[int, int] | None:
    """(FLOPs, bytes) of the chunked loss head's ops (``karma_fx.loss_ops``), whose loop over chunks no
    per-op formula sees: per chunk a matmul with the whole weight (forward), three in the backward (the logits
    again, then both gradients), and the weight read once per chunk and its fp32 gradient read and written."""
    name = _op_name(node.target)
    if name not in ("linear_ce", "linear_ce_backward") or "karma" not in str(node.target):
        return None
    backward = name == "linear_ce_backward"
    h, weight = (_val(a) for a in node.args[1:3]) if backward else (_val(a) for a in node.args[0:2])
    chunk = node.args[7] if backward else node.args[5]
    dtype = node.args[8] if backward else node.args[6]
    weight_grad = bool(node.args[9]) if backward and len(node.args) > 9 else True
    tokens, hidden, classes = _as_int(h.shape[0]), _as_int(h.shape[1]), _as_int(weight.shape[0])
    chunks = max(1, -(-tokens // max(1, int(chunk))))
    size = _itemsize(dtype) if isinstance(dtype, torch.dtype) else _itemsize(h.dtype)
    matmul = 2 * tokens * hidden * classes
    pointwise = 8 * tokens * classes
    weight_bytes = classes * hidden * size
    if not backward:
        return matmul + pointwise, chunks * weight_bytes + tokens * hidden * size + 8 * tokens
    grad_weight = classes * hidden * 4 if weight_grad else 0
    return ((3 if weight_grad else 2) * matmul + pointwise,
            chunks * (2 * weight_bytes + 2 * grad_weight) + 2 * tokens * hidden * size + 12 * tokens)


def _footprint(t: Any) -> int:
    """Bytes a kernel touches reading ``t``: numel·itemsize, but no more than its storage (expanded inputs)."""
    nbytes = _numel(t) * _itemsize(t.dtype)
    if isinstance(t, torch.Tensor) and nbytes:
        try:
            nbytes = min(nbytes, t.untyped_storage().nbytes())
        except Exception:  # sparse / functional wrappers without a storage
            pass
    return nbytes


def node_bytes_accessed(node: torch.fx.Node) -> int:
    """Bytes read (each distinct tensor input once) plus bytes written (all tensor outputs); 0 for views.

    This is the memory-traffic side of the roofline: for pointwise, norm and copy ops it dominates the time.
    """
    if node.op != "call_function" or is_view_op(node):
        return 0
    head = _loss_head(node)
    if head is not None:
        return head[1]
    read = sum(_footprint(t) for t in _input_tensors(node))
    written = sum(_numel(t) * _itemsize(t.dtype) for t in _tensors(_val(node)))
    return int(read + written)


def node_dtype(node: torch.fx.Node) -> str:
    """Dtype of the largest floating tensor among inputs and outputs, e.g. ``"bfloat16"``; ``"float32"`` if none.

    It picks the peak-FLOP/s column of the device: a bf16 matmul with an fp32 bias is a bf16 matmul. The chunked
    loss head's matmuls run in the dtype it is given (bf16 under autocast, its fp32 weight cast chunk by chunk).
    """
    if _op_name(node.target) in ("linear_ce", "linear_ce_backward") and "karma" in str(node.target):
        dtype = node.args[8] if _op_name(node.target) == "linear_ce_backward" else node.args[6]
        if isinstance(dtype, torch.dtype):
            return str(dtype).removeprefix("torch.")
    best_numel, best = -1, "float32"
    for t in _tensors(_val(node)) + _input_tensors(node):
        dtype = t.dtype
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            n = _numel(t)
            if n > best_numel:
                best_numel, best = n, str(dtype).removeprefix("torch.")
    return best


def is_random(node: torch.fx.Node) -> bool:
    """True when running the node twice may give different results (dropout, rand*, bernoulli, ...).

    Uses the ``nondeterministic_seeded`` op tag, but ops that are only tagged because of an optional dropout
    (fused attention, ``native_dropout``) count as random only when their dropout probability is > 0 and, for
    ``native_dropout``, ``train`` is not False: otherwise every attention op would be barred from recompute.
    """
    if node.op != "call_function":
        return False
    target = node.target
    if any(hint in str(target) for hint in _RANDOM_NAME_HINTS):
        return True
    tags = getattr(target, "tags", ())
    seeded = getattr(torch.Tag, "nondeterministic_seeded", None)
    if seeded is None or seeded not in tags:
        return False
    name = _op_name(target)
    for prob_name in _DROPOUT_PROB_ARGS:
        if prob_name == "p" and "dropout" not in name:
            continue
        p = _arg(node, prob_name, None)
        if isinstance(p, (int, float)) and p == 0:
            return False
    if "dropout" in name and _arg(node, "train", None) is False:
        return False
    return True


def is_view_op(node: torch.fx.Node) -> bool:
    """True when the node's output aliases one of its inputs (a view or ``getitem``): it allocates nothing and
    costs nothing, so passes fold it into its base storage."""
    if node.op != "call_function":
        return False
    return _classify(node.target)[0] == "view"
