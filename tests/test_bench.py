"""The benchmark scripts run (at tiny size) and print their tables; their numbers are for the closing note."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_overhead_smoke(capsys):
    overhead = load("overhead")
    assert overhead.main(["--models", "mlp", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("eager", "aot_eager (default partitioner)", "torch.compile karma", "karma_fx.compile"):
        assert label in out


def test_gpu_check_dry(capsys):
    gpu_check = load("gpu_check")
    assert gpu_check.main(["--dry", "--models", "gpt2-medium", "--strategies", "checkpoint,karma"]) == 0
    out = capsys.readouterr().out
    for label in ("checkpoint", "karma", "torch activation_memory_budget", "torch save_on_cpu", "CPU (dry)"):
        assert label in out


def test_scaling_smoke(capsys):
    scaling = load("scaling")
    assert scaling.main(["--size", "tiny", "--models", "1.5B", "--gpus", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "efficiency" in out and "all-reduce" in out
