"""Measure a step's kernel scratch in another process, where a torch.profiler session of the caller's runs in this one.

A step's scratch (what its kernels allocate beyond the tensors it holds: a convolution's reordered weights,
softmax's row buffers) is read off the allocator's events, which a CPU reports only to a torch.profiler
session. Sessions do not nest: a second one in the same process empties the first, and one started on
another thread crashed the process (torch 2.13). So a step first compiled while its caller profiles it
could only plan with the tensors it holds, and a small CNN trained at 0.7 of its peak, profiled every step,
peaked 36% over its budget, every step (2.875 MiB against 2.111).

Here the step, written as a tape (``passes.op_tape``), is run in a fresh Python process with a profiler of
its own, on tensors laid out as the step's: the values of floating-point tensors are random (a kernel's
scratch and time depend on shapes, strides, dtypes and the thread count, not on the numbers), the others
(labels, indices, masks) are copied. Its ops are timed there too, after that warm run: in this process they
would carry the caller's profiler's overhead (a first, cold run's times were 2-10 times a convolution's). The
child imports torch, karma_fx and the modules that register ops (``OP_MODULES``), never the caller's
``__main__`` (as ``multiprocessing``'s spawn would, running a training script again) nor a module of the
caller's working directory.

Only on a CPU: a GPU's step would need a second CUDA context beside one that is out of memory already.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from karma_fx.measure_run import ProfilerBusy
from karma_fx.passes.op_tape import OpName, OpTape, op_name, portable, resolved

Scratch = tuple[dict[str, int], dict[str, tuple[tuple[int, int, float], ...]]]

OP_MODULES = ("karma_fx.dropout_ops", "karma_fx.loss_ops", "karma_fx.runtime", "torch._inductor.inductor_prims")
"""Modules whose import registers ops a captured step may hold (karma's own; Inductor's ``prims.fma``,
``inductor_random``, ``_low_memory_max_pool_*``): the child imports those the caller has imported. An op a
caller's own module registers is not found there, and the measuring falls back (``ProfilerBusy``)."""

_BOOTSTRAP = """import sys
root, given, taken, expected = sys.argv[1:5]
try:
    import karma_fx
except ImportError:
    sys.path.append(root)
    import karma_fx
from karma_fx.measure_apart import _child
_child(given, taken, expected)
"""
"""The child's first lines, run with ``-c`` in an empty folder: no module of the caller's working directory
shadows karma_fx, and the caller's ``__main__`` is never run again (as ``multiprocessing``'s spawn would)."""


def scratch_apart(tape: OpTape, primals: list[Any], pieces: bool = True,
                  instead: dict[Any, Callable] | None = None) -> Scratch:
    """``passes.measure.scratch_and_split_costs`` of ``tape`` on tensors laid out as ``primals``, measured in a
    child process; ``ProfilerBusy`` (saying why) where the child could not measure it."""
    scratch, split, _ = measured_apart(tape, primals, pieces=pieces, instead=instead)
    return scratch, split


def measured_apart(tape: OpTape, primals: list[Any], *, pieces: bool = True,
                   instead: dict[Any, Callable] | None = None, repeats: int = 0
                   ) -> tuple[dict[str, int], dict[str, tuple[tuple[int, int, float], ...]], dict[str, float]]:
    """Scratch, split costs and (``repeats`` > 0) each op's median wall time of ``tape``, measured in a child
    process (``passes.measure.tape_scratch_and_split_costs``, then ``tape_times`` after that warm run): times
    taken there carry no profiler's per-op overhead; ``ProfilerBusy`` (saying why) where the child could not
    measure them."""
    try:
        return _measured_apart(tape, primals, pieces, instead, repeats)
    except ProfilerBusy:
        raise
    except Exception as e:  # noqa: BLE001 - an interpreter that cannot start, an op that cannot be named...
        raise ProfilerBusy(f"a torch.profiler session is already running, and the step could not be measured in "
                           f"another process ({type(e).__name__}: {e})") from e


def _measured_apart(tape: OpTape, primals: list[Any], pieces: bool, instead: dict[Any, Callable] | None,
                    repeats: int) -> Any:
    payload = {
        "tape": portable(tape),
        "primals": [_described(t) for t in primals],
        "pieces": pieces,
        "instead": {op_name(k): op_name(v) for k, v in (instead or {}).items()},
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "modules": [m for m in OP_MODULES if m in sys.modules],
    }
    package = Path(__file__).resolve().parent  # this karma_fx, which the child must import
    with tempfile.TemporaryDirectory(prefix="karma_fx_measure_") as folder:
        given, taken = Path(folder) / "step.pickle", Path(folder) / "measured.pickle"
        given.write_bytes(pickle.dumps(payload))
        done = subprocess.run([sys.executable, "-c", _BOOTSTRAP, str(package.parent), str(given), str(taken),
                               str(package)],
                              cwd=folder, env=dict(os.environ), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        if done.returncode != 0 or not taken.exists():
            last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise ProfilerBusy("a torch.profiler session is already running, and measuring the step in another "
                               f"process failed: {last[0]}")
        kind, value = pickle.loads(taken.read_bytes())
    if kind != "ok":
        raise ProfilerBusy(f"a torch.profiler session is already running, and measuring the step in another "
                           f"process failed: {value}")
    return value


def _described(value: Any) -> Any:
    """What the child needs of one primal: a floating-point tensor's layout (``_Layout``), any other tensor
    itself (detached, so that it pickles by value), anything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            return _Layout(tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)
        return value.detach()
    return value


class _Layout:
    """A floating-point tensor's shape, strides, offset and dtype: made again, random, in the child."""

    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...], offset: int, dtype: torch.dtype) -> None:
        self.shape, self.stride, self.offset, self.dtype = shape, stride, offset, dtype

    def made(self) -> torch.Tensor:
        extent = self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        if any(n == 0 for n in self.shape):
            extent = self.offset
        flat = torch.randn(extent, dtype=self.dtype) if extent else torch.empty(0, dtype=self.dtype)
        return flat.as_strided(self.shape, self.stride, self.offset)


def _op(target: Any) -> Any:
    return target.resolve() if isinstance(target, OpName) else target


def _child(given: str, taken: str, expected: str) -> None:
    """The child process: measure the tape in ``given`` and write ``("ok", (scratch, split, times))`` or
    ``("error", why)`` to ``taken``; ``expected``: the caller's karma_fx folder, which must be this one."""
    import importlib

    try:
        here = Path(__file__).resolve().parent
        if here != Path(expected):
            raise ImportError(f"another karma_fx ({here}) than the caller's ({expected})")
        from karma_fx.passes.measure import tape_scratch_and_split_costs, tape_times

        payload = pickle.loads(Path(given).read_bytes())
        for module in payload["modules"]:
            importlib.import_module(module)
        torch.set_num_threads(payload["threads"])
        torch.manual_seed(0)
        primals = [p.made() if isinstance(p, _Layout) else p for p in payload["primals"]]
        instead = {_op(k): _op(v) for k, v in payload["instead"].items()}
        tape = resolved(payload["tape"])
        scratch, split = tape_scratch_and_split_costs(tape, primals, pieces=payload["pieces"], instead=instead)
        times = tape_times(tape, primals, payload["repeats"], warm_up=False) if payload["repeats"] else {}
        result: Any = ("ok", (scratch, split, times))
    except Exception as e:  # noqa: BLE001 - whatever it was, the parent falls back and says so
        result = ("error", f"{type(e).__name__}: {e}")
    Path(taken).write_bytes(pickle.dumps(result))
