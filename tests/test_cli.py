"""karma-fx: the commands run in-process on tiny models, user errors are one line with exit status 2 (never a
traceback), and the installed console entry point works."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from karma_fx import Plan
from karma_fx.cli import main
from karma_fx.strategies import COMPARED
from karma_fx.zoo import names

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("karma-fx: error:") and "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_plan_prints_table_and_writes_files(capsys, tmp_path):
    out_dir = tmp_path / "out"  # does not exist yet: the CLI creates it
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--budget", "0.8", "--strategy", "karma",
                          "--json", str(out_dir / "plan.json"), "--plot", str(out_dir / "timeline.png"),
                          "--trace", str(out_dir / "trace.json"), "--max-rows", "5")
    assert code == 0, err
    assert "strategy     karma" in out and "step time" in out and "(fits)" in out
    assert "planning took" in out and "capture" in out and "strategy" in out
    plan = Plan.load(out_dir / "plan.json")
    assert plan.strategy == "karma" and plan.model == "cnn-tiny" and plan.fits
    assert plan.table(max_rows=5) in out
    assert (out_dir / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert '"traceEvents"' in (out_dir / "trace.json").read_text()[:200]


def test_compare_prints_a_grid_with_every_strategy(capsys):
    code, out, err = _run(capsys, "compare", "cnn", "--size", "tiny", "--budgets", "0.9,0.5")
    assert code == 0, err
    grid = out.splitlines()
    header = next(line for line in grid if line.startswith("strategy"))
    assert "0.9 (" in header and "0.5 (" in header
    for s in COMPARED:
        assert any(line.startswith(s + " ") for line in grid), s
    keep = next(line for line in grid if line.startswith("keep "))
    assert keep.count("infeasible") == 2  # keep never fits below the unplanned peak
    assert "x / " in out and "*" in out  # at least one feasible cell, the fastest marked
    for label in ("unplanned peak", "unlimited step", "smallest peak", "planning time"):
        assert label in out


def test_compare_subset_of_strategies(capsys):
    code, out, err = _run(capsys, "compare", "cnn", "--size", "tiny", "--budgets", "0.9",
                          "--strategies", "keep,checkpoint")
    assert code == 0, err
    assert "checkpoint" in out and "karma" not in out.split("unplanned peak")[0]


@pytest.mark.parametrize("budget", ["-3", "lots", "0"])
def test_bad_budget_is_a_one_line_error(capsys, budget):
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--budget", budget)
    _assert_user_error(code, err, "budget")
    assert out == ""


def test_unknown_model_lists_the_zoo(capsys):
    code, _, err = _run(capsys, "plan", "no-such-model", "--size", "tiny")
    _assert_user_error(code, err, "no-such-model", *names())
    code, _, err = _run(capsys, "compare", "no-such-model")
    _assert_user_error(code, err, "gpt2")


def test_other_user_errors(capsys):
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--strategy", "magic")
    _assert_user_error(code, err, "magic", "karma")
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--device", "x100")
    _assert_user_error(code, err, "x100", "h100")
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--layers", "3")
    _assert_user_error(code, err, "--layers", "gpt2")
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--seq", "8")
    _assert_user_error(code, err, "--seq")
    code, _, err = _run(capsys, "compare", "cnn", "--size", "tiny", "--strategies", "keep,nope")
    _assert_user_error(code, err, "nope")


def test_infeasible_budget_names_the_smallest_workable_one(capsys):
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--budget", "0.1")
    _assert_user_error(code, err, "cannot fit", "smallest budget")


def test_layers_override_reaches_the_zoo(capsys):
    peaks = []
    for layers in ("1", "2"):
        code, out, err = _run(capsys, "plan", "gpt2", "--size", "tiny", "--layers", layers, "--budget", "1",
                              "--strategy", "keep", "--max-rows", "0")
        assert code == 0, err
        assert "strategy     keep" in out
        peaks.append(next(line for line in out.splitlines() if line.startswith("peak ")))
    assert peaks[0] != peaks[1]  # a deeper model needs more memory: the override was applied


def test_models_and_usage(capsys):
    code, out, _ = _run(capsys, "models")
    assert code == 0
    for name in names():
        assert name in out
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0 and "gpt2" in out and "--budget" in out
    code, _, err = _run(capsys, "plan", "--bogus-flag")
    assert code == 2 and "Traceback" not in err
    assert _run(capsys)[0] == 2  # no command: usage


def test_console_entry_point():
    # the venv's bin/ may not be on PATH when pytest is run as /work/venv/bin/python -m pytest
    exe = shutil.which("karma-fx") or shutil.which("karma-fx", path=str(Path(sys.executable).parent))
    cmd = [exe, "models"] if exe else [sys.executable, "-m", "karma_fx", "models"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gpt2" in done.stdout and "resnet50" in done.stdout
    done = subprocess.run([sys.executable, "-m", "karma_fx", "plan", "nope"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "karma-fx: error:" in done.stderr and "Traceback" not in done.stderr


def test_plan_predicts_data_parallel_step(capsys):
    from karma_fx.cli import main

    assert main(["plan", "mlp", "--size", "tiny", "--budget", "1.0", "--max-rows", "0", "--nodes", "4",
                 "--gpus-per-node", "2", "--network-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "4 node(s) x 2 GPU(s) = 8 GPUs" in out and "weak-scaling efficiency" in out
    assert main(["plan", "mlp", "--size", "tiny", "--nodes", "0"]) != 0


def test_plan_with_weights_offloaded(capsys):
    from karma_fx.cli import main

    assert main(["plan", "mlp", "--size", "tiny", "--budget", "0.6", "--max-rows", "0", "--offload-weights"]) == 0
    out = capsys.readouterr().out
    assert "streamed from the host" in out


# ---- output formats, interrupts, one-line errors ------------------------------------------------------------
def _no_capture(monkeypatch):
    """Make the slow capture fail loudly: a check that must come before it then proves it did."""
    import karma_fx.cli as cli

    def boom(args):
        raise AssertionError("captured the model before checking the options")
    monkeypatch.setattr(cli, "_prepare", boom)


def test_plot_format_matplotlib_cannot_write_is_refused_before_capture(capsys, monkeypatch, tmp_path):
    _no_capture(monkeypatch)
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--plot", str(tmp_path / "x.xyz"))
    _assert_user_error(code, err, ".xyz", ".png", ".svg")
    assert len(err.strip().splitlines()) == 1 and out == ""
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--plot", str(tmp_path / "timeline"))
    _assert_user_error(code, err, "without an extension")


def test_plot_without_matplotlib_says_what_to_install(capsys, monkeypatch, tmp_path):
    _no_capture(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--plot", str(tmp_path / "x.png"))
    _assert_user_error(code, err, "pip install 'karma_fx[plot]'")


def test_keyboard_interrupt_in_process_is_one_line_and_130(capsys, monkeypatch):
    import karma_fx.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_prepare", interrupted)
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny")
    assert code == 130 and err == "karma-fx: interrupted\n" and out == ""


def test_every_karma_error_is_one_line(capsys, monkeypatch):
    import karma_fx.cli as cli
    from karma_fx.errors import KarmaError

    def fails(args):
        raise KarmaError("first line\n  second line\n")
    monkeypatch.setattr(cli, "_prepare", fails)
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny")
    _assert_user_error(code, err, "first line second line")
    assert err.count("\n") == 1


@pytest.mark.slow
def test_ctrl_c_during_planning_prints_one_line_and_exits_130():
    import signal
    import time

    # Run ``python -m karma_fx`` once the package is imported (its torch import is outside main, where no
    # handler can be in place yet), then press Ctrl-C while the model is being built and captured.
    script = ("import runpy, sys, karma_fx.cli; print('ready', flush=True); "
              "sys.argv = ['karma-fx', 'plan', 'gpt2', '--size', 'tiny', '--budget', '0.95', '--strategy', 'cpsat']; "
              "runpy.run_module('karma_fx', run_name='__main__')")
    # as from a terminal: Ctrl-C not ignored (a test run started in the background inherits SIG_IGN, and a
    # Python started so never turns SIGINT into KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "KARMA_PROGRESS": "0"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        assert proc.poll() is None, "finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130, err
    assert lines == ["karma-fx: interrupted"], err


# ---- progress display and logging (karma_fx.progress) -----------------------------------------------------
def test_progress_display_shows_stage_strategy_and_best_plan(capsys, monkeypatch):
    from karma_fx import progress

    monkeypatch.setenv("KARMA_PROGRESS", "1")
    with progress.planning("cnn-tiny", show_after_s=0.0):
        progress.report("heuristics", strategy="greedy", slowdown=1.065, peak_bytes=3 << 20)
        text = progress.current_text()
        progress.report("solver, exact pass", strategy="cpsat")
    assert text == "planning cnn-tiny: heuristics, strategy greedy, best 1.065x at 3.00 MiB"
    err = capsys.readouterr().err
    assert "heuristics, strategy greedy" in err and "solver, exact pass, strategy cpsat, best 1.065x" in err
    assert progress.current_text() is None


def test_progress_plain_lines_without_tqdm(capsys, monkeypatch):
    from karma_fx import progress

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with progress.planning("cnn-tiny", enabled=True, show_after_s=0.0):
        progress.report("capture")
        progress.report("capture")  # unchanged: not repeated
    assert capsys.readouterr().err.count("karma-fx: planning cnn-tiny: capture\n") == 1


def test_progress_stays_quiet_for_quick_or_disabled_plannings(capsys, monkeypatch):
    from karma_fx import progress

    monkeypatch.setenv("KARMA_PROGRESS", "1")
    with progress.planning("quick", show_after_s=60):
        progress.report("capture", strategy="karma")
    monkeypatch.setenv("KARMA_PROGRESS", "0")
    with progress.planning("off", enabled=True, show_after_s=0.0):
        progress.report("capture", strategy="karma")
    monkeypatch.delenv("KARMA_PROGRESS")
    with progress.planning("not a terminal", show_after_s=0.0):  # pytest's stderr is no TTY
        progress.report("capture")
    progress.report("outside any planning")  # a no-op, not an error
    assert capsys.readouterr().err == ""


def test_progress_is_per_context(monkeypatch):
    import threading

    from karma_fx import progress

    seen = []
    with progress.planning("outer", enabled=False):
        with progress.planning("inner"):
            progress.report("lower bound")
            seen.append(progress.current_text())
        seen.append(progress.current_text())
        worker = threading.Thread(target=lambda: seen.append(progress.current_text()))
        worker.start()
        worker.join()
    assert seen == ["planning inner: lower bound", "planning outer: lower bound", None]


def test_cpsat_logs_its_stages_to_the_karma_fx_logger(caplog, tiny_cnn):
    import logging

    from karma_fx import progress
    from karma_fx.strategies import make_strategy

    problem, costs, budget = tiny_cnn
    caplog.set_level(logging.DEBUG, logger="karma_fx")
    with progress.planning("cnn-tiny", enabled=False):
        make_strategy("cpsat")(problem, costs, budget)
    records = [r for r in caplog.records if r.name == "karma_fx"]
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    messages = [r.getMessage() for r in records]
    # INFO: a line per stage (a few a planning); DEBUG: every strategy, order and quota tried
    assert "planning cnn-tiny: lower bound, strategy cpsat" in info and len(info) <= 6, info
    for name in ("checkpoint", "offload", "karma", "greedy"):
        assert any(m.startswith(f"planning cnn-tiny: heuristics, strategy {name}") for m in messages), messages
    assert any("swap quota 0" in m and "strategy greedy" in m for m in info)
    assert any(" best " in m and "x at " in m for m in messages)  # the best fitting plan so far


# ---- time limits --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cnn():
    import karma_fx
    from karma_fx.budget import parse_budget
    from karma_fx.zoo import build

    prepared = karma_fx.prepare(*build("cnn", "tiny"), device="h100", name="cnn-tiny")
    return prepared.problem, prepared.costs, parse_budget(0.8, prepared.unplanned_peak_bytes)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
def test_time_limit_must_be_a_positive_number(bad):
    from karma_fx.errors import KarmaError
    from karma_fx.strategies import make_strategy

    with pytest.raises(KarmaError, match="time_limit_s") as info:
        make_strategy("cpsat", time_limit_s=bad)
    assert repr(bad) in str(info.value)


def test_cpsat_with_a_time_limit_returns_a_fitting_plan(tiny_cnn):
    import time

    from karma_fx.simulate import simulate
    from karma_fx.strategies import make_strategy

    problem, costs, budget = tiny_cnn
    t0 = time.perf_counter()
    plan = make_strategy("cpsat", time_limit_s=1.0)(problem, costs, budget)
    assert time.perf_counter() - t0 < 6
    assert simulate(problem, plan, costs).peak_bytes <= budget


class _Sleepy:
    """A slow heuristic: karma's plan, after a nap."""

    name = "sleepy"

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self, problem, costs, budget_bytes):
        import time

        from karma_fx.strategies import make_strategy

        self.calls += 1
        time.sleep(self.seconds)
        return make_strategy("karma")(problem, costs, budget_bytes).replace(strategy=self.name)


def test_cpsat_starts_no_new_work_past_its_time_limit(tiny_cnn):
    import time

    from karma_fx.strategies import CpSat

    problem, costs, budget = tiny_cnn
    sleepy = _Sleepy(0.4)
    t0 = time.perf_counter()
    plan = CpSat([sleepy] * 10, time_limit_s=1.0)(problem, costs, budget)  # 4 s of heuristics without a limit
    assert time.perf_counter() - t0 < 5 and sleepy.calls <= 4
    assert plan.status == "FALLBACK:sleepy"
    assert plan.notes[-1] == "stopped at the 1 s time limit; the plan may be slower than with more time"


def test_past_the_limit_before_any_plan_the_cheapest_heuristic_still_runs(tiny_cnn):
    from karma_fx.simulate import simulate
    from karma_fx.strategies import make_strategy

    problem, costs, budget = tiny_cnn
    for name in ("cpsat", "greedy"):
        plan = make_strategy(name, time_limit_s=1e-9)(problem, costs, budget)
        assert simulate(problem, plan, costs).peak_bytes <= budget, (name, plan.notes)
        assert any("time limit" in note for note in plan.notes), plan.notes
        assert sum("time limit" in note for note in plan.notes) == 1  # said once, not per strategy


def test_solver_runs_are_cut_to_the_time_left():
    from karma_fx import progress
    from karma_fx.strategies.cpsat import Model, SolverOptions

    with progress.deadline(0.5):
        solver = Model._solver(None, SolverOptions(), 20.0)  # type: ignore[arg-type]  # self is unused
    assert solver.parameters.max_time_in_seconds <= 0.5
    free = Model._solver(None, SolverOptions(), 20.0)  # type: ignore[arg-type]
    assert free.parameters.max_time_in_seconds == 80.0  # no deadline: the solver's own cap, as before


def test_plan_graph_prints_a_recompute_only_plan(capsys, tmp_path):
    import json

    from karma_fx.external import random_layered_graph

    graph = tmp_path / "layered.json"
    graph.write_text(json.dumps(random_layered_graph(60, 3)))
    code, out, err = _run(capsys, "plan", "--graph", str(graph), "--budget", "0.8", "--json", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "recompute only" in out and "layered-60-s3" in out and "0 offloads" in out and "(fits)" in out
    plan = Plan.load(tmp_path / "p.json")
    assert plan.fits and plan.strategy == "cpsat"
    code, out, err = _run(capsys, "plan", "--graph", str(graph), "--budget", "0.8", "--strategy", "checkpoint")
    assert code == 0 and "checkpoint" in out


def test_plan_graph_user_errors_are_one_line(capsys, tmp_path):
    graph = tmp_path / "bad.json"
    graph.write_text('{"nodes": [{"id": 0, "cost_cpu": 1}], "links": []}')
    _assert_user_error(*_run(capsys, "plan", "--graph", str(graph))[::2], "no 'cost_ram'")
    _assert_user_error(*_run(capsys, "plan", "--graph", str(tmp_path / "none.json"))[::2], "cannot read graph file")
    _assert_user_error(*_run(capsys, "plan", "gpt2", "--graph", str(graph))[::2], "MODEL does not apply")
    _assert_user_error(*_run(capsys, "plan", "--graph", str(graph), "--size", "tiny", "--layers", "2")[::2],
                       "--size, --layers do not apply")
    _assert_user_error(*_run(capsys, "plan", "cnn", "--allow-offload")[::2], "--allow-offload applies to --graph")


# ---- usability: no model, default budget, progress through the strategies, time limit, -q / -v ------------
@pytest.mark.parametrize("command", ["plan", "compare"])
def test_no_model_prints_usage_instead_of_planning_one(capsys, monkeypatch, command):
    _no_capture(monkeypatch)
    code, out, err = _run(capsys, command)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"usage: karma-fx {command}") and f"karma-fx {command}: error: name the model" in err
    assert "resnet50" in err  # the choices are listed


@pytest.mark.parametrize("name", names())
def test_default_budget_is_within_reach_of_every_tiny_zoo_model(name):
    """``--budget auto`` is never below the smallest budget known to work (which cpsat reaches) and never above
    the unplanned peak; 0.5 of the peak when that is reachable."""
    from conftest import prepared

    from karma_fx.cli import AUTO_BUDGET, _resolve_budget

    p = prepared(name)
    budget, shown = _resolve_budget(AUTO_BUDGET, p)
    floor, peak = p.min_peak_bytes(), p.unplanned_peak_bytes
    assert isinstance(budget, int) and floor <= budget <= peak and shown.startswith("auto (")
    if floor <= peak // 2:
        assert budget == peak // 2
    assert _resolve_budget("0.7", p) == ("0.7", "0.7")


def test_default_budget_plans_a_tiny_model_that_0_5_could_not(capsys):
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--time-limit", "2", "--max-rows", "0")
    assert code == 0, err
    assert "budget auto (halfway from the smallest workable budget" in out and "(fits)" in out


def test_progress_goes_on_through_the_strategies(capsys, monkeypatch):
    """The CLI's progress line covers the strategies too (``karma-fx plan resnet50`` was silent for the 71 s
    they took: the library opens a display for the capture only)."""
    from karma_fx import progress

    monkeypatch.setenv("KARMA_PROGRESS", "1")
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # plain lines, one per change
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--budget", "0.95", "--max-rows", "0")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("karma-fx: planning cnn-tiny: ")]
    assert any(": capture" in line for line in lines)
    assert any("heuristics, strategy" in line for line in lines), lines
    assert any("best " in line for line in lines), lines  # the best plan so far, from the strategy stage


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "inf", "soon"])
def test_time_limit_is_validated_before_anything_runs(capsys, monkeypatch, bad):
    _no_capture(monkeypatch)
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "--time-limit", bad)
    assert code == 2 and out == "" and "argument --time-limit" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["plan", "cnn", "--size", "tiny"],
                                     ["compare", "cnn", "--size", "tiny", "--budgets", "0.9",
                                      "--strategies", "keep"]])
def test_time_limit_reaches_the_planner(capsys, monkeypatch, command):
    from karma_fx.api import Prepared

    limits = []
    original = Prepared.plan

    def recording(self, *args, **kwargs):
        limits.append(kwargs.get("time_limit_s"))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Prepared, "plan", recording)
    code, _, err = _run(capsys, *command, "--time-limit", "1.5", "--quiet")
    assert code == 0, err
    assert limits == [1.5]


def test_quiet_prints_only_the_result(capsys, monkeypatch, tmp_path):
    from karma_fx import progress

    monkeypatch.setenv("KARMA_PROGRESS", "1")  # would show progress, were it not for -q
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    code, out, err = _run(capsys, "plan", "cnn", "--size", "tiny", "-q", "--time-limit", "2", "--max-rows", "0",
                          "--json", str(tmp_path / "p.json"))
    assert code == 0 and err == ""
    assert out.startswith("cnn (tiny) on ") and "strategy " in out
    assert "planning took" not in out and "wrote" not in out and (tmp_path / "p.json").exists()


def test_verbose_logs_the_stages_and_very_verbose_the_debug_records(capsys):
    import logging

    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "-v", "--time-limit", "2", "--max-rows", "0")
    assert code == 0, err
    assert "karma-fx: planning cnn-tiny: capture" in err and "heuristics, strategy" in err
    assert "DEBUG" not in err
    code, _, err = _run(capsys, "plan", "cnn", "--size", "tiny", "-vv", "--time-limit", "2", "--max-rows", "0")
    assert code == 0, err
    assert "karma-fx: DEBUG karma_fx" in err and "karma-fx: INFO karma_fx" in err
    logger = logging.getLogger("karma_fx")  # undone after main: the process's logging is as it was
    assert logger.level == logging.NOTSET and all(type(h) is logging.NullHandler for h in logger.handlers)
    code, _, err = _run(capsys, "plan", "cnn", "-q", "-v")
    assert code == 2 and "not allowed with argument" in err


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.3, 0.8])
def test_ctrl_c_any_time_after_start_prints_one_line_and_exits_130(delay_s):
    """Ctrl-C from the first moments on, while Python still imports torch and the rest, as the console script
    runs them (``from karma_fx.cli import main; sys.exit(main())``): one line, status 130, no traceback."""
    import signal
    import time

    script = "import sys; from karma_fx.cli import main; sys.exit(main())"
    argv = ["plan", "cnn", "--size", "tiny", "--budget", "0.95"]
    # as from a terminal: Ctrl-C not ignored (a test run started in the background inherits SIG_IGN)
    proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "KARMA_PROGRESS": "0"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(delay_s)
        assert proc.poll() is None, "finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip() and "USDT" not in line] == ["karma-fx: interrupted"]


def test_progress_line_keeps_ticking_through_a_long_silent_stage(monkeypatch):
    """A solve that reports nothing for a minute still redraws the tqdm line (its elapsed time counts on),
    and the ticking thread ends with the planning."""
    import threading
    import time

    from karma_fx import progress

    class Bar:
        def __init__(self) -> None:
            self.redraws, self.text = 0, ""

        def set_description_str(self, text: str, refresh: bool = True) -> None:
            self.text = text

        def refresh(self) -> None:
            self.redraws += 1

        def close(self) -> None:
            pass

    bars: list[Bar] = []
    monkeypatch.setattr(progress, "_new_bar", lambda: bars.append(Bar()) or bars[-1])
    monkeypatch.setattr(progress, "TICK_S", 0.02)
    with progress.planning("resnet50", enabled=True, show_after_s=0.0):
        progress.report("solver, exact pass", strategy="cpsat")
        time.sleep(0.5)  # no report: the solver is busy
    assert bars and bars[0].text == "planning resnet50: solver, exact pass, strategy cpsat"
    assert bars[0].redraws >= 2
    time.sleep(0.1)
    assert not any(t.name == "karma-progress" for t in threading.enumerate())
