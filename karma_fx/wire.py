"""Weights in bf16 on the wire: a streamed parameter that the step only reads through a cast to a narrower
dtype (autocast's copy of an fp32 weight) crosses the host→device link as that cast, made on the host.

Why: under bf16 autocast the device never reads an fp32 weight, only its bf16 copy, so streaming the fp32
master moves twice the bytes the step needs (Megatron-GPT 1.56B: 12.4 GB a step instead of 6.2, more link time
than the whole compute on an H100). The host holds the masters and the optimizer state anyway; it makes the
narrow copy once a step and the copy engine streams that. The values are the cast the device would have made
(the same rounding), so the step computes exactly what eager autocast computes.

In a ``Problem`` the hosted cast's output becomes a parameter (host-resident, streamed window by window like
any weight), its cast op runs on no device stream (no inputs, no outputs, no time), and the master weight
keeps only its other readers (none, for a linear layer's weight: it never goes to the device at all). A plan
says so by streaming the cast's output (``StreamWeight(tensor=<cast output>)``); the simulator and the rewrite
read that, so plans stay plain data and replay as they were made.
"""
from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Iterable

from karma_fx.costs import Costs
from karma_fx.plan import Decision, GradToHost, StreamWeight
from karma_fx.problem import Problem

CASTS = frozenset({"aten._to_copy.default", "prims.convert_element_type.default"})
NARROW = frozenset({"bfloat16", "float16"})


def host_casts(problem: Problem) -> dict[str, tuple[int, str]]:
    """Every cast of a parameter to a narrower float dtype that the host can make instead of the device:
    ``{cast output: (cast op index, parameter)}``. The op must make one storage, smaller than the parameter
    (a narrower copy of all of it), that the step does not return. (Under Inductor's fusion model the op may
    list more inputs, the kernel it is believed fused into; the host makes the cast alone, from the weight.)"""
    found: dict[str, tuple[int, str]] = {}
    for i, op in enumerate(problem.ops):
        if op.target not in CASTS or op.dtype not in NARROW or len(op.outputs) != 1 or i >= problem.num_fwd_ops:
            continue
        params = [s for s in op.inputs if problem.storage(s).kind == "param"]
        if len(params) != 1 or op.inputs[0] != params[0]:  # the weight must be what it casts, not a fused read
            continue
        out, weight = problem.storage(op.outputs[0]), problem.storage(params[0])
        if out.is_output or out.kind != "activation" or not 0 < out.size_bytes < weight.size_bytes:
            continue
        found[out.name] = (i, weight.name)
    return found


def host_upcasts(problem: Problem) -> dict[str, tuple[int, str]]:
    """Every parameter gradient the step makes by widening a narrower gradient that nothing else reads (the
    fp32 ``.grad`` of an autocast weight, cast from the bf16 matmul that computes it): ``{narrow gradient:
    (cast op index, parameter gradient)}``. The host can widen it instead: the narrow one crosses the link
    (half the bytes) and the wide one never exists on the device. Widening is exact, so the gradient is the one
    the step would have returned."""
    found: dict[str, tuple[int, str]] = {}
    for i, op in enumerate(problem.ops):
        if op.target not in CASTS or len(op.inputs) != 1 or len(op.outputs) != 1 or i < problem.num_fwd_ops:
            continue
        narrow, wide = problem.storage(op.inputs[0]), problem.storage(op.outputs[0])
        if not (wide.kind == "gradient" and wide.is_output and narrow.kind in ("temp", "gradient")
                and not narrow.is_output and narrow.users == (i,) and 0 < narrow.size_bytes < wide.size_bytes):
            continue
        found[narrow.name] = (i, wide.name)
    return found


_HOSTED: dict[tuple[int, frozenset[str], frozenset[str]], Problem] = {}


def hosted_problem(problem: Problem, outputs: frozenset[str] | None = None,
                   widened: frozenset[str] = frozenset()) -> Problem:
    """``problem`` with the casts making ``outputs`` (default: every one ``host_casts`` finds) made on the
    host: each output a parameter, its op idle (no inputs, no outputs), each weight without that reader; and
    each gradient in ``widened`` (``host_upcasts``) returned narrow, its widening idle, the wide gradient
    weighing nothing on the device. Cached per problem and sets: a strategy's probes replay one step hundreds
    of times."""
    casts = host_casts(problem)
    names = frozenset(casts) if outputs is None else frozenset(outputs)
    unknown = names - set(casts)
    if unknown:
        from karma_fx.errors import InvalidPlanError

        raise InvalidPlanError(f"{sorted(unknown)[0]} is not a parameter, nor a parameter's narrower cast that "
                               "the host can make: only weights are streamed from the host")
    upcasts = host_upcasts(problem) if widened else {}
    unknown = set(widened) - set(upcasts)
    if unknown:
        from karma_fx.errors import InvalidPlanError

        raise InvalidPlanError(f"{sorted(unknown)[0]} is not a parameter gradient returned by the step, nor one the "
                               "host can widen into it")
    if not names and not widened:
        return problem
    key = (id(problem), names, frozenset(widened))
    found = _HOSTED.get(key)
    if found is not None:
        return found
    idle = {casts[n][0] for n in names} | {upcasts[n][0] for n in widened}
    wide = {upcasts[n][1] for n in widened}
    ops = tuple(replace(op, inputs=(), outputs=(), flops=0, bytes_accessed=0) if i in idle else op
                for i, op in enumerate(problem.ops))
    storages = []
    for s in problem.storages:
        if s.name in names:
            s = replace(s, kind="param", producer=None, arrives_at=0)
        elif s.name in widened:
            s = replace(s, kind="gradient", is_output=True, users=())
        elif s.name in wide:
            s = replace(s, size_bytes=0, producer=None)
        elif any(u in idle for u in s.users):
            s = replace(s, users=tuple(u for u in s.users if u not in idle))
        storages.append(s)
    result = replace(problem, ops=ops, storages=tuple(storages), _index={}, _op_index={})
    _HOSTED[key] = result
    try:
        weakref.finalize(problem, _HOSTED.pop, key, None)
    except TypeError:
        pass
    return result


def as_run(problem: Problem, decisions: Iterable[Decision]) -> Problem:
    """The step as it runs under ``decisions``: the weights' casts they stream made on the host, the
    gradients they send narrow widened there."""
    decisions = tuple(decisions)
    streamed = frozenset(d.tensor for d in decisions if isinstance(d, StreamWeight) and problem.has_storage(d.tensor)
                         and problem.storage(d.tensor).kind != "param")
    widened = frozenset(d.tensor for d in decisions if isinstance(d, GradToHost) and problem.has_storage(d.tensor)
                        and not problem.storage(d.tensor).is_output)
    return hosted_problem(problem, streamed, widened) if streamed or widened else problem


def idle_ops(problem: Problem, hosted: Problem) -> set[int]:
    """The ops ``hosted_problem`` idled: casts the host makes."""
    return {i for i, (a, b) in enumerate(zip(problem.ops, hosted.ops)) if a is not b and not b.outputs}


def as_run_with_costs(problem: Problem, decisions: Iterable[Decision], costs: Costs) -> tuple[Problem, Costs]:
    """``as_run`` with its costs: a cast the host makes takes no time on the device."""
    return with_costs(problem, as_run(problem, decisions), costs)


def hosted(problem: Problem, costs: Costs) -> tuple[Problem, Costs]:
    """Every weight cast made on the host and every gradient widening there (``hosted_problem``), with its
    costs: what a strategy planning around streamed weights plans."""
    return with_costs(problem, hosted_problem(problem, None, frozenset(host_upcasts(problem))), costs)


def with_costs(problem: Problem, new_problem: Problem, costs: Costs) -> tuple[Problem, Costs]:
    if new_problem is problem:
        return problem, costs
    idle = idle_ops(problem, new_problem)
    return new_problem, replace(costs, op_time_us=tuple(0.0 if i in idle else t
                                                        for i, t in enumerate(costs.op_time_us)))
