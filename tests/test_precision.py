"""Precision as an input: bf16-mixed (fp32 weights under autocast) and bf16 steps are captured as they run."""
from __future__ import annotations

import copy

import pytest
import torch

import karma_fx
from karma_fx.zoo import ZooError, build, output_to_loss


def matmul_dtypes(problem) -> set[str]:
    """Dtypes of the linear layers' matmuls (HF attention upcasts its bmm to fp32 on purpose)."""
    return {op.dtype for op in problem.ops if op.target.split(".")[1] in ("mm", "addmm")}


def test_bf16_mixed_captures_bf16_matmuls_and_plans_a_different_step():
    fp32 = karma_fx.prepare(*build("gpt2", "tiny"))
    mixed = karma_fx.prepare(*build("gpt2", "tiny", precision="bf16-mixed"))
    assert matmul_dtypes(fp32.problem) == {"float32"}
    assert matmul_dtypes(mixed.problem) == {"bfloat16"}
    assert mixed.problem.ops != fp32.problem.ops
    # the autocast casts add bf16 copies of weights and activations: a different step to plan
    assert mixed.unplanned_peak_bytes != fp32.unplanned_peak_bytes
    # at real size (one layer, on the meta device) the bf16 matmuls make the step faster on the H100 preset
    real = {precision: karma_fx.prepare(*build("gpt2", "real", device="meta", layers=1, precision=precision))
            for precision in ("fp32", "bf16-mixed")}
    assert real["bf16-mixed"].keep.makespan_us < 0.7 * real["fp32"].keep.makespan_us


def test_bf16_weights_and_the_meta_device():
    model, args, kwargs = build("gpt2", "real", precision="bf16", device="meta", layers=1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prepared = karma_fx.prepare(model, args, kwargs)
    assert matmul_dtypes(prepared.problem) == {"bfloat16"}
    with pytest.raises(ZooError, match="precision"):
        build("gpt2", "tiny", precision="fp16")


def test_bf16_mixed_trains_under_compile_as_under_torch_compile():
    model, args, kwargs = build("cnn", "tiny", precision="bf16-mixed")
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, strategy="keep")
    torch.manual_seed(0)
    loss = output_to_loss(step(*args, **kwargs))
    loss.backward()
    torch._dynamo.reset()
    torch.manual_seed(0)
    want = output_to_loss(torch.compile(reference, backend="aot_eager", dynamic=False)(*args, **kwargs))
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_cli_plans_in_the_regime_asked(capsys):
    from karma_fx.cli import main

    assert main(["plan", "gpt2", "--size", "tiny", "--precision", "bf16-mixed", "--strategy", "keep",
                 "--budget", "1.0"]) == 0
    assert "gpt2-tiny-bf16-mixed" in capsys.readouterr().out


def test_real_gpt2_in_bf16_mixed_saves_linear_not_quadratic_attention_state():
    """Attention dropout 0 at real size lets SDPA take its fused kernel: per layer it saves its output and a
    logsumexp, O(B·H·S), and nothing of the S x S probabilities the math path keeps."""
    model, args, kwargs = build("gpt2", "real", device="meta", layers=1, precision="bf16-mixed")
    prepared = karma_fx.prepare(model, args, kwargs)
    ops = prepared.problem.ops
    targets = {op.target for op in ops}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    assert "aten._softmax.default" not in targets, "the math path's S x S softmax"
    batch, seq, heads, hidden = 8, 1024, 12, 768
    flash = next(i for i, op in enumerate(ops) if op.target.startswith("aten._scaled_dot_product_flash"))
    saved = [s for s in prepared.problem.storages if s.producer == flash]
    assert sum(s.size_bytes for s in saved) <= batch * seq * hidden * 4 + batch * heads * seq * 4
    assert all(s.size_bytes < batch * heads * seq * seq for s in saved)
