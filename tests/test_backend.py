"""torch.compile(model, backend="karma"): registered by entry point, exact gradients, graph breaks share the budget."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import karma_fx
import torch._dynamo

from karma_fx.backend import regions
from karma_fx.errors import BudgetError, InfeasibleBudgetError, KarmaError, UnsupportedModelError
from karma_fx.zoo import build, output_to_loss

from test_compile import assert_same_training


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_backend_is_found_with_nothing_imported_first():
    """A fresh interpreter that imports only torch finds backend="karma" through the entry point."""
    script = textwrap.dedent("""
        import sys, torch
        assert "karma_fx" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        step = torch.compile(model, backend="karma", options={"budget": 1.0, "strategy": "keep"})
        step(torch.randn(4, 8)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        from karma_fx.backend import regions
        print("karma_fx" in sys.modules, len(torch.ops.karma.offload.default._schema.arguments) > 0)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/",
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"]


# (On a CPU, with each kernel's scratch counted, karma's and offload's plans cannot lower the tiny CNN's or MLP's
# peak: a convolution's backward scratch, the weights and their gradients; the GPT's they can.)
@pytest.mark.parametrize("name, strategy", [("cnn", "checkpoint"), ("gpt2", "karma"), ("gpt2", "checkpoint"),
                                            ("gpt2", "offload"), ("cnn", "cpsat")])
def test_gradients_equal_eager(name, strategy):
    """BatchNorm buffers update once per step and dropout draws the same mask, under recompute and offload."""
    model, args, kwargs = build(name, "tiny")
    # roofline times: on measured ones, measured again per compile, karma's swap-or-recompute choice may differ
    # between the plan door's reach and the region planned here
    probe = {"budget": 1.0, "strategy": "keep", "costs": "roofline"}
    output_to_loss(torch.compile(model, backend="karma", options=probe, dynamic=False)(*args, **kwargs))
    (region,) = regions(probe)
    high, low = region.plan.unplanned_peak_bytes, region.min_budget_bytes
    torch._dynamo.reset()
    model, args, kwargs = build(name, "tiny")
    # halfway between the lowest peak this strategy reaches (a CPU convolution's backward scratch, counted
    # since it is measured, is more than a heuristic can plan around) and the unplanned peak
    reached = karma_fx.prepare(model, args, kwargs, costs="roofline").plan(low, strategy, raise_if_infeasible=False)
    reached = reached.plan.peak_bytes
    reached += high - region.plan.unplanned_peak_bytes  # the region's peak as the whole step sees it
    assert reached < high, f"{strategy} moves nothing on {name}"
    options = {"budget": (reached + high) // 2, "strategy": strategy, "costs": "roofline"}
    compiled = torch.compile(model, backend="karma", options=options, dynamic=False)
    # cpsat may split the CNN's convolutions: BatchNorm's statistics then agree with eager's to rounding
    assert_same_training(model, compiled, args, kwargs, exact_buffers=strategy != "cpsat")
    (region,) = regions(options)
    # (cpsat may fit the CNN by splitting its convolutions along the batch alone: karma_fx.split)
    assert region.plan.strategy == strategy and region.plan.fits and (region.plan.decisions or region.plan.splits)


class TwoHalves(torch.nn.Module):
    """A graph break in the middle: Dynamo compiles two regions."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Sequential(*[torch.nn.Linear(64, 64) if i % 2 == 0 else torch.nn.Tanh()
                                           for i in range(8)])
        self.second = copy.deepcopy(self.first)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h).square().mean()


def test_graph_break_regions_share_the_budget():
    torch.manual_seed(0)
    model, x = TwoHalves(), torch.randn(256, 64)
    budget = 850_000  # the first region fits as is; the second must plan around what the first holds
    options = {"budget": budget, "strategy": "checkpoint"}
    compiled = torch.compile(model, backend="karma", options=options, dynamic=False)
    assert_same_training(model, compiled, (x,), {})
    first, second = regions(options)
    first_weights = sum(p.numel() * 4 for p in model.first.parameters())
    assert first.plan.budget_bytes == second.plan.budget_bytes == budget
    assert not first.plan.decisions and first.held_bytes > 0
    # the second region plans in what the first leaves it: the first's weights and what it holds for its
    # backward (its output, the second's input, counted once)
    assert second.plan.peak_bytes + first_weights + first.held_bytes - first.last.fp.outputs[0][0] <= budget
    assert second.plan.fits and second.plan.decisions, "the second region must plan around the first's tensors"
    from karma_fx.measure_run import AllocatorPeak

    model.zero_grad(set_to_none=True)
    with AllocatorPeak(model.parameters(), x) as meter:
        compiled(x).backward()
    assert meter.peak_bytes <= budget, (meter.peak_bytes, budget)


def test_bad_options_and_dynamic_shapes():
    from torch._dynamo.exc import BackendCompilerFailed

    model, args, _ = build("mlp", "tiny")
    for options, error in [({}, KarmaError), ({"budget": 0.5, "colour": 1}, KarmaError),
                           ({"budget": 100, "strategy": "karma"}, BudgetError)]:
        torch._dynamo.reset()
        with pytest.raises(BackendCompilerFailed) as info:
            torch.compile(model, backend="karma", options=options)(*args)
        assert isinstance(info.value.inner_exception, error), info.value.inner_exception
    torch._dynamo.reset()
    with pytest.raises(InfeasibleBudgetError) as infeasible:  # raised as the region first runs: typed, unwrapped
        torch.compile(model, backend="karma", options={"budget": 2048, "strategy": "karma"})(*args)
    assert infeasible.value.min_budget_bytes > 2048
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(model, backend="karma", options={"budget": 1.0}, dynamic=True)(*args)
    assert isinstance(info.value.inner_exception, UnsupportedModelError)
    assert "dynamic=False" in str(info.value.inner_exception)


@pytest.mark.parametrize("name", ["cnn", "gpt2", "llama"])
def test_unlimited_budget_emits_pytorchs_own_graphs(name):
    """Nothing moves, so the emitted forward and backward are node for node what AOTAutograd's default
    partitioner emits (``aot_eager`` with the default partitioner) for the graph planned: no copy, no
    recompute, no reordering. That graph is PyTorch's own with each training-mode dropout split into its mask
    and multiply (``split_dropout``), so that the step allocates what the plan counts; a model without dropout
    (llama here) gets exactly PyTorch's graphs."""
    from functorch.compile import default_partition, make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from karma_fx.passes.dropout import split_dropout

    reference: list[torch.fx.GraphModule] = []
    split: list[bool] = []

    def record(gm, _):
        reference.append(gm)
        return make_boxed_func(gm.forward)

    def partition(joint, joint_inputs, **kw):
        planned = split_dropout(joint)
        split.append(planned is not joint)
        return default_partition(planned, joint_inputs, **kw)

    model, args, kwargs = build(name, "tiny")
    output_to_loss(torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record,
                                                             partition_fn=partition),
                                 dynamic=False)(*args, **kwargs)).backward()
    assert split == [name != "llama"]
    torch._dynamo.reset()
    options = {"budget": "1TiB"}
    output_to_loss(torch.compile(model, backend="karma", options=options, dynamic=False)(*args, **kwargs)).backward()
    (region,) = regions(options)
    assert region.plan.decisions == ()

    def nodes(gm):
        return [(n.op, str(n.target), n.name) for n in gm.graph.nodes]

    assert [nodes(g) for g in region.graphs] == [nodes(g) for g in reference]


def test_an_inference_region_compiles_once():
    """A region Dynamo hands over under ``torch.no_grad`` (evaluation; FSDP2's own no-grad regions) saves
    nothing and is compiled once: it was compiled again at every call, 0.25 s a call under FSDP2 (a 4-block GPT
    on two ranks ran 2.5x slower than FSDP2 with Inductor alone)."""
    from karma_fx.backend import _sessions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    options = {"budget": 1.0}
    compiled = torch.compile(model, backend="karma", options=options, dynamic=False)
    x = torch.randn(16, 32)
    with torch.no_grad():
        outs = [compiled(x) for _ in range(3)]
        want = model(x)
    session = _sessions[id(options)]
    assert session.compiles == 1 and len(session.regions) == 1
    assert all(torch.allclose(o, want, atol=1e-6) for o in outs)


def test_a_budget_refused_through_the_backend_leaves_a_process_that_exits_cleanly(tmp_path):
    """A user who catches the refusal and goes on: the backend door left the step's profiler session (it measures
    what the step climbs) open, and the process died of a segmentation fault at exit (exit code 139, also on
    each rank of ``examples/train_fsdp.py`` refused under torchrun). The front door already closed it."""
    script = tmp_path / "refused.py"
    script.write_text(textwrap.dedent('''
        import torch, torch.nn as nn, karma_fx
        from karma_fx.errors import InfeasibleBudgetError
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        step = torch.compile(model, backend="karma", options={"budget": 0.3}, dynamic=False)
        try:
            for _ in range(3):
                step(torch.randn(512, 64)).square().mean().backward()
            print("trained")
        except InfeasibleBudgetError:
            print("refused")
    '''))
    env = dict(os.environ, OMP_NUM_THREADS="1", KARMA_PROGRESS="0")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.stdout.strip() == "refused", run.stdout + run.stderr[-2000:]
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
