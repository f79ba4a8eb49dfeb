"""Per-node statistics on real captured joint graphs (AOTAutograd on fake tensors) and on hand-built graphs."""
from __future__ import annotations

import operator
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

try:
    from karma_fx.passes.op_stats import (
        DATA_MOVEMENT_OPS,
        is_random,
        is_view_op,
        node_bytes_accessed,
        node_dtype,
        node_flops,
    )
except ImportError:  # package not installed: run from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from passes.op_stats import (  # type: ignore[no-redef]
        DATA_MOVEMENT_OPS,
        is_random,
        is_view_op,
        node_bytes_accessed,
        node_dtype,
        node_flops,
    )

aten = torch.ops.aten


class _Flat(nn.Module):
    """Returns the model's tensor outputs as a flat tuple, the form aot_module_simplified wants."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in pytree.tree_leaves(self.m(*args)) if isinstance(t, torch.Tensor))


def capture_joint(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    from functorch.compile import default_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    captured: dict[str, torch.fx.GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        captured["joint"] = joint
        return default_partition(joint, joint_inputs, **kwargs)

    aot_module_simplified(_Flat(model), args, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                          partition_fn=partition)
    return captured["joint"]


class Block(nn.Module):
    """Pre-norm transformer block with causal SDPA, GELU MLP and dropout."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, length, d))
        return x + self.mlp(x)


B, L, D, H = 2, 32, 64, 4


@pytest.fixture(scope="module")
def transformer() -> torch.fx.GraphModule:
    model = nn.Sequential(*[Block(D, H) for _ in range(20)], nn.Flatten(), nn.Linear(L * D, 3))
    return capture_joint(model, torch.randn(B, L, D))


@pytest.fixture(scope="module")
def mlp() -> torch.fx.GraphModule:
    return capture_joint(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(32, 64))


def calls(gm: torch.fx.GraphModule, target=None) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and (target is None or n.target == target)]


def _has_tensor_output(node: torch.fx.Node) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(node.meta.get("val")))


def test_addmm_flops_exact(mlp):
    nodes = calls(mlp, aten.addmm.default)
    assert nodes
    for n in nodes:
        m, k = n.args[1].meta["val"].shape
        k2, cols = n.args[2].meta["val"].shape
        assert k == k2
        assert node_flops(n) == 2 * m * cols * k
    assert {node_flops(n) for n in nodes} == {2 * 32 * 64 * 128, 2 * 32 * 128 * 10}


def test_mm_flops_exact(mlp):
    for n in calls(mlp, aten.mm.default):
        (m, k), (_, cols) = n.args[0].meta["val"].shape, n.args[1].meta["val"].shape
        assert node_flops(n) == 2 * m * k * cols


def test_registry_ops_match_flop_counter_mode():
    """Matmul + conv FLOPs of the joint graph equal what FlopCounterMode counts for one eager fwd+bwd."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2), nn.Flatten(),
                          nn.Linear(4 * 7 * 7, 10))
    x = torch.randn(2, 3, 16, 16)
    gm = capture_joint(model, x)
    conv = calls(gm, aten.convolution.default)
    conv_bwd = calls(gm, aten.convolution_backward.default)
    assert len(conv) == 2 and len(conv_bwd) == 2
    # forward conv: 2 * out elements * (in_channels * kh * kw)
    out = conv[0].meta["val"]
    assert node_flops(conv[0]) == 2 * out.numel() * 3 * 3 * 3
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    registry_ops = {aten.convolution.default, aten.convolution_backward.default, aten.addmm.default, aten.mm.default}
    ours = sum(node_flops(n) for n in calls(gm) if n.target in registry_ops)
    assert ours == counter.get_total_flops()


def test_sdpa_cpu_flash_formula(transformer):
    fwd = calls(transformer, aten._scaled_dot_product_flash_attention_for_cpu.default)
    bwd = calls(transformer, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert len(fwd) == 20 and len(bwd) == 20
    d = D // H
    expected_fwd = 4 * B * H * L * L * d // 2  # two matmuls, causal halves them
    assert all(node_flops(n) == expected_fwd for n in fwd)
    assert all(node_flops(n) == expected_fwd * 5 // 2 for n in bwd)


def test_sdpa_not_causal():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    kv = torch.randn(2, 3, 24, 8, requires_grad=True)
    gm = capture_joint(Attn(), q, kv, torch.randn(2, 3, 24, 8, requires_grad=True))
    fwd = calls(gm, aten._scaled_dot_product_flash_attention_for_cpu.default)
    bwd = calls(gm, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert node_flops(fwd[0]) == 4 * 2 * 3 * 16 * 24 * 8
    assert node_flops(bwd[0]) == 10 * 2 * 3 * 16 * 24 * 8


def test_no_compute_op_is_free(transformer):
    checked = 0
    for n in calls(transformer):
        if is_view_op(n) or not _has_tensor_output(n):
            continue
        name = n.target._schema.name.split("::")[-1]
        if name in DATA_MOVEMENT_OPS:
            assert node_flops(n) == 0
            assert node_bytes_accessed(n) > 0
            continue
        checked += 1
        assert node_flops(n) > 0, n.format_node()
        assert node_bytes_accessed(n) > 0, n.format_node()
    assert checked > 100


def test_view_ops_are_free(transformer):
    views = {aten.view.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.detach.default,
             aten._unsafe_view.default, aten.unbind.int, operator.getitem}
    seen = set()
    for n in calls(transformer):
        if n.target in views:
            seen.add(n.target)
            assert is_view_op(n), n.format_node()
            assert node_flops(n) == 0 and node_bytes_accessed(n) == 0
    assert {aten.view.default, aten.t.default, operator.getitem} <= seen
    for target in (aten.addmm.default, aten.clone.default, aten.native_dropout.default, aten.add.Tensor):
        assert not any(is_view_op(n) for n in calls(transformer, target))


def test_placeholders_and_outputs(mlp):
    for n in mlp.graph.nodes:
        if n.op != "call_function":
            assert node_flops(n) == 0 and node_bytes_accessed(n) == 0 and not is_view_op(n) and not is_random(n)


def test_random(transformer):
    dropout = calls(transformer, aten.native_dropout.default)
    assert dropout and all(is_random(n) for n in dropout)
    # the CPU SDPA op carries the nondeterministic_seeded tag only for its optional dropout (p = 0 here)
    for target in (aten._scaled_dot_product_flash_attention_for_cpu.default, aten.addmm.default,
                   aten.native_dropout_backward.default, aten.gelu.default):
        assert not any(is_random(n) for n in calls(transformer, target))


def _graph(build) -> torch.fx.Graph:
    """Hand-built graph with real tensors in meta['val']: build(graph, placeholder) adds nodes."""
    g = torch.fx.Graph()

    def placeholder(name: str, value: torch.Tensor) -> torch.fx.Node:
        node = g.placeholder(name)
        node.meta["val"] = value
        return node

    build(g, placeholder)
    return g


def _call(g: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    node = g.call_function(target, args, kwargs)
    real = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, (args, kwargs))
    node.meta["val"] = target(*real[0], **real[1])
    return node


def test_bytes_and_dtype_hand_built():
    out = {}

    def build(g, placeholder):
        a = placeholder("a", torch.randn(16, 32, dtype=torch.bfloat16))
        w = placeholder("w", torch.randn(32, 8, dtype=torch.bfloat16))
        bias = placeholder("bias", torch.randn(8))
        out["mm"] = _call(g, aten.mm.default, a, w)
        out["add"] = _call(g, aten.add.Tensor, out["mm"], bias)
        out["sq"] = _call(g, aten.mul.Tensor, bias, bias)
        row = placeholder("row", torch.randn(1, 8))
        out["exp"] = _call(g, aten.expand.default, row, [16, 8])
        out["sum"] = _call(g, aten.add.Tensor, out["exp"], out["mm"])
        out["rand"] = _call(g, aten.rand.default, [4, 4])
        out["idx"] = _call(g, aten.arange.default, 10)
        out["drop0"] = _call(g, aten.native_dropout.default, bias, 0.0, True)

    _graph(build)
    assert node_flops(out["mm"]) == 2 * 16 * 32 * 8
    assert node_bytes_accessed(out["mm"]) == (16 * 32 + 32 * 8 + 16 * 8) * 2
    assert node_dtype(out["mm"]) == "bfloat16"
    # bf16 + fp32 promotes to fp32 [16, 8]: the largest floating tensor is fp32
    assert node_dtype(out["add"]) == "float32"
    assert node_bytes_accessed(out["add"]) == 16 * 8 * 2 + 8 * 4 + 16 * 8 * 4
    assert node_bytes_accessed(out["sq"]) == 8 * 4 + 8 * 4  # same input read once
    assert node_flops(out["sq"]) == 8
    assert is_view_op(out["exp"]) and node_bytes_accessed(out["exp"]) == 0
    # an expanded input is read through its 8-element storage, not as 16x8 elements
    assert node_bytes_accessed(out["sum"]) == 8 * 4 + 16 * 8 * 2 + 16 * 8 * 4
    assert is_random(out["rand"]) and not is_random(out["drop0"])
    assert node_dtype(out["idx"]) == "float32"  # no floating tensor at all
    assert node_flops(out["idx"]) == 0 and node_bytes_accessed(out["idx"]) == 10 * 8


def test_fast_enough(transformer):
    nodes = list(transformer.graph.nodes)
    assert len(nodes) > 2000
    start = time.perf_counter()
    for n in nodes:
        node_flops(n)
        node_bytes_accessed(n)
        node_dtype(n)
        is_random(n)
        is_view_op(n)
    per_node = (time.perf_counter() - start) / len(nodes)
    assert per_node < 1e-3, f"{per_node * 1e6:.0f} us per node"


@pytest.mark.parametrize("fwd_target,bwd_target", [
    (aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_efficient_attention_backward.default),
    (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default),
    (aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default),
])
def test_gpu_attention_variants_hand_built(fwd_target, bwd_target):
    """GPU-only attention ops, described with meta tensors: same formula as the CPU op, causal halves it."""
    g = torch.fx.Graph()
    q, k, v, go = (g.placeholder(name) for name in ("q", "k", "v", "go"))
    q.meta["val"] = torch.empty(2, 8, 128, 64, device="meta")
    k.meta["val"] = v.meta["val"] = torch.empty(2, 2, 256, 64, device="meta")  # GQA: 2 kv heads
    go.meta["val"] = q.meta["val"]
    names = [a.name for a in fwd_target._schema.arguments]
    causal_fwd = g.call_function(fwd_target, (q, k, v), {"is_causal": True, "dropout_p": 0.0})
    dropout_fwd = g.call_function(fwd_target, (q, k, v), {"dropout_p": 0.1})
    assert "is_causal" in names
    # backward: only grad_out, q, k, v are read by the formula; the rest are passed by name as defaults
    bwd = g.call_function(bwd_target, (go, q, k, v), {"is_causal": False, "dropout_p": 0.0})
    per_dim = 2 * 2 * 8 * 128 * 256
    assert node_flops(causal_fwd) == per_dim * (64 + 64) // 2
    assert node_flops(dropout_fwd) == per_dim * (64 + 64)
    assert node_flops(bwd) == per_dim * 5 * 64
    assert not is_random(causal_fwd) and is_random(dropout_fwd)
