"""The exact planner's knobs, in one frozen value: time, workers, and the sizes above which a phase is skipped."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

from karma_fx.errors import KarmaError

INT32_MAX = 2 ** 31 - 1
"""CP-SAT's ``random_seed`` is a 32-bit integer."""


@dataclass(frozen=True)
class SolverOptions:
    time_limit_s: float = 20.0
    workers: int = 2
    seed: int = 0
    max_candidates: int = 200
    """Above this many candidates the whole-graph CP-SAT models are not built; the best heuristic is returned
    with the LP bound. Measured (bench/compare.py, H100 spec, 0.7 to 0.25): they improved on the heuristics at
    wrn28_10 (63 candidates) and resnet50 (105), never at gpt2 (221) or bert (239), where they cost ~60 s a
    plan for nothing."""
    seconds_per_candidate: float = 0.15
    """The capacity model gets at most this much time per candidate (``time_limit_s`` at most, 2 s at least),
    and the exact pass half as much (``time_limit_s / 4`` at most, 1 s at least):
    a model of a dozen tensors has nothing to gain from 20 s. Measured on the tiny zoo: wrn28_10 (12
    candidates) had its best decisions after 2 s of a 10 s proof; resnet1001 at 0.5 (26) proves its optimum
    in 1.5 s with batches of one task (``model.INTERLEAVE_BATCH``). Below 5 s, the local search
    (``descent.py``) does what the longer proof did: on wrn28_10 at 0.7 it takes the capacity plan from 287
    to 253 µs, the plan a 5 s capacity model led to. It was 0.4 until the models offered segments (more
    choices, so the searches stop proving early): resnet1001 tiny at position 0.25 then took 7.8 s (capacity
    2.8 s, exact pass 2.4 s, `bench/plan_speed.py`), above the 5 s a tiny model may take; at 0.15 it takes
    4.5 s, its plan 5.3% over the bound instead of 3.3%. Graphs of 134 candidates or more keep the full
    ``time_limit_s``."""
    memory_unit_bytes: int | None = None
    """Granularity of the memory constraints, in bytes; candidates smaller than this stay on the device.
    ``None``: relative to the graph's unplanned peak, 2^-17 of it for the unit and 2^-12 for the candidates
    (``model.memory_unit``, ``model.candidate_bytes``), so that a graph in small units is planned as the same
    graph in bytes. It was a fixed 64 KiB: the saved tensors of every tiny zoo model were smaller, and the
    solver left all of them to the heuristics."""
    good_enough_gap: float = 0.01
    """Skip the CP-SAT models when the best heuristic is proven within this fraction of the LP bound, and stop
    the exact model's search once its incumbent is that close to the bound (the LP bound or its own)."""
    capacity_gap_share: float = 0.5
    """The capacity model stops within this share of the good-enough gap (its decisions are re-timed and
    polished by the exact model, which needs a start a little closer than the gap it must reach)."""
    window_size: int = 15
    max_windows: int = 8
    """The rolling-window refinement (``window.py``): at most this many windows of ``window_size``
    candidates are re-solved around the best plan. Smaller windows are solved further within their time:
    on WRN-28-10 (bf16-mixed, H100 preset, 30 s a plan) at 0.35 of its peak, 4 windows of 30 took the plan
    to 1.269x in two and a half rounds, 8 of 15 to 1.236x in three rounds and 24 s (ResNet-50 at 0.25: 1.384x
    and 1.383x; eight other cells from 0.7 to 0.35 of those two, ResNet-200, Llama, GPT-2, GPT-2-48 and
    VGG-16 the same both ways)."""
    max_window_ops: int = 3000
    """No windows on graphs with more ops: each window model times every op (about 10 s a window at 3000
    ops: its local search and its solve). It was 2000 while the window models left out the copies and chains
    around them, and windows never gained on a transformer; with those timed (bf16-mixed, H100, 30 s a plan)
    a window took GPT-2-48 (2810 ops) at 0.35 from 245.95 to 241.78 ms and Llama (2354) at 0.5 from 181.83
    to 181.16 ms. ResNet-1001 (9689 ops) stays without: with 48 layers of GPT-2 (3545 ops) cpsat once took
    182 s."""

    block_seconds_per_candidate: float = 0.4
    """The same for the model of one repeated block (``repeat.py``), solved once for a whole group of blocks,
    which is worth more time per tensor than a tiny graph's whole model."""

    def __post_init__(self) -> None:
        """Refuse a value the planner cannot honour now, naming the field: a negative or infinite time limit
        used to be taken as given, and a solve then ran for as long as its other limits allowed."""
        for name, (low, high, low_open) in _FLOAT_RANGES.items():
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value))
                    or float(value) < low or (low_open and float(value) == low) or float(value) > high):
                bounds = f"above {low:g}" if low_open else f"at least {low:g}"
                bounds += f" and at most {high:g}" if math.isfinite(high) else ""
                raise KarmaError(f"SolverOptions.{name} must be a finite number {bounds}, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name, (low, high) in _INT_RANGES.items():
            value = getattr(self, name)
            if value is None and name in _MAY_BE_NONE:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
                bounds = f"at least {low}" + (f" and at most {high}" if high != math.inf else "")
                raise KarmaError(f"SolverOptions.{name} must be an integer {bounds}, got {value!r}")
            object.__setattr__(self, name, int(value))

    def effort_s(self, n_candidates: int, per_candidate: float | None = None) -> float:
        """The time limit of one whole-graph solve over ``n_candidates`` tensors (``per_candidate`` seconds
        each, default ``seconds_per_candidate``)."""
        per = self.seconds_per_candidate if per_candidate is None else per_candidate
        return min(self.time_limit_s, max(2.0, per * n_candidates))

    def exact_effort_s(self, n_candidates: int) -> float:
        """The time limit of the exact pass, which starts from the capacity model's decisions polished by the
        local search: a quarter of ``time_limit_s`` at most."""
        return min(self.time_limit_s / 4, max(1.0, self.seconds_per_candidate * n_candidates / 2))


_FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    "time_limit_s": (0.0, math.inf, True),
    "seconds_per_candidate": (0.0, math.inf, True),
    "block_seconds_per_candidate": (0.0, math.inf, True),
    "good_enough_gap": (0.0, math.inf, False),
    "capacity_gap_share": (0.0, 1.0, False),
}
"""Number fields: (lowest, highest, whether the lowest itself is refused)."""
_INT_RANGES: dict[str, tuple[int, float]] = {
    "workers": (1, math.inf),
    "seed": (-INT32_MAX - 1, INT32_MAX),
    "max_candidates": (0, math.inf),
    "memory_unit_bytes": (1, math.inf),
    "window_size": (1, math.inf),
    "max_windows": (0, math.inf),
    "max_window_ops": (0, math.inf),
}
"""Integer fields: (lowest, highest)."""
_MAY_BE_NONE = {"memory_unit_bytes"}
assert set(_FLOAT_RANGES) | set(_INT_RANGES) == {f.name for f in fields(SolverOptions)}, \
    "every SolverOptions field needs a range here"
