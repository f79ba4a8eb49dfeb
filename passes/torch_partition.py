"""Ask PyTorch's own min-cut partitioner what it would save at a given ``activation_memory_budget``.

This is the seam for the ``torch-budget`` baseline: PyTorch decides (knapsack over recompute candidates), we
translate its saved set into storages and let our simulator judge the result like every other plan.
"""
from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from karma_fx.passes.capture import CapturedStep, copy_joint
from karma_fx.problem import Problem


def saved_storages(step: CapturedStep, problem: Problem, memory_budget: float) -> frozenset[str]:
    """Storages PyTorch's partitioner saves for the backward at ``activation_memory_budget=memory_budget``."""
    fw, _, _ = min_cut_at(copy_joint(step), step.joint_inputs, memory_budget, num_fwd_outputs=step.num_fwd_outputs)
    output = next(n for n in fw.graph.nodes if n.op == "output")
    saved_nodes = [a for a in output.args[0][step.num_fwd_outputs:] if isinstance(a, fx.Node)]
    alias = dict(problem.aliases)
    names: set[str] = set()
    for node in saved_nodes:
        base = node
        # A saved view is saved through its storage; names in the forward graph match the joint graph's.
        storage = alias.get(base.name)
        if storage is None and base.target is operator.getitem:
            storage = alias.get(base.args[0].name)
        if storage is not None:
            names.add(storage)
    return frozenset(names)


def min_cut_at(joint: fx.GraphModule, joint_inputs: Any, memory_budget: float, **options: Any
               ) -> tuple[fx.GraphModule, fx.GraphModule, list[float]]:
    """PyTorch's min-cut partition of ``joint`` at exactly ``activation_memory_budget=memory_budget``, and the
    budgets the process or the model had asked for instead (the knob where it differs; the per-graph budgets
    min-cut reads before the knob, ``drop_budget_annotations``, taken off ``joint``). Karma's own partitions
    (``karma_fx.inductor``) run at 1.0, ``torch-budget`` at the fractions it asks for."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    knob = functorch_config.activation_memory_budget
    asked = ([knob] if knob != memory_budget else []) + drop_budget_annotations(joint)
    with functorch_config.patch(activation_memory_budget=float(memory_budget)):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **options)
    return fw, bw, asked


def drop_budget_annotations(joint: fx.GraphModule) -> list[float]:
    """Take off ``joint``'s nodes (nested graphs included) the per-graph budgets min-cut reads before the knob:
    ``torch.autograd.graph.region_activation_memory_budget``'s annotation and the older ``meta["memory_budget"]``.
    Returns the budgets found. Each node gets a meta of its own first: a copied graph may share them."""
    from torch.fx import traceback as fx_traceback

    key = getattr(fx_traceback, "MEMORY_BUDGET_ANNOTATION_KEY", None)
    found: list[float] = []
    for module in joint.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            custom = node.meta.get("custom")
            annotated = key is not None and isinstance(custom, dict) and key in custom
            legacy = isinstance(node.meta.get("memory_budget"), float)
            if annotated or legacy:
                node.meta = dict(node.meta)
            if annotated:
                found.append(custom[key])
                node.meta["custom"] = {k: v for k, v in custom.items() if k != key}
            if legacy:
                found.append(node.meta.pop("memory_budget"))
    return found
