"""A measured step that breaks the budget teaches a margin, and the plans chosen after it keep the budget
(``karma_fx.margin``, ``Session._climbed``); the allocator's climb over a whole step (``GapMeter``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import karma_fx
from karma_fx.margin import MAX_CHECKS, Margins
from karma_fx.measure_run import GapMeter


def test_a_margin_is_learnt_only_where_the_budget_broke_and_only_grows():
    m = Margins()
    assert not m.learn((0,), measured=900, planned=800, budget=1000)  # within the budget: nothing to learn
    assert m.of((0,)) == 0
    assert not m.learn((0,), measured=1100, planned=800, budget=None)  # no budget in bytes yet
    assert m.learn((0,), measured=1100, planned=800, budget=1000)
    assert m.of((0,)) == 300 and m.of((0, 1)) == 0
    assert not m.learn((0,), measured=1050, planned=800, budget=1000)  # a smaller shortfall keeps the margin
    assert m.learn((0,), measured=1200, planned=800, budget=1000)
    assert m.of((0,)) == 400


def test_the_step_after_new_plans_is_let_pass_then_one_is_measured():
    """The first step under new plans compiles them and fills the host pool: the check is the one after."""
    m = Margins()
    assert not m.due((0,))
    m.learn((0,), measured=1100, planned=800, budget=1000)
    assert [m.due((0,)) for _ in range(3)] == [False, True, False]


def test_checks_stop_after_max_checks():
    m = Margins()
    seen = 0
    for k in range(MAX_CHECKS + 2):
        m.learn((0,), measured=1100 + k, planned=800, budget=1000)
        seen += sum(m.due((0,)) for _ in range(2))
    assert seen == MAX_CHECKS


def test_the_gap_meter_reports_the_whole_steps_climb():
    """Stopped by the backward's return, the meter hands over the highest running sum of the step; stopped
    anywhere else it cannot know the step's, and says 0."""
    got = []
    x = torch.randn(4096, requires_grad=True)
    meter = GapMeter("cpu", done=lambda gaps, climb: got.append(climb))
    assert meter.start() and meter.stop_after_backward()
    y = (x * 2).exp()  # two 16 KiB tensors alive, then their gradients
    y.sum().backward()
    assert not meter.running
    assert len(got) == 1 and 2 * 16384 <= got[0] < 16 * 16384, got
    got.clear()
    meter = GapMeter("cpu", done=lambda gaps, climb: got.append(climb))
    assert meter.start()
    keep = torch.empty(100_000)
    meter.stop()
    assert got == [] and keep.numel()


def _train(step, model, batches):
    losses = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(step(x), y)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 8))


def test_a_step_over_the_budget_makes_the_next_plans_leave_its_margin():
    """A step measured above an absolute budget (its kernels peaking 32 KiB above their model, as Inductor's
    can): the next step's plans count that margin, the step they predict stays within the budget with it, a
    later step is measured again, and training is unchanged."""
    torch.manual_seed(1)
    batches = [(torch.randn(512, 64), torch.randint(0, 8, (512,))) for _ in range(6)]
    model = _mlp()
    probe = karma_fx.compile(model, budget=1.0)
    _train(probe, model, batches[:2])
    budget = probe.unplanned_peak_bytes  # in bytes: nothing needs to move

    model = _mlp()
    step = karma_fx.compile(model, budget=budget)
    losses = _train(step, model, batches[:3])
    session = step._session
    signature = session._signature()
    before = step.predicted_peak_bytes
    assert before <= budget and not step.plan.decisions
    climb = budget + 32 * 1024 - session._persistent_bytes()  # the allocator saw this step peak 32 KiB over
    session._climbed(climb)
    margin = session._margins.of(signature)
    assert margin == budget + 32 * 1024 - before
    losses += _train(step, model, batches[3:])
    assert step.predicted_peak_bytes <= budget  # its model's peak and the margin, together
    assert step.plan.decisions  # so it moves tensors now
    assert session._margins.checks.get(signature) == 1  # the step after the re-plan was measured

    reference = _mlp()
    want = _train(reference, reference, batches)
    for got, w in zip(losses, want):
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-7)


def test_a_fraction_is_of_the_unplanned_step_as_measured():
    """``budget=1.0`` where the unplanned step was measured above its model: the budget becomes the measured
    step, and nothing is moved for it."""
    torch.manual_seed(1)
    batches = [(torch.randn(512, 64), torch.randint(0, 8, (512,))) for _ in range(4)]
    model = _mlp()
    step = karma_fx.compile(model, budget=1.0)
    _train(step, model, batches[:2])
    session = step._session
    measured = session.budget_bytes + 64 * 1024
    session._climbed(measured - session._persistent_bytes())
    _train(step, model, batches[2:])
    assert session.budget_bytes == measured
    assert not step.plan.decisions
