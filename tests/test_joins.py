"""Recompute chains joined by the backward loops that read what they read (``karma_fx.joins``): which ops join,
what the simulator counts for them, when a plan takes them, and how a plan carries them."""
from __future__ import annotations

from dataclasses import replace

import pytest

from karma_fx.errors import InvalidPlanError
from karma_fx.joins import joined_ops, with_joins
from karma_fx.plan import Plan, Recompute
from karma_fx.problem import Op, Problem, Storage
from karma_fx.simulate import peak_and_makespan, simulate

from helpers import flat_costs

MB = 1 << 20


def gelu_block() -> Problem:
    """A matmul and a pointwise activation ``a`` of its output ``m``; in the backward the activation's input
    gradient ``da`` (a matmul), the weight's gradient reading ``a`` (a matmul: the first reader of ``a``), the
    activation's backward ``g_d`` reading ``m`` and ``da`` (loops), a loop ``g_s`` reading the weight's gradient,
    and a last matmul. The step Inductor runs: ``f_g``, ``g_d`` and ``g_s`` are loop ops. Sizes in MiB: x, w,
    out, tangent, gw, gs, gx 1; m, a, da, dm 4."""
    ops = (Op("f_mm", "aten.mm.default", "fwd", ("x", "w"), ("m",)),
           Op("f_g", "aten.tanh.default", "fwd", ("m",), ("a",)),
           Op("f_out", "aten.mm.default", "fwd", ("a", "w"), ("out",)),
           Op("g_mm", "aten.mm.default", "bwd", ("tangent", "w"), ("da",)),
           Op("g_w", "aten.mm.default", "bwd", ("a", "tangent"), ("gw",)),
           Op("g_d", "aten.mul.Tensor", "bwd", ("da", "m"), ("dm",)),
           Op("g_s", "aten.mul.Tensor", "bwd", ("gw",), ("gs",)),
           Op("g_x", "aten.mm.default", "bwd", ("dm", "w"), ("gx",)))
    storages = (Storage("x", MB, "input", None, (0,)), Storage("w", MB, "param", None, (0, 2, 3, 7)),
                Storage("m", 4 * MB, "activation", 0, (1, 5)), Storage("a", 4 * MB, "activation", 1, (2, 4)),
                Storage("out", MB, "activation", 2, (), is_output=True),
                Storage("tangent", MB, "tangent", None, (3, 4), arrives_at=3),
                Storage("da", 4 * MB, "temp", 3, (5,)), Storage("gw", MB, "gradient", 4, (6,), is_output=True),
                Storage("dm", 4 * MB, "temp", 5, (7,)), Storage("gs", MB, "gradient", 6, (), is_output=True),
                Storage("gx", MB, "gradient", 7, (), is_output=True))
    return replace(Problem(ops=ops, storages=storages, num_fwd_ops=3), fused_kernels=True,
                   loop_ops=frozenset({"f_g", "g_d", "g_s"}))


REBUILD = Recompute(tensors=("a",), ops=("f_g",), reload_before="g_w")


def test_the_loops_reading_what_the_chain_reads_join_it_and_nothing_made_past_the_anchor():
    """``g_d`` reads ``m`` (what the chain reads) and ``da`` (made before the anchor): it joins. ``g_s`` reads the
    anchor's own output: it stays. Op by op (no ``loop_ops``), an anchor that is itself a loop op, an op a copy
    is anchored to, or a chain ending in an extern kernel: nothing joins."""
    p = gelu_block()
    assert joined_ops(p, REBUILD) == ("g_d",)
    assert joined_ops(replace(p, loop_ops=frozenset()), REBUILD) == ()
    looped = replace(p, loop_ops=p.loop_ops | {"g_w"},  # a loop op first reads what the chain rebuilds
                     ops=tuple(replace(op, target="aten.mul.Tensor") if op.name == "g_w" else op for op in p.ops))
    assert joined_ops(looped, REBUILD) == ()
    assert joined_ops(replace(p, loop_ops=p.loop_ops | {"g_w"}), REBUILD) == ("g_d",)  # a matmul run as addmm
    from karma_fx.plan import Offload

    anchored = Offload(tensor="m", offload_after="f_g", free_after="f_out", prefetch_at="g_mm", reload_before="g_d")
    assert joined_ops(p, REBUILD, (REBUILD, anchored)) == ()  # g_d is named by the copy (and reads what it moves)
    assert joined_ops(p, Recompute(tensors=("m", "a"), ops=("f_mm", "f_g"), reload_before="g_w")) == ("g_d",)
    assert joined_ops(p, Recompute(tensors=("m",), ops=("f_mm",), reload_before="g_d")) == ()
    # a value Inductor computes inside its readers (0 bytes, loops read it) read past the run would be stored
    # there: not joined. Here ``dm`` is read by ``g_s`` only, which cannot join (it reads ``gw``)
    reads = {"g_s": ("gw", "dm"), "g_x": ("da", "w")}
    users = {"dm": (6,), "da": (5, 7)}
    inlined = replace(p, ops=tuple(replace(op, inputs=reads.get(op.name, op.inputs)) for op in p.ops),
                      storages=tuple(replace(s, size_bytes=0 if s.name == "dm" else s.size_bytes,
                                             users=users.get(s.name, s.users)) for s in p.storages),
                      _index={}, _op_index={})
    assert joined_ops(inlined, REBUILD) == ()
    stored = replace(inlined, storages=tuple(replace(s, size_bytes=4 * MB) if s.name == "dm" else s
                                             for s in inlined.storages), _index={}, _op_index={})
    assert joined_ops(stored, REBUILD) == ("g_d",)


def test_a_joined_run_is_one_function_from_the_chain_to_its_last_joined_op():
    """Items: f_mm f_g f_out g_mm | rebuilt f_g | g_w g_d g_s g_x. Joined, ``dm`` is allocated where the chain's
    function starts (+4 MiB at the rebuild and at ``g_w``) and the rebuilt ``a`` lives until ``g_d`` (+4 MiB
    there): the run is one function, as the rewrite makes it. Worked by hand (MiB), apart: x w m (6), + a (10),
    + out (11); ``a`` dropped, + tangent, da (12); rebuilt a (16); + gw (17); a, tangent gone, + dm (16); m, da
    gone, + gs (9); + gx (10)."""
    p = gelu_block()
    costs = flat_costs(p)
    apart = [b // MB for _, b in simulate(p, [REBUILD], costs).memory]
    joined = [b // MB for _, b in simulate(p, [replace(REBUILD, joins=("g_d",))], costs).memory]
    assert apart == [6, 10, 11, 12, 16, 17, 16, 9, 10]
    assert joined == [6, 10, 11, 12, 20, 21, 20, 9, 10]


def test_a_plan_takes_the_joins_that_fit_and_keeps_its_peak_within_a_percent():
    """``with_joins`` joins a chain where the plan's peak stays within the budget and rises by at most 1%:
    here the join adds 4 MiB to a 17 MiB peak, so it is taken only where that rise is within 1% (the same
    step with a 500 MiB input alive throughout) and the budget holds."""
    p = gelu_block()
    costs = flat_costs(p)

    def peak(ds):
        return peak_and_makespan(p, ds, costs)[0]

    assert with_joins(p, (REBUILD,), 64 * MB, peak) == (REBUILD,)  # +25%: over the allowance
    big = replace(p, storages=tuple(replace(s, size_bytes=500 * MB) if s.name == "x" else s for s in p.storages))
    costs_big = flat_costs(big)

    def peak_big(ds):
        return peak_and_makespan(big, ds, costs_big)[0]

    assert with_joins(big, (REBUILD,), 600 * MB, peak_big) == (replace(REBUILD, joins=("g_d",)),)
    assert with_joins(big, (REBUILD,), peak_big((REBUILD,)), peak_big) == (REBUILD,)  # the budget is its peak
    assert with_joins(replace(big, loop_ops=frozenset()), (REBUILD,), 600 * MB, peak_big) == (REBUILD,)


def test_a_plan_carries_its_joins_and_a_stray_join_is_refused():
    """Joins survive the plan's JSON; a plan without them reads as it did before they existed; a join that may
    not run with its chain (it reads the anchor's output, or a joinable op's output without that op joined) is
    refused by the simulator, with the reason."""
    joined = Plan(strategy="cpsat", budget_bytes=MB, decisions=(replace(REBUILD, joins=("g_d",)),))
    assert Plan.from_json(joined.to_json()) == joined
    assert "joins" not in Plan(strategy="cpsat", budget_bytes=MB, decisions=(REBUILD,)).to_json()
    p = gelu_block()
    with pytest.raises(InvalidPlanError, match="g_s cannot run with the recompute before g_w"):
        simulate(p, [replace(REBUILD, joins=("g_s",))], flat_costs(p))
    # an op reading a joined op's output joins only with it: alone it would pull that op up uncounted
    ops = p.ops[:6] + (Op("g_e", "aten.mul.Tensor", "bwd", ("dm",), ("de",)),) + p.ops[6:]
    storages = tuple(replace(s, users=tuple(u + (u >= 6) for u in s.users) + ((6,) if s.name == "dm" else ()),
                             producer=s.producer + (s.producer >= 6) if s.producer is not None else None)
                     for s in p.storages) + (Storage("de", MB, "gradient", 6, (), is_output=True),)
    chained = replace(p, ops=ops, storages=storages, loop_ops=p.loop_ops | {"g_e"}, _index={}, _op_index={})
    assert joined_ops(chained, REBUILD) == ("g_d", "g_e")
    simulate(chained, [replace(REBUILD, joins=("g_d", "g_e"))], flat_costs(chained))
    with pytest.raises(InvalidPlanError, match="g_e cannot run with the recompute before g_w"):
        simulate(chained, [replace(REBUILD, joins=("g_e",))], flat_costs(chained))


def test_a_joined_rebuild_is_priced_at_the_traffic_its_loops_do_not_share():
    """The rebuilt ``f_g`` reads ``m`` (4 MiB), which its joined loop ``g_d`` reads too, and writes ``a`` (4 MiB):
    joined, it costs half its time. The strategies price the chain so (``greedy.rebuild_chain``); the
    simulator charges the half to a joined chain only. Op by op (no loop ops) nothing is discounted."""
    from karma_fx.rebuild_price import rebuild_shares, with_rebuild_shares
    from karma_fx.strategies.base import RecomputeBuilder, saved_gaps
    from karma_fx.strategies.greedy import rebuild_chain

    p = gelu_block()
    assert rebuild_shares(p) == {"f_g": 0.5}
    assert rebuild_shares(replace(p, loop_ops=frozenset())) == {}
    costs = with_rebuild_shares(p, flat_costs(p))
    assert costs.rebuild_us(p, p.op_index("f_g")) == 5.0 and costs.rebuild_us(p, p.op_index("g_d")) == 10.0
    gap = next(g for g in saved_gaps(p) if g.storage.name == "a")
    assert rebuild_chain(p, costs, gap, RecomputeBuilder(p))[0] == 5.0
    assert rebuild_chain(p, flat_costs(p), gap, RecomputeBuilder(p))[0] == 10.0
    joined = replace(REBUILD, joins=("g_d",))
    step = 10.0 * len(p.ops)
    assert simulate(p, [REBUILD], costs).makespan_us == step + 10.0  # not joined: the whole op again
    assert simulate(p, [joined], costs).makespan_us == step + 5.0
    assert simulate(p, [joined], flat_costs(p)).makespan_us == step + 10.0
    # a chain whose loops read nothing its joined loops read is not discounted: g_d reads x, which only the
    # chain's matmul reads (an extern kernel, run alone at its whole time)
    apart = replace(p, ops=tuple(replace(op, inputs=("da", "x")) if op.name == "g_d" else op for op in p.ops),
                    storages=tuple(replace(s, users=(1,) if s.name == "m" else (0, 5) if s.name == "x" else s.users)
                                   for s in p.storages), _index={}, _op_index={})
    assert joined_ops(apart, REBUILD) == ()
    assert rebuild_shares(apart) == {}
    with pytest.raises(ValueError, match="rebuild shares"):
        replace(costs, rebuild_shares=(("f_g", 1.5),))


def test_the_planner_compares_plans_as_they_are_joined_when_run():
    """``judged_figures`` times a plan with the joins ``with_joins`` gives it (the step with a 500 MiB input alive,
    so the join's 4 MiB is within the 1% allowance): the rebuild at its share; where the join does not fit the
    budget, or op by op, the plain figures."""
    from karma_fx.rebuild_price import with_rebuild_shares
    from karma_fx.strategies.base import figures_of, judged_figures

    p = gelu_block()
    big = replace(p, storages=tuple(replace(s, size_bytes=500 * MB) if s.name == "x" else s for s in p.storages),
                  _index={}, _op_index={})
    costs = with_rebuild_shares(big, flat_costs(big))
    plain = figures_of(big, costs, (REBUILD,))
    assert plain.makespan_us == 10.0 * len(big.ops) + 10.0
    assert judged_figures(big, costs, (REBUILD,), 600 * MB).makespan_us == plain.makespan_us - 5.0
    assert judged_figures(big, costs, (REBUILD,), plain.peak_bytes) == plain  # the join would break the budget
    eager = replace(big, loop_ops=frozenset())
    assert judged_figures(eager, costs, (REBUILD,), 600 * MB) == figures_of(eager, costs, (REBUILD,))


def test_a_joined_chain_is_charged_for_the_joins_it_has():
    """With ``g_s`` reading the rebuilt ``a`` (so it may join too), the chain priced for its widest joins costs
    half (``rebuild_us``); joined by ``g_s`` alone, which reads nothing the chain reads, it is charged its whole
    time, and joined by both, half."""
    from karma_fx.rebuild_price import with_rebuild_shares

    p = gelu_block()
    reads = {"g_s": ("a",)}
    users = {"a": (2, 4, 6), "gw": ()}
    p = replace(p, ops=tuple(replace(op, inputs=reads.get(op.name, op.inputs)) for op in p.ops),
                storages=tuple(replace(s, users=users.get(s.name, s.users)) for s in p.storages),
                _index={}, _op_index={})
    assert joined_ops(p, REBUILD) == ("g_d", "g_s")
    costs = with_rebuild_shares(p, flat_costs(p))
    assert costs.rebuild_us(p, p.op_index("f_g")) == 5.0
    step = 10.0 * len(p.ops)
    assert simulate(p, [replace(REBUILD, joins=("g_s",))], costs).makespan_us == step + 10.0
    assert simulate(p, [replace(REBUILD, joins=("g_d", "g_s"))], costs).makespan_us == step + 5.0
