"""Data-parallel out-of-core training on CPU (gloo, loopback), launched as users launch it: with torchrun.

N ranks on shards of a batch end with the parameters of one process on the whole batch; a dead rank makes the
others fail with a clear error instead of hanging; the first gradient bucket is exchanged before backward ends.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt_dp.py"
sys.path.insert(0, str(ROOT / "examples"))

import train_gpt_dp  # noqa: E402

from karma_fx.zoo import output_to_loss  # noqa: E402


def torchrun(nproc: int, *args: str, timeout: float = 240, **env_vars: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
           *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_vars)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def single_process_reference(steps: int = 3, lr: float = 0.05) -> dict[str, torch.Tensor]:
    """SGD with momentum: linear in the gradients, so summing shards in another order changes the result only
    at rounding level. (AdamW divides by the gradient's running RMS, which turns rounding noise in gradients
    that are mathematically zero — GPT-2's key biases — into full-size steps; the host AdamW is checked
    exactly against torch.optim.AdamW in test_host_optimizer.py.)"""
    model = train_gpt_dp.build_model("tiny")
    batch = train_gpt_dp.global_batch("tiny", 6)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        output_to_loss(model(**batch)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_on_shards_equal_one_process_on_the_batch(tmp_path, ranks):
    out, trace = tmp_path / "params.pt", tmp_path / "trace.json"
    run = torchrun(ranks, "--optimizer", "sgd", "--lr", "0.05", "--out", str(out), "--trace", str(trace))
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"{ranks} rank(s)" in run.stdout
    got, want = torch.load(out), single_process_reference()
    assert got.keys() == want.keys()
    for name, w in want.items():
        scale = w.abs().max().clamp_min(1e-30)
        assert ((got[name] - w).abs().max() / scale).item() <= 1e-5, name
    # Overlap: the first bucket's all-reduce is issued while backward still runs.
    events = json.loads(trace.read_text())["traceEvents"]
    backward = next(e for e in events if e["name"] == "backward")
    first = min((e for e in events if e["name"].startswith("all-reduce") and "issued" in e["name"]),
                key=lambda e: e["ts"])
    assert first["ts"] < backward["ts"] + backward["dur"]
    assert sum(e["name"].endswith("issued") for e in events) > 1, "several buckets"


def test_ranks_compiled_by_inductor_equal_one_process_on_the_batch(tmp_path):
    """The default compiler: each rank's planned graphs, the gradient hand-overs in the backward included
    (``karma::gradient_ready``), compiled by Inductor (this suite otherwise runs the op-by-op compiler)."""
    out = tmp_path / "params.pt"
    run = torchrun(2, "--optimizer", "sgd", "--lr", "0.05", "--out", str(out), KARMA_COMPILER="inductor",
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_COMPILE_THREADS="1")
    assert run.returncode == 0, run.stderr[-4000:]
    assert "2 rank(s)" in run.stdout
    got, want = torch.load(out), single_process_reference()
    for name, w in want.items():
        scale = w.abs().max().clamp_min(1e-30)
        assert ((got[name] - w).abs().max() / scale).item() <= 1e-5, name


WORKER = textwrap.dedent("""
    import datetime, functools, os, sys, time
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    import karma_fx, train_gpt_dp
    from karma_fx.zoo import output_to_loss
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    model = train_gpt_dp.build_model("tiny")
    batch = {k: v[dist.get_rank()::2] for k, v in train_gpt_dp.global_batch("tiny", 6).items()}
    step = karma_fx.compile(model, budget=1.0, strategy="keep", data_parallel=True, bucket_bytes=8192,
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    output_to_loss(step(**batch)).backward()
    step.pipeline.wait_updates()
    if dist.get_rank() == 1:
        os._exit(3)  # dies before the second step
    output_to_loss(step(**batch)).backward()
    step.pipeline.wait_updates()
    print("rank 0 finished a step without its peer", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(script: str, *args: str) -> tuple[subprocess.Popen, subprocess.Popen, str, str]:
    """Run ``script`` as ranks 0 and 1 of a gloo group on loopback; (rank 0, rank 1, rank 0's stdout, stderr)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(timeout=120)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
    return procs[0], procs[1], out0, err0


def test_a_dead_rank_makes_the_others_fail_clearly_not_hang():
    rank0, rank1, out0, err0 = two_ranks(WORKER, str(ROOT / "examples"))
    assert rank1.returncode == 3
    assert rank0.returncode != 0, out0
    assert "ExchangeError" in err0 and "a rank died" in err0, err0[-3000:]


BROADCAST_WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist
    import karma_fx
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    if dist.get_rank() == 1:
        os._exit(3)  # dies before the initial weight broadcast
    model = torch.nn.Linear(8, 8)
    karma_fx.compile(model, budget=1.0, data_parallel=True)
""")


def test_a_rank_dying_before_the_weight_broadcast_is_a_typed_error():
    rank0, rank1, _, err0 = two_ranks(BROADCAST_WORKER)
    assert rank1.returncode == 3 and rank0.returncode != 0
    assert "ExchangeError" in err0 and "initial broadcast" in err0, err0[-3000:]
