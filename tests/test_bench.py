"""The benchmark scripts run (at tiny size) and print their tables; their numbers are for the closing note."""
from __future__ import annotations

import pytest
from helpers import load_bench


def load(name: str):
    return load_bench(name)


def test_compare_smoke(capsys, tmp_path):
    compare = load("compare")
    out_json = tmp_path / "r.json"
    assert compare.main(["--size", "tiny", "--models", "cnn,gpt2", "--budgets", "0.95,0.9",
                         "--strategies", "keep,karma,checkpoint", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for word in ("## cnn", "## gpt2", "karma", "checkpoint", "planning:"):
        assert word in out
    import json

    results = json.loads(out_json.read_text())
    assert [r["model"] for r in results] == ["cnn", "gpt2"]
    assert all(len(r["cells"]) == 6 for r in results)


def test_solver_scaling_smoke(capsys):
    scaling = load("solver_scaling")
    assert scaling.main(["--size", "tiny", "--models", "gpt2:2,cnn", "--budget", "0.95"]) == 0
    out = capsys.readouterr().out
    assert "gpt2:2" in out and "cnn" in out and "capture s" in out


def test_plan_speed_curve_smoke(capsys):
    load("plan_speed").main(["--models", "cnn", "--positions", "0.25", "--curve", "0.5,none"])
    out = capsys.readouterr().out
    assert "limit s" in out and "\nnone" in out and "\n0.5" in out and "cnn" in out


def test_overhead_smoke(capsys):
    overhead = load("overhead")
    assert overhead.main(["--models", "mlp", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("eager", "aot_eager (default partitioner)", "torch.compile karma", "karma_fx.compile"):
        assert label in out


def test_gpu_check_dry(capsys):
    gpu_check = load("gpu_check")
    assert gpu_check.main(["--dry", "--sections", "regime", "--strategies", "checkpoint,karma",
                           "--baselines", "aot_eager,save_on_cpu"]) == 0
    out = capsys.readouterr().out
    for label in ("checkpoint", "karma", "torch activation_memory_budget (aot_eager)", "torch save_on_cpu",
                  "CPU (dry)"):
        assert label in out
    assert "ERROR" not in out


def test_scaling_smoke(capsys):
    scaling = load("scaling")
    assert scaling.main(["--size", "tiny", "--models", "1.5B", "--gpus", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "efficiency" in out and "all-reduce" in out and "FSDP2 eff." in out


def test_versus_torch_pairs_at_equal_or_higher_peak():
    versus = load("versus_torch")
    P = versus.Point
    mib = versus.MIB
    ours = [P("karma cpsat", "a", 100 * mib, 10.0), P("karma cpsat", "b", 80 * mib, 30.0),
            P("karma cpsat", "c", 50 * mib, 40.0)]
    theirs = [P("aot_eager", "r=1.0", 120 * mib, 12.0), P("aot_eager", "r=0.5", 101 * mib, 11.0),
              P("aot_eager", "r=0.0", 79.5 * mib, 20.0)]
    a, b, c = versus.pair(ours, theirs, tolerance=0.01)
    # a: the closest peak at or above 100 MiB is r=0.5 (101 MiB), slower than karma
    assert a.theirs.knob == "r=0.5" and a.dominated_by is None and a.verdict() == "faster by 10.0%"
    # b: 79.5 MiB is within 1% of 80, so it counts as equal; it is faster at a peak no higher: karma loses
    assert b.theirs.knob == "r=0.0" and b.dominated_by.knob == "r=0.0" and b.verdict().startswith("slower")
    # c: every baseline point has more memory; the closest (r=0.0) is faster, so karma is slower at equal peak
    assert c.theirs.knob == "r=0.0" and c.dominated_by is None and c.verdict() == "slower by 50.0%"
    # d: no baseline point gets this high; the highest of them is named and judged on time
    (d,) = versus.pair([P("karma cpsat", "d", 200 * mib, 5.0)], theirs)
    assert d.theirs is None and d.below.knob == "r=1.0"
    assert d.verdict() == "no baseline point this high; its highest, r=1.0 at 120.0 MiB, is slower"
    # the same pairing on the fastest step instead of the median
    (e,) = versus.pair([P("karma cpsat", "e", 100 * mib, 50.0, fastest_ms=9.0)],
                       [P("aot_eager", "r=0.5", 101 * mib, 40.0, fastest_ms=10.0)], time="fastest_ms")
    assert e.verdict() == "faster by 11.1%"


def test_compare_verdicts_flag_every_cell_cpsat_loses():
    compare = load("compare")

    def cell(strategy, budget, slowdown, fits=True):
        return {"strategy": strategy, "budget": budget, "budget_bytes": 1 << 30, "fits": fits,
                "slowdown": slowdown, "peak_bytes": 1 << 29}
    results = [{"model": "m", "min_peak_bytes": 1 << 28, "cells": [
        cell("cpsat", "0.7", 1.10), cell("greedy", "0.7", 1.10), cell("karma", "0.7", 1.30),  # a tie is ok
        cell("cpsat", "0.5", 1.28), cell("greedy", "0.5", 1.141),  # beaten: greedy is faster
        cell("cpsat", "0.35", 9.0, fits=False), cell("checkpoint", "0.35", 2.0),  # another fits, cpsat not
        cell("cpsat", "0.25", 9.0, fits=False), cell("greedy", "0.25", 9.0, fits=False)]}]  # nothing fits
    table, bad = compare.verdicts(results)
    assert bad == ["m at 0.5: greedy faster by 12.18%", "m at 0.35: checkpoint fits, cpsat does not"]
    assert "ok (nothing fits)" in table and "1.00 GiB" in table
    side = compare.side_by_side(results, results)
    assert "infeasible (floor" in side and "1.100x" in side


def test_compare_summary_sets_cpsat_beside_the_bound():
    """The geometric mean of the proven bounds is one no set of plans can go below: the summary prints it
    beside cpsat's, over the same models (those where cpsat fits and a bound exists)."""
    compare = load("compare")

    def model(name, mine, bound):
        return {"model": name, "bound": {"0.5": bound}, "cells": [
            {"strategy": "cpsat", "budget": "0.5", "fits": mine is not None, "slowdown": mine or 9.0}]}
    results = [model("a", 1.21, 1.1), model("b", 1.0, 1.0), model("c", None, 1.5), model("d", 1.3, None)]
    text = compare.summary(results)
    assert "1.100x / 1.049x (2)" in text  # sqrt(1.21) and sqrt(1.1); c does not fit, d has no bound
    assert "5.0% (2)" in text  # the gaps 10% and 0%



@pytest.mark.parametrize("name, argv, words", [
    ("beyond_capacity", ["--size", "tiny", "--models", "megatron_gpt", "--factors", "2"],
     ("megatron_gpt", "bottleneck", "host update ms")),
    ("host_update", ["--params", "4096", "--repeats", "1"], ("fused AdamW", "threads")),
])
def test_weight_streaming_benches_smoke(capsys, name, argv, words):
    assert load(name).main(argv) == 0
    out = capsys.readouterr().out
    assert all(w in out for w in words), out


def test_host_work_smoke(capsys):
    assert load("host_work").main(["--models", "params", "--doors", "eager", "--rounds", "1", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "karma_fx.compile, eager" in out and "torch.compile, aot_eager" in out and "params" in out
