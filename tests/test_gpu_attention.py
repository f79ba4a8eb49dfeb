"""A model on meta is planned as a CUDA GPU runs it: attention with dropout is the fused kernel (output,
logsumexp and the generator's seed/offset saved), not the CPU's math path with S×S probabilities and masks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import karma_fx
from karma_fx.passes.gpu_attention import GpuAttention
from karma_fx.zoo import build


def _square_saved(prep, heads, seq):
    """Saved activations shaped (batch, head, query, key): attention probabilities and their dropout masks (a
    mask bias shared by the heads, which the fused kernel also saves, is not per head)."""
    nodes = {n.name: n for n in prep.step.joint.graph.nodes}
    shapes = {s.name: getattr(nodes[s.name].meta.get("val"), "shape", ()) for s in prep.problem.saved_activations()
              if s.name in nodes}
    return [name for name, shape in shapes.items() if len(shape) == 4 and tuple(shape[1:]) == (heads, seq, seq)]


def test_meta_model_with_attention_dropout_saves_no_square_attention_state():
    results = {}
    for device in ("cpu", "meta"):
        model, args, kwargs = build("gpt2", "tiny", device=device, seq=24)  # seq ≠ head size
        batch, seq = kwargs["input_ids"].shape
        assert model.config.attn_pdrop > 0
        prep = karma_fx.prepare(model, args, kwargs, device="h100")
        results[device] = (prep, _square_saved(prep, model.config.n_head, seq))
    cpu, meta = results["cpu"], results["meta"]
    assert cpu[1], "the CPU's math path saves S×S probabilities and masks"
    assert not meta[1], meta[1]
    fused = [op for op in meta[0].problem.ops if op.target == "aten._scaled_dot_product_efficient_attention.default"]
    assert len(fused) == model.config.n_layer and all(op.flops > 0 for op in fused)
    assert meta[0].keep.peak_bytes < cpu[0].keep.peak_bytes


def test_gpu_attention_leaves_attention_without_dropout_and_other_calls_alone():
    q = torch.randn(1, 2, 8, 4)
    with GpuAttention():
        plain = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0, is_causal=True)
        other = torch.relu(q)
    assert torch.equal(plain, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert torch.equal(other, torch.relu(q))
