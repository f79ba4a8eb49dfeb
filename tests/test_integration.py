"""Integration as users run it: a HuggingFace Trainer on a compiled model, a budget from the environment where a
framework passes no options, and a plan cache that spares a restarted job the planning."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import torch

import karma_fx
from karma_fx.zoo import build


def test_hf_trainer_with_bf16_accumulation_and_clipping(tmp_path):
    """The karma backend under Trainer (bf16 autocast, 2 accumulation steps, clipping) trains as Trainer does
    with torch.compile's own graphs run op by op (``aot_eager``: the same decomposed bf16 kernels; eager
    PyTorch rounds bf16 differently): the same losses and weights after two optimizer steps."""
    from transformers import Trainer, TrainingArguments

    from karma_fx.backend import regions

    model, _, kwargs = build("gpt2", "tiny")
    reference = copy.deepcopy(model)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {k: v[i % v.shape[0]] for k, v in kwargs.items()}

    def train(m, out):
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_grad_norm=1.0, max_steps=2, bf16=True, use_cpu=True, report_to=[],
                                 optim="sgd", learning_rate=0.05,
                                 save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0)
        return Trainer(model=m, args=args, train_dataset=Data()).train().training_loss

    options = {"budget": 0.98}  # the default strategy: a fraction of the step as Trainer runs it, held gradients too
    model.compile(backend="karma", options=options, dynamic=False)
    loss = train(model, tmp_path / "a")
    planned = [r for r in regions(options) if r.last is not None]
    assert planned and all(r.plan.fits for r in planned)
    torch._dynamo.reset()
    reference.compile(backend="aot_eager", dynamic=False)
    want = train(reference, tmp_path / "b")
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


def test_budget_from_the_environment_when_no_options_are_passed():
    script = textwrap.dedent("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        step = torch.compile(model, backend="karma", dynamic=False)  # as a framework calls it
        step(torch.randn(512, 8)).sum().backward()
        from karma_fx.backend import regions
        (region,) = regions(None)
        print(region.plan.budget_bytes == region.plan.unplanned_peak_bytes or region.plan.budget_bytes)
    """)
    env = dict(os.environ, KARMA_BUDGET="1.0", KARMA_PROGRESS="0")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True", out.stdout
    env.pop("KARMA_BUDGET")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0 and "KARMA_BUDGET" in out.stderr


def test_a_restarted_job_reuses_its_plans(tmp_path, monkeypatch):
    from karma_fx.api import Prepared

    calls = []
    original = Prepared.plan

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Prepared, "plan", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 1))
    x = torch.randn(2048, 64)
    plans = []
    for _ in range(2):  # the second "job" finds the first one's plan on disk
        torch._dynamo.reset()
        step = karma_fx.compile(copy.deepcopy(model), budget=0.9, plan_cache=tmp_path)
        step(x).sum().backward()
        plans.append(step.plan)
    assert len(calls) == 1 and list(tmp_path.glob("*.json"))
    assert plans[0].decisions == plans[1].decisions and plans[1].decisions and plans[1].fits
