"""The chunked loss head (``karma_fx.loss_ops``, ``passes/loss_head.py``): the ops equal a cross-entropy over a
linear layer's logits; the trace recognises the head as models write it and leaves everything else alone; a
step with it trains as eager through both doors; and the planner chunks it only where memory needs it, the
allocator's peak then at the plan's."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import karma_fx
from karma_fx.loss_ops import linear_cross_entropy
from karma_fx.measure_run import AllocatorPeak
from karma_fx.passes.capture import capture
from karma_fx.simulate import simulate
from karma_fx.passes.loss_head import default_chunk
from karma_fx.plan import Plan

VOCAB, WIDTH = 4096, 64


class TiedLM(nn.Module):
    """Embedding, one block, a head tied to the embedding; Hugging Face's shift (``logits[:, :-1, :]``), an
    fp32 upcast and a padded batch (``ignore_index``)."""

    def __init__(self, loss: dict | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.loss = dict(loss or {})
        self.weighted = self.loss.pop("class_weights", False)
        if self.weighted:
            self.register_buffer("class_weights", torch.ones(VOCAB))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln(torch.tanh(self.fc(self.emb(ids))))).float()
        loss = dict(self.loss, **({"weight": self.class_weights} if self.weighted else {}))
        return F.cross_entropy(logits[:, :-1, :].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), **loss)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal to ``rel`` of the tensor's largest magnitude (the sum of a few hundred fp32 products, in another
    order, differs in its last bits)."""
    return bool((got - want).abs().max() <= rel * want.abs().max().clamp_min(1e-30))


def _batch(seed: int, batch: int = 4, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 4] = -100  # padding
    return ids, labels


def _train_both(step, model, reference, steps: int = 3) -> None:
    for i in range(steps):
        ids, labels = _batch(i)
        got, want = step(ids, labels), reference(ids, labels)
        got.backward()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (i, got.item(), want.item())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or _close(p.grad, q.grad), (i, name)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


# ---- the ops ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_chunked_ops_equal_cross_entropy_over_a_linear(bias, reduction):
    torch.manual_seed(0)
    n, d, v = 300, 32, 1000
    h = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.1).requires_grad_()
    b = (torch.randn(v) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,))
    t[::7] = -100
    inputs = [h, w] + ([b] if bias else [])
    want = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100, reduction=reduction)
    got = linear_cross_entropy(h, w, b, t, ignore_index=-100, reduction=reduction, chunk=64)
    assert torch.allclose(got, want, rtol=1e-5)
    for g, r in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        assert _close(g, r)


def test_under_autocast_the_chunked_head_is_as_close_to_fp32_as_eager_bf16_is():
    """bf16-mixed: the logits made in bf16 and upcast, as the unchunked head under autocast. Measured here: the
    loss equal to eager bf16's, the gradients within what eager bf16 itself deviates from fp32."""
    torch.manual_seed(0)
    n, d, v = 512, 64, 2048
    h = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.1).requires_grad_()
    t = torch.randint(0, v, (n,))
    fp32 = F.cross_entropy(F.linear(h, w), t)
    grads32 = torch.autograd.grad(fp32, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = F.cross_entropy(F.linear(h, w).float(), t)
        chunked = linear_cross_entropy(h, w, None, t, chunk=128)
    eager_grads, chunked_grads = torch.autograd.grad(eager, [h, w]), torch.autograd.grad(chunked, [h, w])
    assert torch.allclose(chunked, eager, rtol=1e-6)
    for c, e, f in zip(chunked_grads, eager_grads, grads32):
        eager_error = ((e - f).norm() / f.norm()).item()
        assert ((c - f).norm() / f.norm()).item() <= 1.5 * eager_error, eager_error


def test_the_default_chunk_holds_about_what_the_hidden_states_hold():
    assert default_chunk(8192, 768, 50257) == 128  # GPT-2: 126 tokens' logits are its 8192 tokens' states
    assert default_chunk(100, 64, 8192) == 64  # never below MIN_CHUNK...
    assert default_chunk(10, 64, 8192) == 10  # ...nor above the tokens there are


# ---- recognition ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("inductor", [False, True])
def test_the_head_is_recognised_in_either_trace(inductor):
    ids, labels = _batch(0)
    step = capture(TiedLM(), (ids, labels), inductor=inductor, loss_chunk=32)
    targets = [str(n.target) for n in step.joint.graph.nodes]
    assert step.loss_chunk == 32
    assert "karma.linear_ce.default" in targets and "karma.linear_ce_backward.default" in targets
    assert not any("log_softmax" in t or "nll_loss" in t for t in targets)


@pytest.mark.parametrize("loss", [{"label_smoothing": 0.1}, {"class_weights": True}, {"reduction": "none"}])
def test_a_loss_it_does_not_compute_is_left_alone(loss):
    class Summed(TiedLM):
        def forward(self, ids, labels):
            out = super().forward(ids, labels)
            return out.sum() if out.dim() else out

    ids, labels = _batch(0)
    step = capture(Summed(loss), (ids, labels), loss_chunk=32)
    assert step.loss_chunk == 0
    assert not any("karma.linear_ce" in str(n.target) for n in step.joint.graph.nodes)


@pytest.mark.parametrize("edit", ["divide", "mask", "transposed view"])
def test_logits_edited_before_the_loss_are_left_alone(edit):
    """The chunked head makes its logits from the hidden states: an edit of the logits it would not see (a
    temperature, a masked vocabulary entry, an in-place op through a view it does not follow) keeps the head
    as written."""
    class Edited(TiedLM):
        def forward(self, ids, labels):
            logits = self.head(self.ln(torch.tanh(self.fc(self.emb(ids))))).float()
            if edit == "divide":
                logits.div_(2.0)
            elif edit == "mask":
                logits[..., 0] = -1e4
            else:
                logits.transpose(0, 1).mul_(2.0)
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    step = capture(Edited(), _batch(0), loss_chunk=32)
    assert step.loss_chunk == 0


def test_a_frozen_head_gets_no_gradient_and_the_rest_are_exact():
    torch.manual_seed(0)
    model = TiedLM()
    model.head.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.1, requires_grad=False)  # untied, frozen
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, loss_chunk=48)
    _train_both(step, model, reference, steps=2)
    assert model.head.weight.grad is None


def test_a_plan_says_which_trace_it_names():
    plan = Plan("cpsat", 1000, loss_chunk=128)
    assert Plan.from_json(plan.to_json()).loss_chunk == 128
    assert ("loss head", "chunked, 128 tokens at a time") in plan.summary()


# ---- steps -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("door,compiler", [("compile", "eager"), ("backend", "eager"), ("compile", "inductor")])
def test_a_chunked_head_trains_as_eager(door, compiler):
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    if door == "compile":
        step = karma_fx.compile(model, budget=1.0, loss_chunk=48, compiler=compiler)
    else:
        torch._dynamo.reset()
        options = {"budget": 1.0, "loss_chunk": 48, "compiler": compiler}
        step = torch.compile(model, backend="karma", options=options, dynamic=False)
    _train_both(step, model, reference)
    if door == "compile":
        assert step.plan.loss_chunk == 48
        assert any("karma.linear_ce" in str(n.target) for n in step.graphs[0][0].graph.nodes)


def test_a_hugging_face_causal_lm_given_labels_is_chunked():
    from karma_fx.zoo import build

    model, args, kwargs = build("llama", "tiny", dropout=0.0)
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, loss_chunk=8)
    for _ in range(2):
        got, want = step(*args, **kwargs).loss, reference(*args, **kwargs).loss
        got.backward()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-5)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert _close(p.grad, q.grad)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert step.plan.loss_chunk == 8


def _measured(step, model) -> int:
    ids, labels = _batch(9)
    model.zero_grad(set_to_none=True)
    with AllocatorPeak(model.parameters(), ids, labels) as meter:
        step(ids, labels).backward()
    return meter.peak_bytes


def test_the_planner_chunks_the_head_only_where_memory_needs_it():
    """By default (``loss_chunk=None``) the head is a choice: left whole where the budget holds it, chunked
    where that is what fits, and the floor named counts the chunked head."""
    torch.manual_seed(0)
    model = TiedLM()
    roomy = karma_fx.compile(model, budget=1.0)
    for i in range(3):
        model.zero_grad(set_to_none=True)
        roomy(*_batch(i)).backward()
    assert roomy.plan.loss_chunk == 0
    unplanned = roomy.unplanned_peak_bytes

    whole = karma_fx.compile(model, budget=1.0, loss_chunk=0)
    for i in range(2):
        model.zero_grad(set_to_none=True)
        whole(*_batch(i)).backward()
    assert roomy.min_budget_bytes < 0.6 * whole.min_budget_bytes  # the chunked floor

    tight = karma_fx.compile(model, budget=0.5)
    for i in range(4):
        model.zero_grad(set_to_none=True)
        tight(*_batch(i)).backward()
    assert tight.plan.loss_chunk > 0
    peak = _measured(tight, model)
    assert peak <= 0.5 * unplanned, (peak, unplanned)
    assert abs(peak - tight.predicted_peak_bytes) <= 0.01 * tight.predicted_peak_bytes


def test_ops_a_chunked_trace_shares_with_the_step_cost_what_they_cost_there():
    """``shared_op_times``: the ops of two traces are matched in order by what they compute and the sizes they
    write, never by name (the chunked trace numbers its nodes otherwise) nor by what they read, and each matched
    op of the second takes the first's time; an op only one trace has, or one writing other sizes, keeps its
    own."""
    from karma_fx.costs import Costs
    from karma_fx.pricing import shared_op_times
    from karma_fx.problem import Op, Problem, Storage

    def problem(ops: list[tuple[str, str, int]]) -> Problem:  # a chain of (name, target, output bytes)
        built = tuple(Op(n, t, "fwd", (ops[k - 1][0],) if k else ("x",), (n,)) for k, (n, t, _) in enumerate(ops))
        storages = (Storage("x", 64, "input", None, (0,)),) + tuple(
            Storage(n, b, "temp", k, (k + 1,) if k + 1 < len(ops) else (), is_output=k + 1 == len(ops))
            for k, (n, _, b) in enumerate(ops))
        return Problem(ops=built, storages=storages, num_fwd_ops=len(ops))

    def costs(times: tuple[float, ...]) -> Costs:
        return Costs(op_time_us=times, d2h_bytes_per_us=1.0, h2d_bytes_per_us=1.0, copy_latency_us=0.0, device="cpu")

    base = problem([("a", "aten.mul.Tensor", 64), ("b", "aten.mm.default", 32), ("c", "aten.sum.default", 4)])
    twin = problem([("a", "aten.mul.Tensor", 64), ("head", "karma.linear_ce.default", 16), ("b_1", "aten.mm.default", 32),
                    ("c", "aten.sum.default", 8)])
    timed = shared_op_times(base, costs((1.0, 2.0, 3.0)), twin, costs((10.0, 20.0, 30.0, 40.0)))
    assert timed.op_time_us == (1.0, 20.0, 2.0, 40.0)  # the mm renamed (reading other sizes) matched
    middle = problem([("a", "aten.mul.Tensor", 64), ("e", "aten.exp.default", 64), ("b", "aten.mm.default", 32),
                      ("c", "aten.sum.default", 4)])
    timed = shared_op_times(base, costs((1.0, 2.0, 3.0)), middle, costs((10.0, 20.0, 30.0, 40.0)))
    assert timed.op_time_us == (1.0, 20.0, 2.0, 3.0)  # the common start and end, around an op only it has


@pytest.mark.parametrize("door,compiler", [("prepare", "eager"), ("compile", "eager"), ("compile", "inductor")])
def test_a_chunked_trace_is_timed_as_the_step_where_they_agree(door, compiler):
    """Measured op times of the step and of its chunked twins agree wherever the traces compute the same
    thing, through both doors (``karma_fx.prepare(loss_chunk=None)`` and ``karma_fx.compile``): the faster plan
    of the two is chosen on what differs, the head, not on two timings of the same ops."""
    torch.manual_seed(0)
    model = TiedLM()
    if door == "prepare":
        base = karma_fx.prepare(model, _batch(0), compiler=compiler, costs="measured", loss_chunk=None)
        twins = base.twins
    else:
        step = karma_fx.compile(model, budget=1.0, compiler=compiler, costs="measured")
        model.zero_grad(set_to_none=True)
        step(*_batch(0)).backward()
        region = step.regions[0]
        base, twins = region.prepared, [t.prepared for t in region.twins]
    assert twins
    for twin in twins:
        # what an op computes and the sizes it writes (under Inductor a result the chunked head reads is stored)
        def writes(prepared, op):
            return op.target, [prepared.problem.storage(n).size_bytes for n in op.outputs
                               if not n.endswith(":scratch")]

        same = next(k for k, (a, b) in enumerate(zip(base.problem.ops, twin.problem.ops))
                    if writes(base, a) != writes(twin, b))
        assert same >= 3  # the ops before the head: the same in both traces, timed once
        assert twin.costs.op_time_us[:same] == base.costs.op_time_us[:same]
        base_mms = [t for op, t in zip(base.problem.ops, base.costs.op_time_us) if op.target == "aten.mm.default"]
        twin_mms = [t for op, t in zip(twin.problem.ops, twin.costs.op_time_us) if op.target == "aten.mm.default"]
        assert twin_mms[-2:] == base_mms[-2:]  # the layer's backward matmuls, after the head
        assert twin.keep.makespan_us == simulate(twin.problem, (), twin.costs).makespan_us  # timed with them


def test_plan_chooses_the_head_as_compile_does():
    """``karma_fx.prepare(loss_chunk=None)`` (what ``karma_fx.plan`` and the CLI use) captures the chunked
    twins; the plan keeps the head whole wherever the step as written fits, chunks it where that plans better
    below, and a refusal names the lowest floor."""
    from karma_fx.errors import InfeasibleBudgetError

    torch.manual_seed(0)
    # op times on the roofline: deterministic, where measured times of two near-equal steps are not
    prepared = karma_fx.prepare(TiedLM(), _batch(0), compiler="eager", costs="roofline", loss_chunk=None)
    assert prepared.twins and all(t.loss_chunk for t in prepared.twins)
    floor = min(p.min_peak_bytes() for p in [prepared] + prepared.twins)
    assert floor < prepared.min_peak_bytes()
    assert prepared.plan(1.0).plan.loss_chunk == 0  # as compile: the step as written wherever it fits
    tight = prepared.plan(0.5).plan
    assert tight.fits and tight.loss_chunk > 0
    assert tight.unplanned_peak_bytes == prepared.unplanned_peak_bytes  # against the model's own step
    assert not prepared.plan(1024, raise_if_infeasible=False).plan.fits
    with pytest.raises(InfeasibleBudgetError) as info:
        prepared.plan(1024)
    assert info.value.min_budget_bytes == floor


def test_the_chunked_backward_without_a_bias_holds_no_bias_accumulator():
    """Without a bias the backward's third result is empty, and so is its storage: a view of the [V] accumulator
    kept its bytes for as long as the result lived, which the plan counts as nothing (4 KiB above the plan on a
    GPT of vocabulary 1024, every chunked step)."""
    h, w = torch.randn(8, 16), torch.randn(32, 16)
    target, grad = torch.randint(0, 32, (8,)), torch.ones(8)
    _, lse = torch.ops.karma.linear_ce(h, w, None, target, -100, 4, torch.float32)
    _, _, grad_b = torch.ops.karma.linear_ce_backward(grad, h, w, None, target, lse, -100, 4, torch.float32, True)
    assert grad_b.numel() == 0 and grad_b.untyped_storage().nbytes() == 0
