"""Every op of the planning problem names the module it ran in (``Op.module``), backward ops their forward
op's, through both ``karma_fx.prepare``/``plan`` (our capture) and ``torch.compile(backend="karma")``
(Dynamo's graph); plan tables show it and capture errors name it."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import karma_fx
from conftest import prepared, tiny
from karma_fx.backend import regions
from karma_fx.errors import UnsupportedModelError
from karma_fx.passes.liveness import user_module_path
from karma_fx.plan import Plan, ScheduleRow
from karma_fx.problem import Op, Problem, describe_op, short_module


def _sequential() -> nn.Module:
    """A plain nested nn.Sequential: ``enc.fc``, ``enc.act``, ``enc.norm`` then ``head``."""
    torch.manual_seed(0)
    enc = nn.Sequential(OrderedDict(fc=nn.Linear(16, 64), act=nn.ReLU(), norm=nn.LayerNorm(64)))
    return nn.Sequential(OrderedDict(enc=enc, mid=nn.Linear(64, 64), act=nn.GELU(), head=nn.Linear(64, 4)))


def _weight_readers(problem: Problem, step, module: str) -> list[Op]:
    """Ops reading ``module.weight`` (directly or through a view, e.g. its transpose)."""
    placeholders = [n.name for n in step.joint.graph.nodes if n.op == "placeholder"]
    storage = dict(zip(step.primal_names, placeholders))[f"{module}.weight"]
    return [op for op in problem.ops if storage in op.inputs]


def test_sequential_ops_carry_their_modules_forward_and_backward():
    p = karma_fx.prepare(_sequential(), (torch.randn(512, 16),))
    problem = p.problem
    assert [(op.phase, op.target, op.module) for op in problem.ops] == [
        ("fwd", "aten.addmm.default", "enc.fc"), ("fwd", "aten.relu.default", "enc.act"),
        ("fwd", "aten.native_layer_norm.default", "enc.norm"), ("fwd", "aten.addmm.default", "mid"),
        ("fwd", "aten.gelu.default", "act"), ("fwd", "aten.addmm.default", "head"),
        # the backward runs the layers in reverse, each op named after the forward op it differentiates
        ("bwd", "aten.mm.default", "head"), ("bwd", "aten.mm.default", "head"),
        ("bwd", "aten.sum.dim_IntList", "head"), ("bwd", "aten.gelu_backward.default", "act"),
        ("bwd", "aten.mm.default", "mid"), ("bwd", "aten.mm.default", "mid"), ("bwd", "aten.sum.dim_IntList", "mid"),
        ("bwd", "aten.native_layer_norm_backward.default", "enc.norm"),
        ("bwd", "aten.threshold_backward.default", "enc.act"), ("bwd", "aten.mm.default", "enc.fc"),
        ("bwd", "aten.sum.dim_IntList", "enc.fc")]
    for module in ("enc.fc", "mid", "head"):  # the first layer's weight is not read by the backward
        readers = _weight_readers(problem, p.step, module)
        assert {op.phase for op in readers} == ({"fwd"} if module == "enc.fc" else {"fwd", "bwd"})
        assert all(op.module == module for op in readers), [describe_op(op) for op in readers]


def test_gpt2_ops_carry_their_modules_forward_and_backward():
    model, _, _ = tiny("gpt2")
    p = prepared("gpt2")
    problem = p.problem
    names = {name for name, _ in model.named_modules() if name}
    linear = [n for n, m in model.named_modules() if hasattr(m, "weight") and m.weight is not None
              and m.weight.dim() == 2 and n.split(".")[-1] in ("c_attn", "c_proj", "c_fc")]
    assert "transformer.h.1.mlp.c_fc" in linear
    for module in linear:
        readers = _weight_readers(problem, p.step, module)
        assert {op.phase for op in readers} == {"fwd", "bwd"}, module
        assert all(op.module == module for op in readers), [describe_op(op) for op in readers]
    # every name is one of the model's own modules, in its own terms (no L['self'], no h[1])
    assert {op.module for op in problem.ops} - {""} <= names
    fwd_modules = {op.module for op in problem.ops[:problem.num_fwd_ops]}
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.act", "transformer.h.1.ln_2", "lm_head"} <= fwd_modules
    # backward ops: all but the loss's own (the model's forward itself) and gradient accumulations know theirs
    unknown = [op for op in problem.ops[problem.num_fwd_ops:] if not op.module]
    assert all(op.target in ("aten.add.Tensor", "aten.nll_loss_backward.default",
                             "aten._log_softmax_backward_data.default") for op in unknown), unknown
    assert len(unknown) < 0.15 * (len(problem.ops) - problem.num_fwd_ops)


def test_plan_table_shows_the_module_beside_the_op():
    planned = prepared("gpt2").plan(0.8, "greedy", raise_if_infeasible=False)
    plan = planned.plan
    assert plan.schedule and all(r.module == planned_op.module
                                 for r in plan.schedule
                                 for planned_op in [prepared("gpt2").problem.ops[prepared("gpt2").problem.op_index(r.op)]])
    text = plan.table(max_rows=None)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["op", "module", "offload"]
    rows_with_module = [r for r in plan.schedule if r.module]
    assert rows_with_module
    for r in rows_with_module:
        assert any(line.startswith(f"{r.op} ") and f" {short_module(r.module)} " in line for line in lines), r
    # the module survives the JSON round trip
    assert Plan.from_json(plan.to_json()).table(max_rows=None) == text


def test_table_has_no_module_column_when_no_op_knows_its_module():
    plan = Plan(strategy="karma", budget_bytes=1, schedule=(ScheduleRow(op="mm", free=("a",)),))
    assert plan.table().splitlines()[0].split()[:2] == ["op", "offload"]
    with_module = plan.replace(schedule=(ScheduleRow(op="mm", free=("a",), module="model.layers.17.self_attn.q_proj"),))
    header, _, row = with_module.table().splitlines()[:3]
    assert header.split()[:2] == ["op", "module"] and "…layers.17.self_attn.q_proj" in row


def test_module_does_not_change_problem_identity():
    from karma_fx.plan_cache import problem_key

    problem = prepared("gpt2").problem
    unlabelled = Problem(ops=tuple(Op(**{**op.__dict__, "module": ""}) for op in problem.ops),
                         storages=problem.storages, num_fwd_ops=problem.num_fwd_ops, cut_points=problem.cut_points,
                         aliases=problem.aliases, name=problem.name)
    assert unlabelled == problem and problem_key(unlabelled, "x") == problem_key(problem, "x")


def test_compiled_region_plans_name_the_same_modules():
    """torch.compile(backend="karma"): Dynamo's nn_module_stack (``L['self'].enc.fc``) reads as the model's own
    names, and the region's problem matches what karma_fx.prepare captured."""
    model = _sequential()
    x = torch.randn(512, 16)  # activations outweigh the weights: 0.7 of the peak fits
    options = {"budget": 0.7}
    torch.compile(model, backend="karma", options=options)(x).sum().backward()
    region = regions(options)[0]
    compiled = region.prepared.problem
    captured = karma_fx.prepare(_sequential(), (x,)).problem
    assert [(op.target, op.module) for op in compiled.ops] == [(op.target, op.module) for op in captured.ops]
    plan = region.plan
    assert plan.schedule and any(r.module for r in plan.schedule)
    assert all(r.module == compiled.ops[compiled.op_index(r.op)].module for r in plan.schedule)
    assert plan.table().splitlines()[0].split()[:2] == ["op", "module"]


def test_compiled_gpt2_modules_match_the_captured_ones():
    model, args, kwargs = tiny("gpt2")
    # 0.98: where karma finds the logits freed before the backward (the output object gone first, which in
    # one run of five under load it was), the step's unplanned peak is 32 KiB lower and 0.95 of it is below
    # the floor: a right refusal, and a test that failed
    options = {"budget": 0.98, "strategy": "greedy"}
    step = torch.compile(model, backend="karma", options=options)
    for _ in range(2):  # from the second step the logits, beside the loss, are returned detached, as captured
        step(*args, **kwargs).loss.backward()
        model.zero_grad(set_to_none=True)
    assert regions(options)[0].detached == (1,)
    compiled = regions(options)[0].prepared.problem
    captured = prepared("gpt2").problem
    assert [(op.name, op.module) for op in compiled.ops] == [(op.name, op.module) for op in captured.ops]


@pytest.mark.parametrize("raw, user", [
    ("L['self'].transformer.h[3].mlp.c_fc", "transformer.h.3.mlp.c_fc"),
    ("getattr(L['self'].h, '0').attn", "h.0.attn"),
    ("L['self']._orig_mod.layers._modules['2'].ff", "layers.2.ff"),
    ("L['model'].blocks['enc'].fc", "blocks.enc.fc"),
    ("L__self___fc1", "fc1"),
    ("L['self']", ""),
    ("transformer.h.3.mlp", "transformer.h.3.mlp"),
])
def test_user_module_path(raw, user):
    assert user_module_path(raw) == user


def test_describe_op_and_short_module():
    op = Op("mm_12", "aten.mm.default", "bwd", (), (), module="transformer.h.3.mlp.c_fc")
    assert describe_op(op) == "mm_12 (aten.mm in transformer.h.3.mlp.c_fc)"
    assert describe_op(Op("add", "aten.add.Tensor", "fwd", (), ())) == "add (aten.add.Tensor)"
    assert short_module("transformer.h.11.mlp.c_proj") == "transformer.h.11.mlp.c_proj"
    assert short_module("encoder.block.11.layer.1.DenseReluDense.wi") == "…layer.1.DenseReluDense.wi"


class _Gate(nn.Module):
    def forward(self, x):
        return x[x > 0].sum() * x  # data-dependent shape: cannot be traced on fake tensors


def test_capture_errors_name_the_module_that_failed():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), gate=_Gate()))
    with pytest.raises(UnsupportedModelError, match=r"while tracing the forward in gate: "):
        karma_fx.prepare(model, (torch.randn(2, 4),))
    # nothing is left behind: the module hooks are gone and the next capture works
    karma_fx.prepare(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
