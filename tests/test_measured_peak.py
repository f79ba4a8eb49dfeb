"""Ground truth for every memory claim: the simulator's profile of the unplanned step equals a real run.

Each tiny zoo model's joint graph is executed for real on the CPU while the bytes of live storages are
counted node by node (``passes/measure.py``); the simulator's device bytes for the "keep" plan must equal
that count at every op and at the peak, to the byte.
"""
from __future__ import annotations

import pytest
import torch

from karma_fx.passes.measure import measure_step
from karma_fx.simulate import simulate
from karma_fx.zoo import names

from conftest import prepared, tiny


@pytest.mark.parametrize("name", names())
def test_keep_profile_matches_real_run_to_the_byte(name):
    prep = prepared(name)
    model, args, kwargs = tiny(name)
    measured = measure_step(prep.step, model, args, kwargs)
    timeline = simulate(prep.problem, (), prep.costs)
    assert timeline.peak_bytes == measured.peak_bytes
    simulated = {op.name: bytes_ for op, (_, bytes_) in zip(prep.problem.ops, timeline.memory)}
    mismatched = {n: (simulated[n], measured.live_bytes[n]) for n in simulated if simulated[n] != measured.live_bytes[n]}
    assert not mismatched, f"{len(mismatched)} ops differ, e.g. {list(mismatched.items())[:3]}"


def test_measurement_sees_parameters_gradients_and_activations():
    """The measurement is not trivially equal: it grows with the batch (activations) and counts weights."""
    import karma_fx
    from karma_fx.zoo import build

    small = build("mlp", "tiny", batch=4)
    big = build("mlp", "tiny", batch=64)
    peaks = []
    for model, args, kwargs in (small, big):
        prep = karma_fx.prepare(model, args, kwargs)
        peaks.append(measure_step(prep.step, model, args, kwargs).peak_bytes)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert peaks[-1] > 2 * param_bytes  # weights and their gradients at least
    assert peaks[1] > peaks[0]


@pytest.mark.parametrize("strategy", ["checkpoint", "greedy"])
@pytest.mark.parametrize("name", names())
def test_planned_profile_matches_real_run_of_the_rewritten_graph(name, strategy):
    """The rewritten graph, run for real, peaks exactly where the simulator says the plan peaks.

    Three quarters of the way from the floor to the unplanned peak every model recomputes (checkpoint) or also offloads
    (greedy). Two leaks this catches: a recompute reading the original ``unbind`` of a rebuilt qkv
    projection (the whole projection stayed alive into the backward: +5% on a GPT), and readers taking a
    rebuilt batch norm's copies of running statistics that were still resident."""
    import dataclasses

    from karma_fx.passes.rewrite import rewrite_joint

    prep = prepared(name)
    model, args, kwargs = tiny(name)
    floor, top = prep.min_peak_bytes(), prep.keep.peak_bytes
    planned = prep.plan(budget=floor + (top - floor) * 3 // 4, strategy=strategy)
    if not planned.plan.decisions:
        pytest.skip(f"{strategy} moves nothing for {name} at this budget")
    joint, _ = rewrite_joint(prep.step, prep.problem, planned.plan)
    measured = measure_step(dataclasses.replace(prep.step, joint=joint), model, args, kwargs)
    assert measured.peak_bytes == planned.plan.peak_bytes


def test_recomputed_attention_reads_the_rebuilt_projection_not_the_original():
    """A GPT whose peak is in the layers (not the logits): recomputing an attention block rebuilds the qkv
    projection and its ``unbind``; a recompute that read the original ``unbind`` kept the whole forward
    projection alive into the backward, 5% over the plan, unseen by the simulator."""
    import dataclasses

    import karma_fx
    from karma_fx.passes.rewrite import rewrite_joint
    from karma_fx.zoo import build

    model, args, kwargs = build("megatron_gpt", "tiny", batch=2, seq=128, layers=2, hidden=128, heads=4, vocab=512)
    prep = karma_fx.prepare(model, args, kwargs, device="h100")  # tensors only, as the ground truth counts
    plan = prep.plan(budget=0.8, strategy="checkpoint").plan
    assert any(op.startswith("addmm") for d in plan.decisions for op in getattr(d, "ops", ()))
    joint, _ = rewrite_joint(prep.step, prep.problem, plan)
    measured = measure_step(dataclasses.replace(prep.step, joint=joint), model, args, kwargs)
    assert measured.peak_bytes == plan.peak_bytes


def test_a_recompute_reading_a_swapped_out_tensor_reads_its_reload():
    """A dropout output rebuilt in the backward from a mask the plan swapped out: the rebuild must read the
    reloaded mask, or the forward's mask (and its bytes) stays on the device all along."""
    import dataclasses

    import karma_fx
    from karma_fx.passes.rewrite import rewrite_joint
    from karma_fx.zoo import build

    model, args, kwargs = build("megatron_gpt", "tiny", batch=2, seq=256, layers=2, hidden=256, heads=4, vocab=1024)
    prep = karma_fx.prepare(model, args, kwargs, device="h100")  # tensors only, as the ground truth counts
    plan = prep.plan(budget=0.7, strategy="greedy").plan
    swapped = {d.tensor for d in plan.offloads}
    readers = [d for d in plan.recomputes for op in d.ops if set(prep.problem.ops[prep.problem.op_index(op)].inputs) & swapped]
    assert readers, "the plan should rebuild something from a swapped-out tensor"
    joint, _ = rewrite_joint(prep.step, prep.problem, plan)
    measured = measure_step(dataclasses.replace(prep.step, joint=joint), model, args, kwargs)
    assert measured.peak_bytes == plan.peak_bytes


class _ReadTwice(torch.nn.Module):
    """``a`` is read by the loss's last op, so the backward needs it first, and again by ``l2``, whose output
    ``b`` the backward needs later: a plan rebuilding ``a`` and then ``b`` rebuilds ``b`` from the rebuilt
    ``a``."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(d, d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.l1(x))
        b = torch.sigmoid(self.l2(a))
        return (self.l3(b) * a).sum()


def test_a_recompute_reads_what_an_earlier_recompute_rebuilt():
    """A recompute that reads a tensor an earlier recompute rebuilt (``b`` from the rebuilt ``a``) reads the
    rebuilt copy, as the simulator has it; it read the forward's ``a``, which the plan drops after the forward,
    so that tensor stayed on the device into the backward. The rewritten graph runs at the simulator's peak."""
    import dataclasses

    import karma_fx
    from karma_fx.passes.rewrite import rewrite_joint
    from karma_fx.plan import Recompute
    from karma_fx.simulate import simulate

    torch.manual_seed(0)
    model, x = _ReadTwice(), torch.randn(256, 128)
    prep = karma_fx.prepare(model, (x,), {}, device="h100")
    decisions = (Recompute(tensors=("tanh",), ops=("addmm", "tanh"), reload_before="mul_2"),
                 Recompute(tensors=("sigmoid",), ops=("addmm_1", "sigmoid"), reload_before="mm_1"))
    plan = dataclasses.replace(prep.plan(budget=1.0).plan, decisions=decisions,
                               peak_bytes=simulate(prep.problem, decisions, prep.costs).peak_bytes)
    joint, _ = rewrite_joint(prep.step, prep.problem, plan)
    rebuilt = {n.meta["karma"]["recompute_of"]: n for n in joint.graph.nodes
               if "recompute_of" in n.meta.get("karma", {})}
    assert rebuilt["tanh"] in rebuilt["addmm_1"].args
    measured = measure_step(dataclasses.replace(prep.step, joint=joint), model, (x,), {})
    assert measured.peak_bytes == plan.peak_bytes


def test_a_tensor_rebuilt_twice_serves_each_reader_from_the_rebuild_before_it():
    """A plan that rebuilds ``a`` for the backward's first reader, drops it, and rebuilds it again for the later
    ones (two gaps, as general rematerialization plans them), while ``b`` is rebuilt in between from ``a``:
    each rebuild serves the readers up to the next, ``b`` reads the first copy, and no rebuild is left unread.
    Both rebuilds had served every reader (the second came out unread, or was dropped), so the first copy was
    held across the gap the plan frees. The rewritten graph runs at the simulator's peak."""
    import dataclasses

    import karma_fx
    from karma_fx.passes.rewrite import rewrite_joint
    from karma_fx.plan import Recompute
    from karma_fx.simulate import simulate

    torch.manual_seed(0)
    model, x = _ReadTwice(), torch.randn(256, 128)
    prep = karma_fx.prepare(model, (x,), {}, device="h100")
    decisions = (Recompute(tensors=("tanh",), ops=("addmm", "tanh"), reload_before="mul_2"),
                 Recompute(tensors=("tanh",), ops=("addmm", "tanh"), reload_before="mm_3"),
                 Recompute(tensors=("sigmoid",), ops=("addmm_1", "sigmoid"), reload_before="mm_1"))
    plan = dataclasses.replace(prep.plan(budget=1.0).plan, decisions=decisions,
                               peak_bytes=simulate(prep.problem, decisions, prep.costs).peak_bytes)
    joint, _ = rewrite_joint(prep.step, prep.problem, plan)
    nodes = {n.name: n for n in joint.graph.nodes}
    copies = [n for n in joint.graph.nodes if n.meta.get("karma", {}).get("recompute_of") == "tanh"]
    assert len(copies) == 2 and all(n.users for n in joint.graph.nodes if "recompute_of" in n.meta.get("karma", {}))
    first, second = copies
    sigmoid_from = next(n for n in joint.graph.nodes if n.meta.get("karma", {}).get("recompute_of") == "addmm_1")
    assert first in sigmoid_from.args and first in nodes["mul_2"].args
    def base(node):
        while node.target is torch.ops.aten.detach.default:
            node = node.args[0]
        return node

    assert second in nodes["mm_3"].args and second in map(base, nodes["tanh_backward"].all_input_nodes)
    measured = measure_step(dataclasses.replace(prep.step, joint=joint), model, (x,), {})
    assert measured.peak_bytes == plan.peak_bytes
