"""karma_fx.report: the plan table, the Chrome trace, the matplotlib timeline and the compare grid.

Real plans come from the tiny CNN (captured once per session by conftest); hand-made plans cover the corner
cases (nothing simulated, many rows) without a capture.
"""
from __future__ import annotations

import json

import pytest

from conftest import prepared
from karma_fx.budget import format_bytes
from karma_fx.plan import Offload, Plan, Recompute, ScheduleRow
from karma_fx.report import chrome_trace, compare_table, plan_table, plot_timeline, write_chrome_trace
from karma_fx.simulate import Interval, Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def planned():
    """karma on the tiny CNN at 0.8: it fits with an offload, a recompute group and a stall."""
    return prepared("cnn").plan(0.8, "karma")


@pytest.fixture(scope="module")
def offloaded():
    """offload-all on the tiny CNN: many offloaded tensors (it does not fit; the table must say so)."""
    return prepared("cnn").plan(0.8, "offload", raise_if_infeasible=False)


def test_table_has_strategy_peak_and_every_offloaded_tensor(planned, offloaded):
    for p in (planned, offloaded):
        plan = p.plan
        assert plan.offloads, "the fixture is meant to offload something"
        text = plan_table(plan, max_rows=None)
        assert plan.strategy in text and plan.status in text
        assert format_bytes(plan.peak_bytes) in text and format_bytes(plan.budget_bytes) in text
        assert format_bytes(plan.unplanned_peak_bytes) in text
        assert f"{plan.slowdown:.3f}x" in text
        for d in plan.offloads:
            assert d.tensor in text
        assert text == plan.table(max_rows=None)  # Plan.table delegates here
    assert "(fits)" in plan_table(planned.plan)
    assert "OVER by" in plan_table(offloaded.plan)


def test_table_summary_counts_and_stalls(planned):
    plan = planned.plan
    text = plan_table(plan)
    assert f"{len(plan.offloads)} offload" in text
    assert f"{len(plan.recomputes)} recompute group" in text
    assert format_bytes(plan.host_peak_bytes) in text
    for note in plan.notes:
        assert note in text
    stalled = [r for r in plan.schedule if r.stall_us]
    assert stalled and f"{stalled[0].stall_us:,.1f}" in text


def test_table_names_the_module_of_each_op(offloaded):
    """The column beside the op says which layer of the model it is (``features.6``), forward and backward."""
    from conftest import tiny

    plan = offloaded.plan
    model, _, _ = tiny("cnn")
    names = {name for name, _ in model.named_modules() if name}
    lines = plan.table(max_rows=None).splitlines()
    assert lines[0].split()[:3] == ["op", "module", "offload"]
    assert all(r.module in names for r in plan.schedule if r.module)
    assert {offloaded.plan.schedule[0].module, offloaded.plan.schedule[-1].module} <= names
    for r, line in zip(plan.schedule, lines[2:]):
        assert line.split()[:2] == [r.op, r.module]


def test_plan_loaded_from_json_prints_the_same_table(planned, tmp_path):
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    assert plan_table(Plan.load(path)) == plan_table(planned.plan)


def _long_plan(n: int) -> Plan:
    rows = tuple(ScheduleRow(op=f"op_{i}", free=(f"t_{i}",), device_bytes=1000 * i) for i in range(n))
    return Plan(strategy="karma", budget_bytes=10**6, schedule=rows)


def test_max_rows_keeps_head_and_tail():
    text = plan_table(_long_plan(100), max_rows=10)
    assert "… 90 more rows …" in text
    for i in (0, 4, 95, 99):
        assert f"op_{i} " in text
    for i in (5, 50, 94):
        assert f"op_{i} " not in text
    full = plan_table(_long_plan(100), max_rows=None)
    assert "more rows" not in full and all(f"op_{i} " in full for i in range(100))
    assert "more rows" not in plan_table(_long_plan(10), max_rows=10)
    assert "… 5 more rows …" in plan_table(_long_plan(5), max_rows=0)


def test_unsimulated_plan_prints_dashes():
    plan = Plan(strategy="checkpoint", budget_bytes=2**30,
                decisions=(Offload("A", "f0", "f1", "b2", "b1"), Recompute(("B", "C"), ("f1", "f2"), "b2")))
    text = plan_table(plan)
    assert "checkpoint" in text and "1.00 GiB" in text
    assert "step time    -" in text and "host memory  -" in text
    assert "1 offload," in text and "1 recompute group" in text


def test_long_name_lists_are_elided_but_offloads_never():
    names = tuple(f"getitem_{i}" for i in range(20))
    plan = Plan(strategy="karma", budget_bytes=1,
                schedule=(ScheduleRow(op="mm", recompute=names), ScheduleRow(op="add", offload=names[:8])))
    text = plan_table(plan)
    recompute_row = next(line for line in text.splitlines() if line.startswith("mm "))
    assert "getitem_0" in recompute_row and "more" in recompute_row and "getitem_19" not in recompute_row
    offload_row = next(line for line in text.splitlines() if line.startswith("add "))
    assert all(n in offload_row for n in names[:8])
    assert "getitem_19" in plan_table(plan, max_names=None)


def test_chrome_trace(planned, tmp_path):
    tl = planned.timeline
    trace = chrome_trace(tl, name="cnn")
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {0: "compute", 1: "D2H (offload)", 2: "H2D (prefetch)"}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(tl.compute) + len(tl.d2h) + len(tl.h2d)
    assert sum(e["tid"] == 1 for e in complete) == len(tl.d2h) > 0
    assert sum(e["tid"] == 2 for e in complete) == len(tl.h2d) > 0
    cats = {e["cat"] for e in complete}
    assert {"compute", "d2h", "h2d", "stall", "recompute"} <= cats
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == len(tl.memory)
    assert max(e["args"]["bytes"] for e in counters) == tl.peak_bytes
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert json.loads(json.dumps(trace)) == trace

    path = tmp_path / "trace.json"
    write_chrome_trace(tl, path)
    assert len(json.loads(path.read_text())["traceEvents"]) == len(events)


def test_plot_writes_png_and_svg(planned, tmp_path):
    png = tmp_path / "timeline.png"
    plot_timeline(planned.timeline, png, budget_bytes=planned.plan.budget_bytes, title="cnn")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    svg = tmp_path / "timeline.svg"
    plot_timeline(planned.timeline, str(svg))
    assert b"<svg" in svg.read_bytes()[:2000]


def test_plot_handles_an_empty_timeline(tmp_path):
    empty = Timeline(compute=(), d2h=(), h2d=(), memory=(), peak_bytes=0, makespan_us=0.0, compute_us=0.0,
                     recompute_us=0.0, stall_us=0.0, host_peak_bytes=0)
    plot_timeline(empty, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC
    assert [e for e in chrome_trace(empty)["traceEvents"] if e["ph"] in "XC"] == []


def test_plot_many_intervals_stays_fast(tmp_path):
    import time

    n = 20_000
    compute = tuple(Interval(f"op{i}", 10.0 * i, 10.0 * i + 9, ("op", "recompute", "stall")[i % 3]) for i in range(n))
    copies = tuple(Interval(f"t{i}", 40.0 * i, 40.0 * i + 30, "offload") for i in range(n // 4))
    memory = tuple((10.0 * i, (1 + i % 17) << 28) for i in range(n))
    tl = Timeline(compute=compute, d2h=copies, h2d=copies, memory=memory, peak_bytes=17 << 28,
                  makespan_us=10.0 * n, compute_us=0.0, recompute_us=0.0, stall_us=0.0, host_peak_bytes=0)
    t0 = time.perf_counter()
    plot_timeline(tl, tmp_path / "big.png", budget_bytes=4 << 30)
    assert time.perf_counter() - t0 < 15  # ~2 s here; a per-interval artist would take minutes
    assert (tmp_path / "big.png").stat().st_size > 0


def test_compare_table_grid():
    rows = [
        {"strategy": "karma", "budget": "0.5", "budget_bytes": 10 * 2**30, "fits": True, "slowdown": 1.0834,
         "peak_bytes": int(9.5 * 2**30)},
        {"strategy": "checkpoint", "budget": "0.5", "budget_bytes": 10 * 2**30, "fits": True, "slowdown": 1.2,
         "peak_bytes": 9 * 2**30},
        {"strategy": "keep", "budget": "0.5", "budget_bytes": 10 * 2**30, "fits": False, "slowdown": 1.0,
         "peak_bytes": 20 * 2**30},
        {"strategy": "karma", "budget": "0.25", "fits": False, "slowdown": None, "peak_bytes": 6 * 2**30,
         "needs_bytes": int(5.5 * 2**30)},
        {"strategy": "checkpoint", "budget": "0.25", "fits": False, "slowdown": None, "peak_bytes": None,
         "error": "boom"},
    ]
    text = compare_table(rows)
    lines = text.splitlines()
    assert "0.5 (10.00 GiB)" in lines[0] and "0.25" in lines[0]
    karma = next(line for line in lines if line.startswith("karma"))
    assert "1.083x / 9.50 GiB *" in karma and "infeasible (needs 5.50 GiB)" in karma
    checkpoint = next(line for line in lines if line.startswith("checkpoint"))
    assert "1.200x / 9.00 GiB" in checkpoint and "*" not in checkpoint and "error: boom" in checkpoint
    keep = next(line for line in lines if line.startswith("keep"))
    assert "infeasible (needs 20.00 GiB)" in keep and "—" in keep  # keep has no 0.25 cell
