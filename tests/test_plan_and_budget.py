"""Plan JSON round trips and budget parsing."""
from __future__ import annotations

import json

import pytest

from karma_fx.budget import format_bytes, parse_budget
from karma_fx.errors import BudgetError, PlanFormatError
from karma_fx.plan import SCHEMA_VERSION, Offload, Plan, Recompute, ScheduleRow


def sample_plan() -> Plan:
    return Plan(strategy="karma", budget_bytes=1000,
                decisions=(Offload("A", "f0", "f1", "b2", "b1", release_before="loss"),
                           Recompute(("B", "C"), ("f1", "f2"), "b2")),
                status="HEURISTIC", model="m", device="h100", peak_bytes=900, step_time_us=70.0,
                unlimited_step_time_us=60.0, unplanned_peak_bytes=3000, host_peak_bytes=1000, notes=("x",),
                schedule=(ScheduleRow("f0", offload=("A",), device_bytes=10, stall_us=1.5),))


def test_json_round_trip(tmp_path):
    plan = sample_plan()
    assert Plan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["decisions"][0]["kind"] == "offload" and data["decisions"][1]["kind"] == "recompute"
    assert plan.slowdown == pytest.approx(70 / 60) and plan.fits


def test_wrong_schema_or_garbage_is_a_clear_error():
    data = sample_plan().to_dict()
    data["schema_version"] = 1  # plans written before weight streaming still load
    assert Plan.from_dict(data) == sample_plan()
    data["schema_version"] = 99
    with pytest.raises(PlanFormatError, match="schema_version"):
        Plan.from_dict(data)
    with pytest.raises(PlanFormatError, match="JSON"):
        Plan.from_json("{not json")
    data = sample_plan().to_dict()
    data["decisions"] = [{"kind": "teleport", "tensor": "A"}]
    with pytest.raises(PlanFormatError):
        Plan.from_dict(data)
    for bad in ("[1, 2]", '{"schema_version": 1, "strategy": "x", "budget_bytes": 1, "decisions": ["offload"]}',
                '{"schema_version": 1, "strategy": "x", "budget_bytes": "big"}',
                '{"schema_version": 1, "strategy": "x", "budget_bytes": 1, "decisions": '
                '[{"kind": "recompute", "tensors": "ab", "ops": ["f"], "reload_before": "g"}]}'):
        with pytest.raises(PlanFormatError):
            Plan.from_json(bad)


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("1.5 GiB", int(1.5 * 2**30)), ("800MB", 800 * 10**6), ("2g", 2 * 2**30),
    (12e9, 12 * 10**9), (4096, 4096), ("4096", 4096),
])
def test_budget_sizes(text, expected):
    assert parse_budget(text) == expected


def test_budget_fractions_of_the_unplanned_peak():
    assert parse_budget(0.5, unplanned_peak_bytes=1000) == 500
    assert parse_budget("0.25", unplanned_peak_bytes=1000) == 250
    assert parse_budget(1, unplanned_peak_bytes=1000) == 1000
    with pytest.raises(BudgetError, match="fraction"):
        parse_budget(0.5)


@pytest.mark.parametrize("bad", [0, -3, "-3", "lots", "12 parsecs", float("nan"), float("inf"), None, True, "0.0"])
def test_nonsense_budgets(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad, unplanned_peak_bytes=1000)


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(None) == "-"
