"""Dropout without its output: the mask is the random op, the output is rebuilt from it.

Checks that the split computes what ``native_dropout`` computes bit for bit (masks and outputs, fp32 and
bf16), that the planner then rebuilds dropout outputs instead of keeping them, that a plan doing so trains
exactly like eager PyTorch, and that the random op itself is never re-run.
"""
from __future__ import annotations

import pytest
import torch

import karma_fx
from karma_fx.passes.dropout import split_dropout
from karma_fx.zoo import build, output_to_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_ops_draw_and_round_like_native_dropout(dtype):
    x = torch.randn(33, 257).to(dtype)
    torch.manual_seed(7)
    out, mask = torch.ops.aten.native_dropout(x, 0.1, True)
    torch.manual_seed(7)
    mask2 = torch.ops.karma.dropout_mask(x, 0.1)
    out2 = torch.ops.karma.masked_scale(x, mask2, 1 / 0.9)
    assert mask2.dtype == torch.bool and torch.equal(mask, mask2)
    assert torch.equal(out, out2)


def test_mask_op_consumes_the_random_stream_like_native_dropout():
    x = torch.randn(64, 64)
    torch.manual_seed(1)
    torch.ops.aten.native_dropout(x, 0.3, True)
    after_native = torch.rand(4)
    torch.manual_seed(1)
    torch.ops.karma.dropout_mask(x, 0.3)
    after_split = torch.rand(4)
    assert torch.equal(after_native, after_split)


def _gpt():
    return build("megatron_gpt", "tiny", batch=2, seq=128, layers=2, hidden=128, heads=4, vocab=512)


def test_training_dropout_is_split_and_eval_dropout_is_left_alone():
    model, args, kwargs = _gpt()
    prep = karma_fx.prepare(model, args, kwargs)
    targets = {op.target for op in prep.problem.ops}
    assert "karma.dropout_mask.default" in targets and "karma.masked_scale.default" in targets
    assert "aten.native_dropout.default" not in targets
    random_ops = [op for op in prep.problem.ops if op.random]
    assert random_ops and all(op.target == "karma.dropout_mask.default" for op in random_ops)
    # masks are 1 byte per element: a quarter of the fp32 output they gate
    sizes = {s.name: s.size_bytes for s in prep.problem.storages}
    for op in prep.problem.ops:
        if op.target == "karma.masked_scale.default":
            assert sizes[op.inputs[1]] * 4 == sizes[op.outputs[0]]

    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    nd = g.call_function(torch.ops.aten.native_dropout.default, (x, 0.1, False))
    g.output((g.call_function(__import__("operator").getitem, (nd, 0)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert split_dropout(gm) is gm  # eval-mode dropout is deterministic already


def test_planner_rebuilds_dropout_outputs_and_never_reruns_the_mask():
    model, args, kwargs = _gpt()
    prep = karma_fx.prepare(model, args, kwargs)
    plan = prep.plan(budget=0.8, strategy="checkpoint").plan
    rebuilt = [t for d in plan.recomputes for t in d.tensors]
    reran = [o for d in plan.recomputes for o in d.ops]
    masks = {op.outputs[0] for op in prep.problem.ops if op.target == "karma.dropout_mask.default"}
    assert any(t.startswith("masked_scale") for t in rebuilt), rebuilt
    assert not any(o.startswith("dropout_mask") for o in reran)
    assert not masks & set(rebuilt)


def test_a_plan_rebuilding_dropout_outputs_trains_like_eager():
    from test_compile import assert_same_training

    model, args, kwargs = _gpt()
    compiled = karma_fx.compile(model, budget=0.8, strategy="checkpoint")
    assert_same_training(model, compiled, args, kwargs, steps=2)  # same masks, loss and gradients to 1e-5
    assert any(t.startswith("masked_scale") for d in compiled.plan.recomputes for t in d.tensors)
    (fw, bw), = compiled.graphs
    assert any(n.target is torch.ops.karma.masked_scale.default for n in bw.graph.nodes)
    assert not any(n.target is torch.ops.karma.dropout_mask.default for n in bw.graph.nodes)
