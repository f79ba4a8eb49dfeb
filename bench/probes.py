"""User-facing probes: how karma_fx answers 26 small requests, classified, one checkout per column.

Each probe is a short snippet run in its own ``python -c`` subprocess (timeout 180 s, ``KARMA_PROGRESS=0``)
with the checkout first on ``PYTHONPATH`` and a temporary directory as cwd, so the editable install in the
virtualenv is not picked up instead (every snippet asserts ``karma_fx.__file__`` lies under the root). A
snippet ends with one line ``RESULT: correct`` / ``RESULT: silent-wrong`` (it ran, but differs from eager
PyTorch or the stated expectation) / ``RESULT: typed`` (it raised a ``karma_fx.KarmaError`` subclass or
``ExchangeError``); anything else (a non-KarmaError traceback, a nonzero exit without a RESULT line) is
``raw-traceback``, and running past the timeout is ``timeout``. The "wanted" column is the good outcome:
``correct``, or ``typed`` where refusing is the right answer (an ambiguous budget, a malformed plan file).

The before/after table (the old checkout in a throwaway worktree; it does not touch this checkout's files):

    git worktree add /tmp/before f9c165b
    python bench/probes.py --root /tmp/before --root .
    git worktree remove /tmp/before --force

    python bench/probes.py --root . --only 1,2,7,22      # some probes, one checkout

Probes run one at a time (a thread pool of 1) to keep a shared machine usable; the 26 take a few minutes.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tabulate import tabulate

CLASSES = ("correct", "silent-wrong", "typed", "raw-traceback", "timeout")
TIMEOUT_S = 180
DETAIL_CHARS = 60

PREAMBLE = r'''
import copy, functools, gc, json, os, sys, tempfile, warnings, weakref
warnings.filterwarnings("ignore")
ROOT = os.path.realpath(os.environ["PROBE_ROOT"])
import karma_fx
assert os.path.realpath(karma_fx.__file__).startswith(ROOT + os.sep), f"karma_fx from {karma_fx.__file__}, not {ROOT}"
import torch
from torch import nn
from karma_fx import KarmaError
try:
    from karma_fx.exchange import ExchangeError
except ImportError:
    class ExchangeError(Exception):
        pass


class Wrong(Exception):
    """It ran, but the result is not what eager PyTorch (or the stated expectation) gives."""


def check(ok, detail):
    if not ok:
        raise Wrong(detail)


def maxdiff(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def same(a, b, what, rtol=1e-5, atol=1e-6):
    check(a is not None, f"{what} is None")
    check(b is not None, f"{what}: the reference's is None")
    check(a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs eager {tuple(b.shape)}")
    check(torch.allclose(a.detach(), b.detach(), rtol=rtol, atol=atol),
          f"{what} differs: max |diff| {maxdiff(a, b):.3g}")


def same_grads(m, ref, rtol=1e-5, atol=1e-6):
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        if q.grad is None and p.grad is None:
            continue
        same(p.grad, q.grad, f"grad of {name}", rtol, atol)


def same_params(m, ref, rtol=1e-5, atol=1e-6):
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        same(p, q, f"parameter {name}", rtol, atol)


def wait_host_updates(step):
    """The old API applied host-optimizer updates asynchronously; the next forward waited for them."""
    try:
        pipe = step.__dict__.get("pipeline") or step._modules.get("pipeline")
    except Exception:
        pipe = None
    if pipe is not None and hasattr(pipe, "wait_updates"):
        pipe.wait_updates()


class Net(nn.Module):  # probes 1-2: Linear + BatchNorm1d + Dropout(0.5)
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.bn(self.lin(x)))))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.lin1(x)))


def first_line(exc):
    text = str(exc).strip()
    return type(exc).__name__ + (": " + text.splitlines()[0] if text else "")


def base_plan_dict():
    """A valid saved plan, as JSON read back from ``Plan.save``."""
    plan = karma_fx.plan(nn.Linear(4, 4), (torch.randn(2, 4),), budget=1.0)
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    plan.save(path)
    with open(path) as f:
        return json.load(f)


def load_edited(data):
    path = os.path.join(tempfile.mkdtemp(), "edited.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return karma_fx.Plan.load(path)
'''

EPILOGUE = r'''
try:
    outcome = probe()
except Wrong as exc:
    print("DETAIL:", exc)
    print("RESULT: silent-wrong", flush=True)
except (KarmaError, ExchangeError) as exc:
    print("DETAIL:", first_line(exc))
    print("RESULT: typed", flush=True)
else:
    if outcome is not None:  # (class, detail) from probes that classify an outcome themselves
        print("DETAIL:", outcome[1])
    print("RESULT:", "correct" if outcome is None else outcome[0], flush=True)
'''


@dataclass(frozen=True)
class Probe:
    number: int
    what: str
    wanted: str
    body: str


PROBES: list[Probe] = []


def probe(number: int, what: str, wanted: str):
    def register(body: str) -> str:
        PROBES.append(Probe(number, what, wanted, textwrap.dedent(body)))
        return body
    return register


probe(1, "m.eval() after a training step", "correct")("""
def probe():
    torch.manual_seed(0)
    m = Net(); ref = copy.deepcopy(m); x = torch.randn(32, 8)
    s = karma_fx.compile(m, budget=1.0, strategy="keep")
    torch.manual_seed(1); s(x).sum().backward()
    torch.manual_seed(1); ref(x).sum().backward()
    m.eval(); ref.eval()
    out = s(x); expected = ref(x)
    same(m.bn.running_mean, ref.bn.running_mean, "bn.running_mean")
    same(out, expected, "eval output")
""")

probe(2, "m.train() again after eval", "correct")("""
def probe():
    torch.manual_seed(0)
    m = Net(); ref = copy.deepcopy(m); x = torch.randn(32, 8)
    s = karma_fx.compile(m, budget=1.0, strategy="keep")
    torch.manual_seed(1); s(x).sum().backward()
    torch.manual_seed(1); ref(x).sum().backward()
    m.eval(); ref.eval()
    s(x); ref(x)
    m.train(); ref.train()
    m.zero_grad(set_to_none=True); ref.zero_grad(set_to_none=True)
    torch.manual_seed(2); out = s(x); out.sum().backward()
    torch.manual_seed(2); expected = ref(x); expected.sum().backward()
    same(out, expected, "train output")
    same_grads(m, ref)
    same(m.bn.running_mean, ref.bn.running_mean, "bn.running_mean")
""")

probe(3, "freeze a Linear, unfreeze after 1st call", "correct")("""
def probe():
    torch.manual_seed(0)
    m = MLP(); ref = copy.deepcopy(m); x = torch.randn(16, 8)
    m.lin1.requires_grad_(False); ref.lin1.requires_grad_(False)
    # A roomy byte budget: a fraction would be resolved on the frozen step, whose peak is smaller than the
    # unfrozen one's, so budget=1.0 is infeasible after unfreezing by design; this probe is about the guards.
    s = karma_fx.compile(m, budget="1MiB")
    s(x).sum().backward(); ref(x).sum().backward()
    m.lin1.requires_grad_(True); ref.lin1.requires_grad_(True)
    s(x).sum().backward(); ref(x).sum().backward()
    check(m.lin1.weight.grad is not None, "lin1.weight.grad is None after unfreezing")
    same(m.lin1.weight.grad, ref.lin1.weight.grad, "lin1.weight.grad")
    same_grads(m, ref)
""")

probe(4, "m.head = nn.Linear(...) after 1st call", "correct")("""
def probe():
    torch.manual_seed(0)
    m = MLP(); ref = copy.deepcopy(m); x = torch.randn(16, 8)
    s = karma_fx.compile(m, budget=1.0)
    s(x).sum().backward(); ref(x).sum().backward()
    m.zero_grad(); ref.zero_grad()
    torch.manual_seed(5); m.head = nn.Linear(16, 4)
    torch.manual_seed(5); ref.head = nn.Linear(16, 4)
    out = s(x); expected = ref(x)
    same(out, expected, "output after the swap")
    out.sum().backward(); expected.sum().backward()
    same(m.head.weight.grad, ref.head.weight.grad, "new head.weight.grad")
""")

probe(5, "new nn.Parameter assigned after 1st call", "correct")("""
def probe():
    torch.manual_seed(0)
    m = MLP(); ref = copy.deepcopy(m); x = torch.randn(16, 8)
    s = karma_fx.compile(m, budget=1.0)
    s(x).sum().backward(); ref(x).sum().backward()
    m.zero_grad(); ref.zero_grad()
    w = torch.randn(4, 16)
    m.head.weight = nn.Parameter(w.clone()); ref.head.weight = nn.Parameter(w.clone())
    out = s(x); expected = ref(x)
    same(out, expected, "output with the new parameter")
    out.sum().backward(); expected.sum().backward()
    same(m.head.weight.grad, ref.head.weight.grad, "new head.weight.grad")
""")

probe(6, "buffer reassigned in forward (EMA)", "correct")("""
class Ema(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = self.lin(x)
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return h


def probe():
    torch.manual_seed(0)
    m = Ema(); ref = copy.deepcopy(m)
    s = karma_fx.compile(m, budget=1.0)
    for i in range(2):
        x = torch.randn(16, 8)
        m.zero_grad(); ref.zero_grad()
        s(x).sum().backward(); ref(x).sum().backward()
    same(m.ema, ref.ema, "ema after 2 calls")
    same_grads(m, ref)
""")

probe(7, "grad accumulation, host optimizer (SGD)", "correct")("""
def probe():
    torch.manual_seed(0)
    m = MLP(); ref = copy.deepcopy(m); x1, x2 = torch.randn(16, 8), torch.randn(16, 8)
    # A roomy byte budget: the accumulating step holds the first pass's gradients, which the first step's
    # unplanned peak (what budget=1.0 means) does not; this probe is about the update, not the budget.
    s = karma_fx.compile(m, budget="1MiB", optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    has_no_sync = hasattr(type(s), "no_sync")
    if has_no_sync:
        with s.no_sync():
            s(x1).sum().backward()
    else:
        s(x1).sum().backward()
    wait_host_updates(s)
    s(x2).sum().backward()
    wait_host_updates(s)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x1).sum().backward(); ref(x2).sum().backward(); opt.step()
    try:
        same_params(m, ref)
    except Wrong as exc:
        raise Wrong(("" if has_no_sync else "no no_sync(); ") + str(exc))
""")

probe(8, "compile(budget=1.5)", "typed")("""
def probe():
    torch.manual_seed(0)
    s = karma_fx.compile(MLP(), budget=1.5)
    s(torch.randn(16, 8)).sum().backward()
    raise Wrong(f"budget 1.5 accepted: planned budget_bytes={s.plan.budget_bytes}")
""")

probe(9, "compile(budget=2)", "typed")("""
def probe():
    torch.manual_seed(0)
    s = karma_fx.compile(MLP(), budget=2)
    s(torch.randn(16, 8)).sum().backward()
    raise Wrong(f"budget 2 accepted: planned budget_bytes={s.plan.budget_bytes}")
""")

probe(10, 'torch.compile budget "0.9" == 0.9', "correct")("""
def probe():
    from karma_fx.backend import regions

    def planned(options):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
        step = torch.compile(m, backend="karma", options=options, dynamic=False)
        step(torch.randn(512, 64)).sum().backward()
        return regions(options)[0].plan.budget_bytes

    as_string = planned({"budget": "0.9"})
    as_number = planned({"budget": 0.9})
    check(as_string == as_number, f'budget "0.9" planned {as_string} bytes, 0.9 planned {as_number}')
""")

probe(11, "budget=0.9 kept in bytes for a new shape", "correct")("""
def probe():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    s = karma_fx.compile(m, budget=0.9)
    s(torch.randn(2048, 64)).sum().backward()
    first = s.plan.budget_bytes
    m.zero_grad(set_to_none=True)  # as a training loop does: gradients kept from the last step take room too
    s(torch.randn(3, 64)).sum().backward()
    second = s.plan.budget_bytes
    check(first == second, f"batch 2048 planned under {first} bytes, batch 3 under {second}")
""")

probe(12, "nn.LSTM(16, 32)", "correct")("""
def probe():
    torch.manual_seed(0)
    m = nn.LSTM(16, 32); ref = copy.deepcopy(m); x = torch.randn(5, 3, 16)
    s = karma_fx.compile(m, budget=1.0)
    out = s(x); out[0].sum().backward()
    expected = ref(x); expected[0].sum().backward()
    same(out[0], expected[0], "output")
    same_grads(m, ref)
""")

probe(13, "model returning a detached output", "correct")("""
class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x).detach()


def probe():
    torch.manual_seed(0)
    m = Detached(); x = torch.randn(16, 8)
    out = karma_fx.compile(m, budget=1.0)(x)
    same(out, m(x), "output")
""")

probe(14, "plan(strategy=123)", "typed")("""
def probe():
    p = karma_fx.plan(nn.Linear(4, 4), (torch.randn(2, 4),), budget=0.5, strategy=123)
    raise Wrong(f"strategy=123 accepted: plan.strategy={p.strategy!r}")
""")

probe(15, "plan(kwargs=[1]) (a list)", "typed")("""
def probe():
    p = karma_fx.plan(nn.Linear(4, 4), (torch.randn(2, 4),), [1], budget=0.5)
    raise Wrong(f"kwargs=[1] accepted: planned {p.strategy!r}")
""")

probe(16, "compiled meta-device model called", "typed")("""
def probe():
    m = nn.Linear(4, 4, device="meta")
    out = karma_fx.compile(m, budget=0.5)(torch.randn(2, 4, device="meta"))
    raise Wrong(f"ran on meta: returned {type(out).__name__} on {getattr(out, 'device', None)}")
""")

probe(17, r'Plan.load of bytes b"\xff\xfe\x00"', "typed")(r"""
def probe():
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    with open(path, "wb") as f:
        f.write(b"\xff\xfe\x00")
    p = karma_fx.Plan.load(path)
    raise Wrong(f"loaded: {p!r:.50}")
""")

probe(18, 'Plan.load of "[" * 100000', "typed")("""
def probe():
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    with open(path, "w") as f:
        f.write("[" * 100000)
    p = karma_fx.Plan.load(path)
    raise Wrong(f"loaded: {p!r:.50}")
""")

probe(19, 'Plan.load: "peak_bytes": "abc"', "typed")("""
def probe():
    data = base_plan_dict()
    data["peak_bytes"] = "abc"
    p = load_edited(data)
    raise Wrong(f"loaded with peak_bytes={p.peak_bytes!r}")
""")

probe(20, 'Plan.load: "notes": "abc"', "typed")("""
def probe():
    data = base_plan_dict()
    data["notes"] = "abc"
    p = load_edited(data)
    raise Wrong(f"loaded with notes={p.notes!r}")
""")

probe(21, "Plan.load: the same Offload twice", "typed")("""
def probe():
    data = base_plan_dict()
    offload = {"kind": "offload", "tensor": "relu", "offload_after": "relu", "free_after": "relu",
               "prefetch_at": "threshold_backward", "reload_before": "threshold_backward"}
    data["decisions"] = [offload, dict(offload)]
    p = load_edited(data)
    raise Wrong(f"loaded with {len(p.decisions)} decisions for one tensor")
""")

probe(22, "CLI plan --plot /tmp/x.xyz", "typed")("""
def probe():
    import subprocess
    target = os.path.join(tempfile.mkdtemp(), "x.xyz")
    r = subprocess.run([sys.executable, "-m", "karma_fx", "plan", "mlp", "--size", "tiny", "--budget", "0.9",
                        "--plot", target], capture_output=True, text=True, timeout=170)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "(no stderr)"
    if "Traceback" in r.stderr:
        raise RuntimeError(f"the CLI printed a traceback, exit {r.returncode}: {last}")
    if r.returncode == 0:
        raise Wrong("exit 0, " + ("wrote " + target if os.path.exists(target) else "created nothing"))
    if r.returncode != 2:
        raise RuntimeError(f"exit {r.returncode}: {last}")
    return "typed", (f"exit 2, {len(lines)} lines: " if len(lines) != 1 else "exit 2: ") + last
""")

T5 = """
from transformers import T5Config, T5ForConditionalGeneration
from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_error()


def t5_and_batch():
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=2,
                                                d_kv=16, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(1, 100, (2, 8)); labels = torch.randint(1, 100, (2, 8))
    return model, copy.deepcopy(model), ids, labels


def compare_hf(step, model, ref, **batch):
    torch.manual_seed(1); loss = step(**batch).loss; loss.backward()
    torch.manual_seed(1); expected = ref(**batch).loss; expected.backward()
    same(loss, expected, "loss", rtol=1e-4, atol=1e-6)
    same_grads(model, ref, rtol=1e-4, atol=1e-6)
"""

probe(23, "HF T5 under karma_fx.compile", "correct")(T5 + """

def probe():
    model, ref, ids, labels = t5_and_batch()
    compare_hf(karma_fx.compile(model, budget=1.0), model, ref, input_ids=ids, labels=labels)
""")

probe(24, "HF T5 under torch.compile(backend=karma)", "correct")(T5 + """

def probe():
    model, ref, ids, labels = t5_and_batch()
    step = torch.compile(model, backend="karma", options={"budget": 1.0}, dynamic=False)
    compare_hf(step, model, ref, input_ids=ids, labels=labels)
""")

probe(25, "HF BART under karma_fx.compile", "correct")(T5 + """

def probe():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0))
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 100, (2, 8)); labels = torch.randint(3, 100, (2, 8))
    compare_hf(karma_fx.compile(model, budget=1.0), model, ref, input_ids=ids, labels=labels)
""")

probe(26, "no leak after del (host SGD momentum)", "correct")("""
def probe():
    torch.manual_seed(0)
    m = MLP()
    weight = weakref.ref(m.lin1.weight)
    s = karma_fx.compile(m, budget=1.0, optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    s(torch.randn(16, 8)).sum().backward()
    wait_host_updates(s)
    del m, s
    torch._dynamo.reset()
    gc.collect()
    alive = weight()
    if alive is not None:
        holders = sorted({type(r).__name__ for r in gc.get_referrers(alive)} - {"frame"})
        raise Wrong(f"parameter still alive, held by {', '.join(holders) or '?'}")
""")


# ---- the harness ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    cls: str
    detail: str = ""


def script(p: Probe) -> str:
    return PREAMBLE + "\n" + p.body + "\n" + EPILOGUE


def exception_line(stderr: str) -> str:
    """The ``Type: message`` line of the last traceback in ``stderr`` (its first line)."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    for line in lines[starts[-1] + 1 if starts else 0:]:
        if line.strip() and not line[0].isspace():
            return line.strip()
    rest = [line for line in lines if line.strip()]
    return rest[-1].strip() if rest else ""


def run_probe(p: Probe, root: str, timeout_s: float) -> Outcome:
    root = os.path.realpath(root)
    path = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, KARMA_PROGRESS="0", PROBE_ROOT=root, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(path))
    with tempfile.TemporaryDirectory(prefix="karma-probe-") as cwd:
        try:
            r = subprocess.run([sys.executable, "-c", script(p)], cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome("timeout", f"over {timeout_s:g} s")
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    detail = next((line[len("DETAIL:"):].strip() for line in reversed(lines) if line.startswith("DETAIL:")), "")
    if r.returncode == 0 and lines and lines[-1].startswith("RESULT: "):
        cls = lines[-1][len("RESULT: "):].strip()
        if cls in ("correct", "silent-wrong", "typed"):
            return Outcome(cls, detail)
    return Outcome("raw-traceback", exception_line(r.stderr) or f"exit {r.returncode}, no RESULT line")


def cell(o: Outcome, wanted: str) -> str:
    mark = "" if o.cls == wanted else " (!)"
    if o.cls == "correct" or not o.detail:
        return o.cls + mark
    detail = re.sub(r"/tmp/[^/\s]+/", "", o.detail)  # a temporary folder says nothing
    detail = detail if len(detail) <= DETAIL_CHARS else detail[:DETAIL_CHARS - 1] + "…"
    return f"{o.cls}{mark}\n{detail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", action="append", required=True, help="a karma_fx checkout (repeat for columns)")
    ap.add_argument("--only", help="comma-separated probe numbers, e.g. 1,2,22")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per probe (default %(default)s)")
    args = ap.parse_args(argv)
    for root in args.root:
        if not os.path.isfile(os.path.join(root, "karma_fx", "__init__.py")):
            ap.error(f"{root} is not a karma_fx checkout (no karma_fx/__init__.py)")
    probes = PROBES
    if args.only:
        wanted = {int(n) for n in args.only.split(",") if n.strip()}
        unknown = wanted - {p.number for p in PROBES}
        if unknown:
            ap.error(f"no probe numbered {sorted(unknown)}; there are 1..{len(PROBES)}")
        probes = [p for p in PROBES if p.number in wanted]

    jobs = [(p, root) for p in probes for root in args.root]
    results: dict[tuple[int, str], Outcome] = {}
    with ThreadPoolExecutor(max_workers=1) as pool:  # one at a time: the machine stays usable
        futures = {pool.submit(run_probe, p, root, args.timeout): (p, root) for p, root in jobs}
        for future, (p, root) in futures.items():
            results[p.number, root] = outcome = future.result()
            print(f"probe {p.number:2d} {root}: {outcome.cls} {outcome.detail[:80]}", file=sys.stderr, flush=True)

    rows = [[p.number, p.what, p.wanted] + [cell(results[p.number, root], p.wanted) for root in args.root]
            for p in probes]
    print(tabulate(rows, headers=["#", "probe", "wanted"] + args.root, tablefmt="grid"))
    print("(!) = not the wanted outcome\n")
    summary = []
    for cls in CLASSES:
        summary.append([cls] + [sum(results[p.number, root].cls == cls for p in probes) for root in args.root])
    summary.append(["as wanted"] + [sum(results[p.number, root].cls == p.wanted for p in probes)
                                    for root in args.root])
    print(tabulate(summary, headers=["class"] + args.root, tablefmt="simple"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
