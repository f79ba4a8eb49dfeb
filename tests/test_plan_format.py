"""Reading a plan back never ends in a raw traceback: every unreadable or contradictory file is a
``PlanFormatError`` that says what is wrong, and every plan that ``save`` wrote still loads unchanged."""
from __future__ import annotations

import json

import pytest

from karma_fx.errors import InvalidPlanError, KarmaError, PlanFormatError
from karma_fx.plan import GradToHost, Offload, Plan, Recompute, ScheduleRow, StreamWeight, Window


def sample() -> dict:
    plan = Plan(strategy="karma", budget_bytes=1000,
                decisions=(Offload("A", "f0", "f1", "b2", "b1", release_before="loss"),
                           Recompute(("B", "C"), ("f1", "f2"), "b2"),
                           StreamWeight("w", (Window("f0", "f0", "f0"),)), GradToHost("gw")),
                peak_bytes=900, step_time_us=70.0, unlimited_step_time_us=60, notes=("x",),
                schedule=(ScheduleRow("f0", offload=("A",), device_bytes=10, stall_us=1.5),))
    return json.loads(plan.to_json())


def test_valid_plans_round_trip(tmp_path):
    data = sample()
    plan = Plan.from_dict(data)
    assert Plan.from_json(plan.to_json()) == plan and Plan.from_dict(plan.to_dict()) == plan
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert Plan.from_dict({"schema_version": 1, "strategy": "keep", "budget_bytes": 5}).notes == ()


def test_unreadable_files(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PlanFormatError, match="UTF-8"):
        Plan.load(path)
    with pytest.raises(PlanFormatError, match="missing.json"):
        Plan.load(tmp_path / "missing.json")
    with pytest.raises(PlanFormatError, match="cannot read"):
        Plan.load(tmp_path)  # a folder
    with pytest.raises(PlanFormatError, match="nested"):
        Plan.from_json("[" * 100000)
    with pytest.raises(PlanFormatError, match="nested"):
        Plan.from_json('{"a": ' * 100000)


@pytest.mark.parametrize("field, value", [
    ("peak_bytes", "abc"), ("peak_bytes", 1.5), ("peak_bytes", True), ("budget_bytes", None),
    ("step_time_us", "x"), ("lower_bound_us", [1]), ("strategy", 3), ("status", None), ("model", None),
    ("decisions", 5), ("decisions", "offload"), ("decisions", [5]), ("decisions", [["offload"]]),
    ("notes", "abc"), ("notes", [1]), ("schedule", {"op": "f0"}), ("schedule", [{"op": 1}]),
    ("schedule", [{"op": "f0", "device_bytes": "1"}]), ("schedule", [{"op": "f0", "offload": "A"}]),
    ("schema_version", True),
])
def test_wrong_field_types_are_rejected(field, value):
    data = sample()
    data[field] = value
    with pytest.raises(PlanFormatError, match=field if field != "schema_version" else "schema_version"):
        Plan.from_dict(data)


@pytest.mark.parametrize("index, key, value", [
    (0, "tensor", 5), (0, "release_before", 1), (0, "reload_before", None), (0, "prefetch_at", ["b2"]),
    (1, "tensors", "BC"), (1, "ops", [1]), (2, "windows", [{"prefetch_at": 1, "reload_before": "a",
                                                           "free_after": "a"}]),
    (2, "windows", ["f0"]), (3, "tensor", None), (0, "kind", "teleport"), (0, "kind", ["offload"]),
    (0, "bogus", "x"),
])
def test_wrong_decision_fields_are_rejected(index, key, value):
    data = sample()
    data["decisions"][index][key] = value
    with pytest.raises(PlanFormatError, match=rf"decisions\[{index}\]"):
        Plan.from_dict(data)
    data["decisions"][index].pop(key)
    if key not in ("release_before", "bogus"):  # a required field missing is an error too
        with pytest.raises(PlanFormatError, match=rf"decisions\[{index}\]"):
            Plan.from_dict(data)


@pytest.mark.parametrize("extra", [
    {"kind": "offload", "tensor": "A", "offload_after": "f0", "free_after": "f1", "prefetch_at": "b2",
     "reload_before": "b1"},
    {"kind": "offload", "tensor": "B", "offload_after": "f0", "free_after": "f1", "prefetch_at": "b2",
     "reload_before": "b1"},
    {"kind": "recompute", "tensors": ["D", "C"], "ops": ["f2"], "reload_before": "b2"},
    {"kind": "grad_to_host", "tensor": "gw"},
])
def test_two_decisions_about_one_tensor_are_rejected(extra):
    data = sample()
    data["decisions"].append(extra)
    tensor = extra.get("tensor") or "C"
    with pytest.raises(PlanFormatError, match=f"'{tensor}'"):
        Plan.from_dict(data)


def test_one_chain_naming_a_tensor_twice_is_rejected():
    data = sample()
    data["decisions"][1]["tensors"] = ["B", "B"]
    with pytest.raises(PlanFormatError, match="'B'"):
        Plan.from_dict(data)


def test_every_reading_error_is_a_karma_error_with_advice():
    for bad in (b"\xff", "[" * 5000, "{}", '{"schema_version": 2}', "null"):
        with pytest.raises(KarmaError) as info:
            Plan.from_json(bad)
        assert "re-plan" in str(info.value) or "Plan.save" in str(info.value) or "fix" in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("budget_bytes", -1), ("peak_bytes", -5), ("unplanned_peak_bytes", -1), ("host_peak_bytes", -1),
    ("step_time_us", -0.5), ("unlimited_step_time_us", float("nan")), ("lower_bound_us", float("inf")),
    ("predicted_step_time_us", -1e-9),
])
def test_negative_or_non_finite_figures_are_rejected(tmp_path, field, value):
    data = sample()
    data[field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))  # Python's json writes NaN and Infinity, and reads them back
    with pytest.raises(InvalidPlanError, match=f"plan.{field} must be a finite number >= 0") as info:
        Plan.load(path)
    assert isinstance(info.value, PlanFormatError) and str(path) in str(info.value)


@pytest.mark.parametrize("key, value", [("device_bytes", -10), ("stall_us", -1.5), ("stall_us", float("nan"))])
def test_negative_schedule_figures_are_rejected(key, value):
    data = sample()
    data["schedule"][0][key] = value
    with pytest.raises(InvalidPlanError, match=rf"schedule\[0\].{key}"):
        Plan.from_dict(data)


@pytest.mark.parametrize("key", ["ops", "tensors"])
def test_recompute_group_without_ops_or_tensors_is_rejected(tmp_path, key):
    data = sample()
    data["decisions"][1][key] = []
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidPlanError, match=rf"decisions\[1\] \(recompute\).{key} is empty"):
        Plan.load(path)


def test_zero_figures_still_load():
    data = sample()
    data.update(peak_bytes=0, step_time_us=0.0, lower_bound_us=0)
    assert Plan.from_dict(data).peak_bytes == 0


@pytest.mark.parametrize("status, step, bound, shown", [
    ("OPTIMAL", 220.0, 100.0, "OPTIMAL within the solver's model only; 2.20x the proven lower bound"),
    ("OPTIMAL", 103.1, 100.0, "OPTIMAL within the solver's model only; 3.1% above the proven lower bound"),
    ("BLOCKS:OPTIMAL(5/6 blocks)", 150.0, 100.0,
     "BLOCKS:OPTIMAL(5/6 blocks) within the solver's model only; 1.50x the proven lower bound"),
    ("OPTIMAL", 100.0, 100.0, "OPTIMAL"),  # at its bound: optimal, full stop
    ("OPTIMAL", 100.05, 100.0, "OPTIMAL"),  # within the tolerance
    ("OPTIMAL", 100.0, None, "OPTIMAL within the solver's model; no proven lower bound to compare with"),
    ("OPTIMAL", None, 100.0, "OPTIMAL"),  # not simulated: nothing to compare
    ("FEASIBLE", 220.0, 100.0, "FEASIBLE"), ("FALLBACK:greedy", 220.0, 100.0, "FALLBACK:greedy"),
])
def test_optimal_says_what_it_is_optimal_for(status, step, bound, shown):
    plan = Plan(strategy="cpsat", budget_bytes=1000, status=status, step_time_us=step, lower_bound_us=bound,
                peak_bytes=900)
    assert plan.shown_status() == shown
    assert ("strategy", f"cpsat ({shown})") in plan.summary()
    assert plan.status == status  # the field stays machine-readable
