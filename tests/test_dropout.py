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


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_karma_multiplies_equal_aten_bit_for_bit_on_any_value(dtype, p):
    """Chunked on a CPU (more elements than one chunk here), signed zeros, NaNs and infinities included: the
    forward rebuild rounds as ``native_dropout`` (scale in the data's dtype) and the backward as
    ``native_dropout_backward`` (scale in the compute dtype); in bf16 and fp16 the two differ at p=0.1."""
    from karma_fx.dropout_ops import _CHUNK

    x = torch.randn(3 * _CHUNK + 5).to(dtype)
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1.0]).to(dtype)
    torch.manual_seed(3)
    out, mask = torch.ops.aten.native_dropout(x, p, True)
    assert _same_bits(torch.ops.karma.masked_scale(x, mask, 1 / (1 - p)), out)
    mask[:6] = False  # the special values dropped too
    out = x.mul(mask.to(dtype).mul_(1 / (1 - p)))  # native_dropout's own product, on this mask
    assert _same_bits(torch.ops.karma.masked_scale(x, mask, 1 / (1 - p)), out)
    grad = torch.ops.aten.native_dropout_backward(x, mask, 1 / (1 - p))
    assert _same_bits(torch.ops.karma.dropout_backward(x, mask, 1 / (1 - p)), grad)
    strided, strided_mask = x[:5000].view(-1, 5)[:, :3], mask[:5000].view(-1, 5)[:, :3]  # ATen's own product
    assert _same_bits(torch.ops.karma.dropout_backward(strided, strided_mask, 2.0),
                      torch.ops.aten.native_dropout_backward(strided, strided_mask, 2.0))


def test_karma_multiplies_allocate_no_mask_sized_scratch_on_a_cpu():
    """ATen's CPU kernels multiply by a copy of the mask in the data's dtype, as large as their output; the
    karma ops' scratch is one chunk's, which the allocator's own events show."""
    from karma_fx.dropout_ops import _CHUNK
    from karma_fx.measure_run import AllocatorPeak

    grad, mask = torch.randn(16 * _CHUNK), torch.rand(16 * _CHUNK) > 0.1
    output = grad.numel() * grad.element_size()

    def above_inputs(fn) -> int:
        with AllocatorPeak([grad, mask]) as live:
            fn()
        return live.peak_bytes - live.baseline_bytes

    assert above_inputs(lambda: torch.ops.aten.native_dropout_backward(grad, mask, 1.25)) >= 2 * output
    assert above_inputs(lambda: torch.ops.karma.dropout_backward(grad, mask, 1.25)) <= output + 4 * _CHUNK
    assert above_inputs(lambda: torch.ops.karma.masked_scale(grad, mask, 1.25)) <= output + 4 * _CHUNK


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


def test_a_split_dropouts_backward_is_karmas_except_for_inductor():
    """Captured for the eager runtime, a split dropout's backward is ``karma.dropout_backward``; for a graph
    that Inductor compiles (``backward=False``) it stays ``native_dropout_backward``, which Inductor fuses."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from karma_fx.passes.capture import capture

    model, args, kwargs = _gpt()
    targets = {n.target for n in capture(model, args, kwargs).joint.graph.nodes}
    assert torch.ops.karma.dropout_backward.default in targets
    assert torch.ops.aten.native_dropout_backward.default not in targets

    def forward_and_backward(x, grad):
        out, mask = torch.ops.aten.native_dropout(x, 0.2, True)
        return out, torch.ops.aten.native_dropout_backward(grad, mask, 1.25)

    joint = make_fx(forward_and_backward)(torch.randn(8), torch.randn(8))
    for backward, kept in ((True, torch.ops.karma.dropout_backward.default),
                           (False, torch.ops.aten.native_dropout_backward.default)):
        targets = [n.target for n in split_dropout(joint, backward=backward).graph.nodes]
        assert kept in targets and torch.ops.karma.dropout_mask.default in targets
        assert len({torch.ops.karma.dropout_backward.default, torch.ops.aten.native_dropout_backward.default}
                   & set(targets)) == 1


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


def test_a_step_that_moves_nothing_runs_the_graph_it_planned():
    """With nothing moved the eager runtime still runs the split graph the plan was made on, so that it
    allocates what the plan counts (ATen's CPU dropout backward has a mask-sized scratch the split one has
    not), and trains exactly like eager."""
    from test_compile import assert_same_training

    model, args, kwargs = _gpt()
    compiled = karma_fx.compile(model, budget=1.0, strategy="keep")
    assert_same_training(model, compiled, args, kwargs, steps=2)
    assert compiled.plan.decisions == ()
    (fw, bw), = compiled.graphs
    assert any(n.target is torch.ops.karma.dropout_mask.default for n in fw.graph.nodes)
    assert any(n.target is torch.ops.karma.dropout_backward.default for n in bw.graph.nodes)
    assert not any(n.target is torch.ops.aten.native_dropout_backward.default for n in bw.graph.nodes)
