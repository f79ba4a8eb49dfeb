"""Measure a step's kernel scratch in another process, where a torch.profiler session of the caller's runs in this one.

A step's scratch (what its kernels allocate beyond the tensors it holds: a convolution's reordered weights,
softmax's row buffers) is read off the allocator's events, which a CPU reports only to a torch.profiler
session. Sessions do not nest: a second one in the same process empties the first, and one started on
another thread crashed the process (torch 2.13). So a step first compiled while its caller profiles it
could only plan with the tensors it holds, and a small CNN trained at 0.7 of its peak, profiled every step,
peaked 36% over its budget, every step (2.875 MiB against 2.111).

Here the step, written as a tape (``passes.op_tape``), is run in a fresh Python process with a profiler of
its own, on tensors laid out as the step's: the values of floating-point tensors are random (a kernel's
scratch depends on shapes, strides, dtypes and the thread count, not on the numbers), the others (labels,
indices, masks) are copied. The child imports torch and karma_fx, never the caller's ``__main__`` (as
``multiprocessing``'s spawn would, running a training script again), and no module of the caller's.

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


def scratch_apart(tape: OpTape, primals: list[Any], pieces: bool = True,
                  instead: dict[Any, Callable] | None = None, timeout_s: float | None = None) -> Scratch:
    """``passes.measure.scratch_and_split_costs`` of ``tape`` on tensors laid out as ``primals``, measured in a
    child process; ``ProfilerBusy`` (saying why) where the child could not measure it."""
    payload = {
        "tape": portable(tape),
        "primals": [_described(t) for t in primals],
        "pieces": pieces,
        "instead": {op_name(k): op_name(v) for k, v in (instead or {}).items()},
        "threads": torch.get_num_threads(),
    }
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="karma_fx_measure_") as folder:
        given, taken = Path(folder) / "step.pickle", Path(folder) / "scratch.pickle"
        try:
            given.write_bytes(pickle.dumps(payload))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ProfilerBusy(f"a torch.profiler session is already running, and the step cannot be written "
                               f"out to be measured in another process ({e})") from None
        done = subprocess.run([sys.executable, "-m", "karma_fx.measure_apart", str(given), str(taken)],
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=timeout_s, check=False)
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


def _child(given: Path, taken: Path) -> None:
    """The child process: measure the tape in ``given`` and write ``("ok", scratch)`` or ``("error", why)``."""
    try:
        from karma_fx.passes.measure import tape_scratch_and_split_costs

        payload = pickle.loads(given.read_bytes())
        torch.set_num_threads(payload["threads"])
        torch.manual_seed(0)
        primals = [p.made() if isinstance(p, _Layout) else p for p in payload["primals"]]
        instead = {_op(k): _op(v) for k, v in payload["instead"].items()}
        result: Any = ("ok", tape_scratch_and_split_costs(resolved(payload["tape"]), primals,
                                                          pieces=payload["pieces"], instead=instead))
    except Exception as e:  # noqa: BLE001 - whatever it was, the parent falls back and says so
        result = ("error", f"{type(e).__name__}: {e}")
    taken.write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    # the module's own name, not ``__main__``: ``_Layout`` is unpickled as ``karma_fx.measure_apart._Layout``
    from karma_fx.measure_apart import _child as child

    child(Path(sys.argv[1]), Path(sys.argv[2]))
