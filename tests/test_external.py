"""External node-link graphs: reading (exact problem, typed format errors), recompute-only planning, the
random layered generator."""
from __future__ import annotations

import copy
import json
import re

import pytest

from karma_fx.errors import KarmaError
from karma_fx.external import (GraphFormatError, from_node_link, graph_costs, prepare_graph, random_layered_graph,
                               read_node_link)
from karma_fx.plan import Offload, Recompute
from karma_fx.strategies.cpsat.options import SolverOptions
from karma_fx.strategies.cpsat.planner import CpSat
from karma_fx.problem import Op, Problem, Storage
from karma_fx.simulate import simulate
from karma_fx.strategies import HEURISTICS, make_strategy
from karma_fx.strategies.cpsat.bound import lower_bound_us

# x -> h -> loss (forward); g_loss reads loss and h; g_h reads g_loss and x.
FIVE = {
    "directed": True, "multigraph": False, "graph": {"name": "five"},
    "nodes": [
        {"id": 0, "name": "x", "cost_cpu": 1, "cost_ram": 100, "backward": False},
        {"id": 1, "name": "h", "cost_cpu": 2, "cost_ram": 200, "backward": False},
        {"id": 2, "name": "loss", "cost_cpu": 3, "cost_ram": 4, "backward": False},
        {"id": 3, "name": "g_loss", "cost_cpu": 4, "cost_ram": 200, "backward": True},
        {"id": 4, "name": "g_h", "cost_cpu": 5.5, "cost_ram": 100, "backward": True},
    ],
    "links": [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 2, "target": 3},
              {"source": 1, "target": 3}, {"source": 3, "target": 4}, {"source": 0, "target": 4}],
}


def test_five_node_graph_reads_into_the_exact_problem(tmp_path):
    expected = Problem(
        ops=(Op("x", "x", "fwd", (), ("x",)),
             Op("h", "h", "fwd", ("x",), ("h",)),
             Op("loss", "loss", "fwd", ("h",), ("loss",)),
             Op("g_loss", "g_loss", "bwd", ("h", "loss"), ("g_loss",)),
             Op("g_h", "g_h", "bwd", ("x", "g_loss"), ("g_h",))),
        storages=(Storage("x", 100, "activation", 0, (1, 4)),
                  Storage("h", 200, "activation", 1, (2, 3)),
                  Storage("loss", 4, "activation", 2, (3,)),
                  Storage("g_loss", 200, "temp", 3, (4,)),
                  Storage("g_h", 100, "temp", 4, (), is_output=True)),
        num_fwd_ops=3, cut_points=(0, 1, 2), name="five")
    path = tmp_path / "five.json"
    path.write_text(json.dumps(FIVE))
    for source in (FIVE, path, str(path)):
        assert from_node_link(source) == expected
    graph = read_node_link(FIVE)
    assert graph.op_time_us == (1.0, 2.0, 3.0, 4.0, 5.5)
    costs = graph_costs(graph)
    assert costs.op_time_us == graph.op_time_us and not costs.allow_offload


def test_random_layered_tags_and_order_are_read():
    data = {"graph": {"order": ["c", "a", "b"], "cpu_tag": "t"},
            "nodes": [{"id": "a", "t": 2, "out_cost": 10}, {"id": "b", "t": 3, "out_cost": 20},
                      {"id": "c", "t": 1, "out_cost": 30}],
            "edges": [{"source": "c", "target": "a"}, {"source": "a", "target": "b"}]}
    graph = read_node_link(data)
    assert [op.name for op in graph.problem.ops] == ["c", "a", "b"]
    assert graph.op_time_us == (1.0, 2.0, 3.0)
    assert [s.size_bytes for s in graph.problem.storages] == [30, 10, 20]
    assert graph.problem.num_fwd_ops == 3  # no backward flag at all: forward only


def moccasin_shaped() -> dict:
    """A small graph written as Moccasin writes its random layered graphs: no ``id`` (the ``name`` is the id),
    links keyed ``"0"`` / ``"1"``, graph attributes naming the cost keys, a source, a target (id 1, last) and an
    execution order that is not the ids'. No backward flags: forward only."""
    return {"directed": True, "multigraph": False,
            "graph": {"name": "moccasin-shaped", "pos": {"0": [0, 0], "2": [0, -1], "3": [1, -1], "1": [0, -2]},
                      "source_node": 0, "target_node": 1, "node_output_cost_tag": "out_cost",
                      "node_param_cost_tag": "param_cost", "node_input_cost_tag": "input_cost",
                      "node_duration_tag": "duration", "edge_cost_tag": "edge_cost", "max_cost": 1,
                      "order": [0, 3, 2, 1]},
            "nodes": [{"out_cost": 7, "param_cost": 0, "duration": 0, "name": 0},
                      {"out_cost": 9, "param_cost": 0, "duration": 0, "name": 1},
                      {"out_cost": 5, "param_cost": 0, "duration": 4, "name": 2},
                      {"out_cost": 3, "param_cost": 0, "duration": 6, "name": 3}],
            "links": [{"0": 0, "1": 2}, {"0": 0, "1": 3}, {"0": 3, "1": 2}, {"0": 2, "1": 1}, {"0": 3, "1": 1}]}


def test_moccasin_files_are_read_as_written():
    graph = read_node_link(moccasin_shaped())
    problem = graph.problem
    assert [op.name for op in problem.ops] == ["0", "3", "2", "1"] and graph.node_ids == (0, 3, 2, 1)
    assert graph.op_time_us == (0.0, 6.0, 4.0, 0.0)
    assert [s.size_bytes for s in problem.storages] == [7, 3, 5, 9]
    assert [op.inputs for op in problem.ops] == [(), ("0",), ("0", "3"), ("3", "2")]
    assert problem.num_fwd_ops == 4 and not problem.saved_activations()


def test_a_graph_without_a_backward_is_refused_saying_why():
    from karma_fx.errors import InfeasibleBudgetError

    prepared = prepare_graph(moccasin_shaped())
    with pytest.raises(InfeasibleBudgetError, match="nothing moved: general rematerialization .* finds no drop "
                                                     "that lowers the peak") as info:
        prepared.plan(0.8)
    assert info.value.min_budget_bytes == prepared.unplanned_peak_bytes == 17


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["nodes"][2].update(param_cost=64), "node 2 has param_cost 64 .*only the bytes of each node's output"),
    (lambda d: d["nodes"][3].update(input_cost=8), "node 3 has input_cost 8"),
    (lambda d: d["links"][1].update(edge_cost=2), r"links\[1\] has edge_cost 2"),
    (lambda d: d["graph"].update(target_node=2), "target_node is 2, but the last node in execution order is 1"),
    (lambda d: d["graph"].update(source_node=3), "source_node is 3, but the first node"),
    (lambda d: d["nodes"][1].update(id=1), r"nodes\[0\] has no 'id'"),
    (lambda d: d["links"].append({"0": 2}), r"links\[5\] needs a 'source' and a 'target'"),
])
def test_moccasin_shaped_errors(change, needle):
    data = moccasin_shaped()
    change(data)
    with pytest.raises(GraphFormatError, match=needle):
        read_node_link(data)


def _broken(change) -> dict:
    data = copy.deepcopy(FIVE)
    change(data)
    return data


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.pop("nodes"), "'nodes'"),
    (lambda d: d.pop("links"), "'links'"),
    (lambda d: d["nodes"][1].pop("cost_ram"), "no 'cost_ram'"),
    (lambda d: d["nodes"][1].pop("backward"), "no 'backward'"),
    (lambda d: d["nodes"][2].update(cost_cpu=-1), "must not be negative"),
    (lambda d: d["nodes"][2].update(cost_ram=-5), "must not be negative"),
    (lambda d: d["nodes"][2].update(cost_cpu="fast"), "finite number"),
    (lambda d: d["nodes"][2].update(id=1), "appears twice"),
    (lambda d: d["links"].append({"source": 1, "target": 9}), "unknown node 9"),
    (lambda d: d.update(links=[{"source": 1, "target": 0}]), "1 -> 0 goes from a later node .* execution order"),
    (lambda d: d["links"].append({"source": 3, "target": 1}), "cycle"),
    (lambda d: d["links"].append({"source": 2, "target": 2}), "cycle"),
    (lambda d: d["nodes"][1].update(backward=True), "forward node 2 runs after backward node 1"),
    (lambda d: d["graph"].update(order=[0, 1, 2]), "'order'"),
])
def test_format_errors_are_typed_and_say_what_is_wrong(change, needle):
    with pytest.raises(GraphFormatError, match=needle) as info:
        read_node_link(_broken(change))
    assert isinstance(info.value, KarmaError)


def test_unreadable_files_are_typed(tmp_path):
    with pytest.raises(GraphFormatError, match="cannot read"):
        read_node_link(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nodes: ")
    with pytest.raises(GraphFormatError, match="not JSON"):
        read_node_link(bad)


def _node_change(key: str, value: object):
    return lambda d: d["nodes"][2].update({key: value})


@pytest.mark.parametrize("change, needle", [
    (_node_change("cost_ram", 1e300), r"node 2: cost_ram 1e\+300 is out of range"),
    (_node_change("cost_ram", 10 ** 400), "node 2: cost_ram 1000.* is out of range"),
    (_node_change("cost_ram", -10 ** 400), "node 2: cost_ram must not be negative"),
    (_node_change("cost_cpu", 1e300), r"node 2: cost_cpu 1e\+300 is out of range"),
    (_node_change("cost_cpu", float("inf")), "node 2: cost_cpu must be a finite number"),
    (_node_change("cost_ram", float("nan")), "node 2: cost_ram must be a finite number"),
    (_node_change("cost_ram", -0.5), "node 2: cost_ram must not be negative"),
    (_node_change("cost_ram", True), "node 2: cost_ram must be a finite number, got True"),
    (_node_change("cost_cpu", "3"), "node 2: cost_cpu must be a finite number, got '3'"),
    (_node_change("cost_cpu", None), "node 2: cost_cpu must be a finite number, got None"),
    (_node_change("name", ["loss"]), "node 2: name must be a string"),
    (lambda d: [n.update(cost_ram=2 ** 52) for n in d["nodes"]], "cost_ram values add up to"),
])
def test_out_of_range_costs_are_typed(change, needle):
    with pytest.raises(GraphFormatError, match=needle):
        prepare_graph(_broken(change))


def _cli_error(tmp_path, capsys, content: bytes) -> str:
    """Run ``karma-fx plan --graph`` on a file holding ``content``; return its one-line error."""
    from karma_fx.cli import main

    path = tmp_path / "graph.json"
    path.write_bytes(content)
    code = main(["plan", "--graph", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("karma-fx: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe\x00\x81", "is not UTF-8 text"),
    (b"[" * 100000, "nested too deeply"),
    (b'{"a": ' * 100000, "nested too deeply"),
    (json.dumps(_broken(_node_change("cost_ram", 1e300))).encode(), "cost_ram 1e+300 is out of range"),
    (json.dumps(_broken(_node_change("cost_cpu", -1))).encode(), "cost_cpu must not be negative"),
    (json.dumps(_broken(_node_change("cost_ram", False))).encode(), "cost_ram must be a finite number"),
    (json.dumps(_broken(_node_change("cost_cpu", float("nan")))).encode(), "cost_cpu must be a finite number"),
])
def test_unreadable_graph_files(tmp_path, capsys, content, needle):
    path = tmp_path / "graph.json"
    path.write_bytes(content)
    with pytest.raises(GraphFormatError, match=re.escape(needle)):
        prepare_graph(path)
    assert needle in _cli_error(tmp_path, capsys, content)


def test_generator_is_deterministic_and_reads_back():
    a, b = random_layered_graph(100, 7), random_layered_graph(100, 7)
    assert a == b and a != random_layered_graph(100, 8)
    problem = from_node_link(a)
    assert len(problem.ops) == 100 and problem.num_fwd_ops == 50
    assert len(problem.saved_activations()) == 50  # every forward output is read by its backward node
    with pytest.raises(KarmaError):
        random_layered_graph(2, 0)


@pytest.fixture(scope="module")
def layered():
    return prepare_graph(random_layered_graph(100, 0))


@pytest.mark.parametrize("name", ["checkpoint", "offload", "karma", "greedy"])
def test_recompute_only_heuristics_never_offload(layered, name):
    plan = make_strategy(name)(layered.problem, layered.costs, int(0.8 * layered.unplanned_peak_bytes))
    assert not any(isinstance(d, Offload) for d in plan.decisions)


def test_layered_graph_planned_at_08_fits_recompute_only(layered):
    planned = layered.plan(0.8, "cpsat", time_limit_s=10)
    plan = planned.plan
    assert plan.fits and plan.peak_bytes <= plan.budget_bytes
    assert not any(isinstance(d, Offload) for d in plan.decisions)
    assert any(isinstance(d, Recompute) for d in plan.decisions)
    timeline = simulate(layered.problem, plan.decisions, layered.costs)
    assert timeline.peak_bytes <= plan.budget_bytes
    # general rematerialization (remat) wins here: the LP bound covers plans of saved activations only
    assert (plan.lower_bound_us is None) == (plan.status == "FALLBACK:remat")
    assert plan.lower_bound_us is None or plan.lower_bound_us <= timeline.makespan_us + 1e-6
    assert plan.slowdown >= 1.0


def test_recompute_only_bound_is_tighter_than_with_offload():
    small = random_layered_graph(30, 0)
    only, with_link = prepare_graph(small), prepare_graph(small, allow_offload=True)
    budget = int(0.8 * only.unplanned_peak_bytes)
    base = [b for _, b in only.keep.memory]
    recompute_only = lower_bound_us(only.problem, only.costs, budget, base)
    general = lower_bound_us(with_link.problem, with_link.costs, budget, base)
    assert recompute_only is not None and general is not None and recompute_only >= general - 1e-6


def test_five_node_graph_cpsat_recomputes_within_budget():
    prepared = prepare_graph(FIVE)
    plan = prepared.plan(0.9, "cpsat").plan
    assert plan.fits and not any(isinstance(d, Offload) for d in plan.decisions)
    assert set(HEURISTICS) >= {"checkpoint", "greedy", "karma"}


def _saved_activation_plan(graph: dict, fraction: float):
    """cpsat's plan of saved activations alone (general rematerialization, which wins on these graphs, aside),
    its solver always run, checked in the simulator: (plan, simulated step µs, simulated peak)."""
    prepared = prepare_graph(graph)
    solver = CpSat(fallbacks=tuple(make_strategy(k) for k in ("checkpoint", "greedy", "karma")),
                   options=SolverOptions(time_limit_s=10, good_enough_gap=0))
    plan = solver(prepared.problem, prepared.costs, int(fraction * prepared.unplanned_peak_bytes))
    timeline = simulate(prepared.problem, plan.decisions, prepared.costs)
    assert timeline.peak_bytes <= plan.budget_bytes
    return plan, timeline.makespan_us, timeline.peak_bytes


def test_a_graph_in_small_units_plans_as_the_same_graph_in_bytes():
    """The solver's memory thresholds are relative to the graph: the same graph written in MiB (sizes 1 to 64)
    and in bytes gets the same candidates and the same plan. With a fixed 64 KiB unit the graph in MiB had no
    tensor large enough for the solver and got greedy's plan (5102 against 5097 µs)."""
    in_bytes = random_layered_graph(60, 3)
    in_mib = copy.deepcopy(in_bytes)
    for node in in_mib["nodes"]:
        node["cost_ram"] //= 2 ** 20
    (a, _, peak_a), (b, _, peak_b) = _saved_activation_plan(in_bytes, 0.8), _saved_activation_plan(in_mib, 0.8)
    counts = [[n for n in p.notes if "large enough for the solver" in n] for p in (a, b)]
    assert counts[0] == counts[1] == ["30 tensors large enough for the solver to decide on"]
    assert a.status == b.status == "OPTIMAL"
    assert a.decisions == b.decisions and peak_a == peak_b * 2 ** 20


def test_a_graph_timed_in_small_units_plans_as_the_same_graph_in_microseconds():
    """The solver's time units are relative to the step: the same graph with every duration a thousandth gets
    the same plan, a thousandth as long. At a fixed 0.1 µs its ops took 0 to 2 units, and its plan was greedy's
    (5.229 against 5.204)."""
    in_us = random_layered_graph(60, 3)
    in_ms = copy.deepcopy(in_us)
    for node in in_ms["nodes"]:
        node["cost_cpu"] /= 1000
    (a, step_a, _), (b, step_b, _) = _saved_activation_plan(in_us, 0.7), _saved_activation_plan(in_ms, 0.7)
    assert a.status == b.status == "OPTIMAL"
    assert a.decisions == b.decisions and step_b * 1000 == pytest.approx(step_a, rel=1e-9)
