"""The simulator on a problem small enough to work out by hand (see helpers.chain_problem)."""
from __future__ import annotations

import pytest

from karma_fx.errors import InvalidPlanError
from karma_fx.plan import Offload, Recompute
from karma_fx.simulate import simulate

from helpers import chain_problem, flat_costs


def mem(timeline):
    return [b for _, b in timeline.memory]


def test_keep_profile_and_time():
    p = chain_problem()
    tl = simulate(p, (), flat_costs(p))
    assert mem(tl) == [1110, 2110, 2114, 3118, 3114, 1214]
    assert tl.peak_bytes == 3118 and tl.peak_op == "b2"
    assert tl.makespan_us == 60 and tl.stall_us == 0 and tl.recompute_us == 0
    assert tl.rows == ()


def test_offload_prefetched_too_early_saves_nothing_at_the_peak():
    p = chain_problem()
    plan = [Offload("A", offload_after="f0", free_after="f1", prefetch_at="b2", reload_before="b1")]
    tl = simulate(p, plan, flat_costs(p))
    # The D2H copy runs 10..20, so A is gone when `loss` starts at 20; the prefetch at b2 brings it back.
    assert mem(tl) == [1110, 2110, 1114, 3118, 3114, 1214]
    assert [(i.start_us, i.end_us) for i in tl.d2h] == [(10, 20)]
    assert [(i.start_us, i.end_us) for i in tl.h2d] == [(30, 40)]
    assert tl.makespan_us == 60 and tl.stall_us == 0
    assert tl.host_peak_bytes == 1000


def test_just_in_time_prefetch_lowers_the_peak_and_stalls():
    p = chain_problem()
    plan = [Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1")]
    tl = simulate(p, plan, flat_costs(p))
    assert mem(tl) == [1110, 2110, 1114, 2118, 3114, 1214]
    assert tl.peak_bytes == 3118 - 4 and tl.stall_us == 10 and tl.makespan_us == 70
    row = {r.op: r for r in tl.rows}
    assert row["f0"].offload == ("A",) and row["f1"].free == ("A",)
    assert row["b1"].prefetch == ("A",) and row["b1"].stall_us == 10


def test_in_flight_offload_keeps_the_tensor_alive():
    p = chain_problem()
    plan = [Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1")]
    slow = flat_costs(p, bytes_per_us=10.0)  # 1000 bytes take 100 µs
    tl = simulate(p, plan, slow)
    assert mem(tl)[2] == 2114  # still copying at `loss`: A counted
    assert tl.h2d[0].start_us == 110  # the prefetch cannot start before the offload landed


def test_release_waits_for_the_copy():
    p = chain_problem()
    plan = [Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1",
                    release_before="loss")]
    tl = simulate(p, plan, flat_costs(p, bytes_per_us=10.0))
    assert tl.stall_us >= 90 - 1e-9  # compute waits from 20 until the copy lands at 110
    assert mem(tl)[2] == 1114


def test_recompute():
    p = chain_problem()
    plan = [Recompute(tensors=("A",), ops=("f0",), reload_before="b1")]
    tl = simulate(p, plan, flat_costs(p))
    assert mem(tl) == [1110, 2110, 1114, 2118, 2114, 3114, 1214]
    assert tl.recompute_us == 10 and tl.makespan_us == 70 and tl.peak_bytes == 3114
    assert [i.kind for i in tl.compute].count("recompute") == 1
    row = {r.op: r for r in tl.rows}
    assert row["b1"].recompute == ("A",) and row["f1"].free == ("A",)


@pytest.mark.parametrize("plan, message", [
    ([Offload("A", "f0", "f0", "gw", "gw")], "not on the device"),
    ([Offload("A", "f1", "f0", "b1", "b1")], "offload_after"),
    ([Offload("Z", "f0", "f1", "b1", "b1")], "not a storage"),
    ([Offload("A", "f0", "nope", "b1", "b1")], "no op named"),
    ([Recompute(("A",), ("f0",), "b2"), Offload("A", "f0", "f1", "b1", "b1")], "still on the device"),
    # Rebuilding B needs A, which is on the host from f1 until b1.
    ([Recompute(("B",), ("f1",), "b2"), Offload("A", "f0", "f1", "b1", "b1")], "read by recomputing f1"),
    # Dropping what the step returns or holds, or what the chain does not make, is never a valid saving.
    ([Recompute(("L",), ("f0",), "b2")], "input or output of the step"),
    ([Recompute(("w",), ("loss",), "gw")], "input or output of the step"),
    ([Recompute(("A",), ("f1",), "b1")], "none of those ops makes it"),
    ([Recompute(("A",), (), "b1")], "must name"),
    ([Offload("L", "loss", "loss", "gw", "gw")], "returned by the step"),
    # A second gap must not start before the first one's copy is back and waited for.
    ([Offload("A", "f0", "f1", "b2", "b1"), Offload("A", "f1", "f1", "b1", "b1")], "overlapping"),
])
def test_invalid_plans_are_rejected_with_a_reason(plan, message):
    p = chain_problem()
    with pytest.raises(InvalidPlanError, match=message):
        simulate(p, plan, flat_costs(p))


def test_random_ops_are_never_recomputed():
    from dataclasses import replace

    p = chain_problem()
    ops = list(p.ops)
    ops[0] = replace(ops[0], random=True)
    p = replace(p, ops=tuple(ops), _index={}, _op_index={})
    with pytest.raises(InvalidPlanError, match="random"):
        simulate(p, [Recompute(("A",), ("f0",), "b1")], flat_costs(p))


def test_figures_without_detail_are_the_same_and_the_gc_is_left_as_it_was():
    import gc

    from karma_fx.simulate import paused_gc

    p, costs = chain_problem(), flat_costs(chain_problem())
    plan = (Offload("A", offload_after="f0", free_after="f1", prefetch_at="b2", reload_before="b1"),)
    full, lean = simulate(p, plan, costs), simulate(p, plan, costs, detail=False)
    assert full.rows and full.peak_storages and not lean.rows and not lean.peak_storages
    assert (lean.peak_bytes, lean.makespan_us, lean.memory, lean.stall_us, lean.peak_op) == \
        (full.peak_bytes, full.makespan_us, full.memory, full.stall_us, full.peak_op)
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(p, plan, costs)
        assert not gc.isenabled()  # a caller's choice to run without the collector is kept
    finally:
        gc.enable()


def test_copies_on_the_compute_thread_add_their_time():
    """A CPU copying synchronously (``Costs.copies_block_compute``) waits for each copy as it is issued: the
    offload of A and its reload cost 10 µs each on top of six 10 µs ops, where a copy stream hides both."""
    import dataclasses

    from helpers import chain_problem, flat_costs

    from karma_fx.plan import Offload
    from karma_fx.simulate import simulate

    problem = chain_problem()
    costs = flat_costs(problem, op_us=10.0, bytes_per_us=100.0)
    plan = [Offload("A", offload_after="f0", free_after="f1", prefetch_at="b2", reload_before="b1")]
    overlapped = simulate(problem, plan, costs)
    blocking = simulate(problem, plan, dataclasses.replace(costs, copies_block_compute=True))
    assert overlapped.makespan_us == 60.0 and overlapped.stall_us == 0.0
    assert blocking.makespan_us == 80.0 and blocking.stall_us == 20.0
    assert blocking.peak_bytes <= overlapped.peak_bytes


def test_issuing_a_copy_takes_compute_time():
    """``Costs.copy_issue_us``: each copy costs the issuing thread that much, at the op that issues it, and
    the copy starts only once issued."""
    import dataclasses

    problem = chain_problem()
    costs = dataclasses.replace(flat_costs(problem, op_us=10.0, bytes_per_us=100.0), copy_issue_us=3.0)
    plan = [Offload("A", offload_after="f0", free_after="f1", prefetch_at="b2", reload_before="b1")]
    tl = simulate(problem, plan, costs)
    assert tl.makespan_us == 66.0 and tl.issue_us == 6.0 and tl.stall_us == 0.0
    issues = [(iv.start_us, iv.end_us) for iv in tl.compute if iv.kind == "issue"]
    assert issues == [(10.0, 13.0), (33.0, 36.0)]  # after f0, and before b2 starts
    assert [iv.start_us for iv in tl.d2h + tl.h2d] == [13.0, 36.0]
    assert simulate(problem, [], costs).makespan_us == 60.0
    # what reads the compute stream op by op skips the copy ops' intervals (a window's base memory)
    from karma_fx.strategies.cpsat.window import per_op_memory

    assert per_op_memory(problem, tl) == per_op_memory(problem, simulate(problem, plan, flat_costs(
        problem, op_us=10.0, bytes_per_us=100.0)))
    with pytest.raises(ValueError, match="copy_issue_us"):
        dataclasses.replace(costs, copy_issue_us=-1.0)


def test_a_swap_out_is_waited_for_where_the_replay_has_it_landed():
    """``wait_where_copies_land`` puts each offload's ``release_before`` at the first op the replay starts after
    the copy landed: a late copy then stalls compute instead of holding memory past the plan, and the replay
    itself does not change."""
    from karma_fx.simulate import wait_where_copies_land

    p = chain_problem()
    costs = flat_costs(p)  # A's copy runs 10..20; `loss` starts at 20
    for release in (None, "b2", "b1"):  # none yet, or a later one: both end up at `loss`
        plan = (Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1",
                        release_before=release),)
        pinned = wait_where_copies_land(p, plan, costs)
        assert pinned[0].release_before == "loss"
        before, after = simulate(p, plan, costs), simulate(p, pinned, costs)
        assert (after.peak_bytes, after.makespan_us, after.stall_us, after.memory, after.rows) == \
            (before.peak_bytes, before.makespan_us, before.stall_us, before.memory, before.rows)
    slow = flat_costs(p, bytes_per_us=10.0)  # lands at 110: b1 waits for its prefetch, which waits for that
    plan = (Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1"),)
    pinned = wait_where_copies_land(p, plan, slow)
    assert pinned[0].release_before == "b1"
    assert simulate(p, pinned, slow).memory == simulate(p, plan, slow).memory
    early = (Offload("A", offload_after="f0", free_after="f1", prefetch_at="b1", reload_before="b1",
                     release_before="loss"),)  # a wait the plan wants earlier than the landing stays
    assert wait_where_copies_land(p, early, slow) == early


def test_a_rebuilt_chains_loops_hold_what_they_read_and_write_until_the_chain_ends():
    """On the step Inductor runs (``Problem.loop_ops``), a recompute chain's loop ops are one function of loops,
    ended at the chain's last op by the rewrite: what they read (the rebuilt matmul's output) and write stays
    allocated until then, where op by op each dies at its last read. The backward's loops after the chain start
    a function of their own, so nothing of the chain but the rebuilt tensor is held into them. Worked by hand
    (MiB): x, w, the step's output and, from the backward on, the tangent, 1 each; the rebuilt ``m`` 4, ``a``
    4, ``b`` 4; the backward's ``g`` 2."""
    from dataclasses import replace

    from karma_fx.problem import Op, Problem, Storage

    mb = 1 << 20
    ops = (Op("f_mm", "aten.mm.default", "fwd", ("x", "w"), ("m",)),
           Op("f_a", "aten.tanh.default", "fwd", ("m",), ("a",)),
           Op("f_b", "aten.sigmoid.default", "fwd", ("a",), ("b",)),
           Op("f_out", "aten.mm.default", "fwd", ("b", "w"), ("out",)),
           Op("g_1", "aten.mul.Tensor", "bwd", ("tangent", "b"), ("g",)),
           Op("g_2", "aten.mm.default", "bwd", ("g", "x"), ("gw",)))
    storages = (Storage("x", mb, "input", None, (0, 5)), Storage("w", mb, "param", None, (0, 3)),
                Storage("m", 4 * mb, "activation", 0, (1,)), Storage("a", 4 * mb, "activation", 1, (2,)),
                Storage("b", 4 * mb, "activation", 2, (3, 4)), Storage("out", mb, "activation", 3, (), is_output=True),
                Storage("tangent", mb, "tangent", None, (4,), arrives_at=4),
                Storage("g", 2 * mb, "temp", 4, (5,)), Storage("gw", mb, "gradient", 5, (), is_output=True))
    op_by_op = Problem(ops=ops, storages=storages, num_fwd_ops=4)
    fused = replace(op_by_op, fused_kernels=True, loop_ops=frozenset({"f_a", "f_b", "g_1"}))
    plan = [Recompute(tensors=("b",), ops=("f_mm", "f_a", "f_b"), reload_before="g_1")]
    # items: f_mm f_a f_b f_out | rebuilt: f_mm f_a f_b | g_1 g_2
    assert mem(simulate(op_by_op, plan, flat_costs(op_by_op)))[4:] == [mb * n for n in (8, 12, 12, 10, 6)]
    assert mem(simulate(fused, plan, flat_costs(fused)))[4:] == [mb * n for n in (8, 12, 16, 10, 6)]
    # ``a`` named rebuilt too, though no backward op reads it: the rewrite pins nothing there, nor does the
    # function end there
    also_a = [Recompute(tensors=("a", "b"), ops=("f_mm", "f_a", "f_b"), reload_before="g_1")]
    assert mem(simulate(fused, also_a, flat_costs(fused)))[4:] == [mb * n for n in (8, 12, 16, 10, 6)]


def test_a_rebuilt_tensor_ends_its_chains_function_and_run_holds_are_dropped_from_the_chain():
    """Where a chain rebuilds a tensor the backward reads (``a``), the rewrite pins it, so the function of loops
    ends there: what it read (``m``) is freed then, not at the chain's end. A read that only holds a run's
    outputs to its end (``Problem.held_by_runs``: ``f_b`` reading ``m``) is not a read of the chain's ops, whose
    functions the simulator holds itself; taken as a read, ``m`` lived on beside ``a`` and ``b`` (MiB as in the
    test above)."""
    from dataclasses import replace

    from karma_fx.problem import Op, Problem, Storage

    mb = 1 << 20
    ops = (Op("f_mm", "aten.mm.default", "fwd", ("x", "w"), ("m",)),
           Op("f_a", "aten.tanh.default", "fwd", ("m",), ("a",)),
           Op("f_b", "aten.sigmoid.default", "fwd", ("a", "m"), ("b",)),
           Op("f_out", "aten.mm.default", "fwd", ("b", "w"), ("out",)),
           Op("g_1", "aten.mul.Tensor", "bwd", ("tangent", "a", "b"), ("g",)),
           Op("g_2", "aten.mm.default", "bwd", ("g", "x"), ("gw",)))
    storages = (Storage("x", mb, "input", None, (0, 5)), Storage("w", mb, "param", None, (0, 3)),
                Storage("m", 4 * mb, "activation", 0, (1, 2)), Storage("a", 4 * mb, "activation", 1, (2, 4)),
                Storage("b", 4 * mb, "activation", 2, (3, 4)), Storage("out", mb, "activation", 3, (), is_output=True),
                Storage("tangent", mb, "tangent", None, (4,), arrives_at=4),
                Storage("g", 2 * mb, "temp", 4, (5,)), Storage("gw", mb, "gradient", 5, (), is_output=True))
    loops = replace(Problem(ops=ops, storages=storages, num_fwd_ops=4), fused_kernels=True,
                    loop_ops=frozenset({"f_a", "f_b", "g_1"}))
    held = replace(loops, held_by_runs=frozenset({("f_b", "m")}))
    plan = [Recompute(tensors=("a", "b"), ops=("f_mm", "f_a", "f_b"), reload_before="g_1")]
    # items: f_mm f_a f_b f_out | rebuilt: f_mm f_a f_b | g_1 g_2
    assert mem(simulate(held, plan, flat_costs(held)))[4:] == [mb * n for n in (8, 12, 12, 14, 6)]
    assert mem(simulate(loops, plan, flat_costs(loops)))[4:] == [mb * n for n in (8, 12, 16, 14, 6)]
