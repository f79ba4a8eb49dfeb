"""costs="measured": the step's ops timed for real on the device at hand, and the copy ops' speed measured."""
from __future__ import annotations

import copy

import pytest
import torch

import karma_fx
from karma_fx.errors import KarmaError
from karma_fx.zoo import build, output_to_loss


def test_measured_costs_time_every_op_and_change_no_training_result():
    model, args, kwargs = build("gpt2", "tiny")
    prepared = karma_fx.prepare(model, args, kwargs, costs="measured")
    assert prepared.costs.device.startswith("measured on cpu")
    assert all(t > 0 for t in prepared.costs.op_time_us)
    assert prepared.costs.d2h_bytes_per_us > 0 and prepared.costs.copy_latency_us > 0
    roofline = karma_fx.prepare(model, args, kwargs)
    assert prepared.costs.op_time_us != roofline.costs.op_time_us
    # the compile path times the region on its first run's tensors, the RNG put back: dropout masks as eager
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, strategy="keep", costs="measured")
    torch.manual_seed(0)
    loss = output_to_loss(step(*args, **kwargs))
    torch.manual_seed(0)
    want = output_to_loss(reference(*args, **kwargs))
    assert torch.equal(loss, want) and step.plan.device.startswith("measured on cpu")


def test_measured_costs_need_real_weights():
    model, args, kwargs = build("mlp", "tiny", device="meta")
    with pytest.raises(KarmaError, match="meta"):
        karma_fx.prepare(model, args, kwargs, costs="measured")
    with pytest.raises(KarmaError, match="costs"):
        karma_fx.compile(torch.nn.Linear(2, 2), budget=1.0, costs="guessed")
