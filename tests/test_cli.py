"""karma-fx: the commands run in-process on tiny models, user errors are one line with exit status 2 (never a
traceback), and the installed console entry point works."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from karma_fx import Plan
from karma_fx.cli import main
from karma_fx.strategies import STRATEGY_NAMES
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
    for s in STRATEGY_NAMES:
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
