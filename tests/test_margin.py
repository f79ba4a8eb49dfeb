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


def test_steps_are_measured_until_one_is_steady_then_only_where_a_margin_is_due():
    m = Margins()
    assert all(m.wanted((0,)) for _ in range(MAX_CHECKS))  # no steady step seen yet: keep trying, a few times
    assert not m.wanted((0,))
    m.steady.add((1,))
    assert not m.wanted((1,))  # a steady step of (1,) was measured
    m.learn((1,), measured=1100, planned=800, budget=1000)
    assert [m.wanted((1,)) for _ in range(2)] == [False, True]


def test_a_check_that_met_an_unsteady_step_is_made_on_the_next():
    m = Margins()
    m.learn((0,), measured=1100, planned=800, budget=1000)
    assert [m.due((0,)) for _ in range(2)] == [False, True]  # the check is spent on a step...
    m.unsteady((0,))  # ...that turned out not steady
    assert m.due((0,))


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
    assert session._margins.of(signature) == 0  # one reading above the steps measured before it: not yet
    session._climbed(climb)  # the next step reads the same: the lower of two in a row is over the budget
    margin = session._margins.of(signature)
    assert margin == budget + 32 * 1024 - before
    losses += _train(step, model, batches[3:])
    assert step.predicted_peak_bytes <= budget  # its model's peak and the margin, together
    assert step.plan.decisions  # so it moves tensors now
    assert session._margins.checks.get(signature) == 2  # after the re-plan, two steps in a row were measured

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
    for _ in range(2):  # two steps in a row read it
        session._climbed(measured - session._persistent_bytes())
    _train(step, model, batches[2:])
    assert session.budget_bytes == measured
    assert not step.plan.decisions


def test_one_reading_teaches_nothing_the_lower_of_two_in_a_row_does():
    """A step's climb is learnt from only where the next step with the same plans read as much: the lower of two
    readings in a row counts (a step that allocated once what later steps reuse, as DistributedDataParallel's
    bucket rebuild at its second step, or a transient allocation, is not the steady step)."""
    torch.manual_seed(1)
    batches = [(torch.randn(512, 64), torch.randint(0, 8, (512,))) for _ in range(3)]
    model = _mlp()
    step = karma_fx.compile(model, budget=1.0)
    _train(step, model, batches)
    session = step._session
    budget = session._firm_unplanned  # the unplanned step as measured, two steps in a row
    base = session._persistent_bytes()
    session._climbed(budget + (1 << 20) - base)  # one step 1 MiB over what the steady step before it read
    assert session._firm_unplanned == budget  # the lower of the two: the step before
    session._climbed(budget + (64 << 10) - base)  # the next one 64 KiB over
    assert session._firm_unplanned == budget + (64 << 10)  # the lower of the two, not the 1 MiB
    _train(step, model, batches[:1])
    assert session.budget_bytes == budget + (64 << 10)


def test_a_step_that_grew_the_host_pool_teaches_no_margin():
    """On a CPU the host buffers of offloads share the allocator with the step: the step in which the pool grows
    (the first to run a set of plans together) climbs above any steady step, and is not what plans are for."""
    from karma_fx.runtime import host_pool

    torch.manual_seed(1)
    batches = [(torch.randn(512, 64), torch.randint(0, 8, (512,))) for _ in range(3)]
    model = _mlp()
    probe = karma_fx.compile(model, budget=1.0)
    _train(probe, model, batches[:2])
    step = karma_fx.compile(model, budget=probe.unplanned_peak_bytes)
    _train(step, model, batches)
    session = step._session
    signature = session._signature()
    over = session.budget_bytes + 64 * 1024 - session._persistent_bytes()
    host_pool.misses += 1  # as a buffer allocated during this step would
    session._climbed(over)
    assert session._margins.of(signature) == 0
    session._fresh_at_start = (session._fresh_runs, host_pool.misses)  # steady steps, the same climb
    session._climbed(over)
    session._climbed(over)
    assert session._margins.of(signature) > 0


def test_the_raw_backend_measures_a_steady_step_of_each_sequence():
    """``backend="karma"`` has no step boundary outside its regions: it measures the climb of a whole step from
    its first run on, once a steady step, so a model the kernels' model falls short on is caught there too."""
    from karma_fx.backend import _sessions

    torch._dynamo.reset()
    torch.manual_seed(1)
    batches = [(torch.randn(512, 64), torch.randint(0, 8, (512,))) for _ in range(4)]
    model = _mlp()
    options = {"budget": 1.0}
    step = torch.compile(model, backend="karma", options=options, dynamic=False)
    _train(step, model, batches)
    session = _sessions[id(options)]
    assert session._signature() in session._margins.steady
    assert session._between.gaps == {}  # the code between runs is not learnt from inside a region
