"""Strategies: one small module each, all returning a ``Plan`` through the same ``Strategy`` protocol.

``STRATEGY_NAMES`` lists what ``karma_fx.plan(strategy=...)`` and the CLI accept; a ``Strategy`` object can
be passed instead of a name.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

from karma_fx.strategies.base import Strategy
from karma_fx.strategies.checkpoint import Checkpoint
from karma_fx.strategies.cpsat import CpSat, SolverOptions
from karma_fx.strategies.greedy import Greedy
from karma_fx.strategies.karma import Karma
from karma_fx.strategies.keep import Keep
from karma_fx.strategies.offload import OffloadAll
from karma_fx.strategies.remat import Remat
from karma_fx.strategies.split import SplitKernels
from karma_fx.strategies.torch_budget import SavedSetFn, TorchBudget

STRATEGY_NAMES = ("keep", "checkpoint", "offload", "torch-budget", "karma", "greedy", "remat", "cpsat")
HEURISTICS = ("checkpoint", "offload", "torch-budget", "karma", "greedy")
COMPARED = tuple(s for s in STRATEGY_NAMES if s != "remat")
"""What ``karma-fx compare`` and ``bench/compare.py`` plan by default: not ``remat``, which plans recompute only
(the zoo's graphs have a host link) and searches every idle gap of the step (minutes on ResNet-1001)."""
DEFAULT_STRATEGY = "cpsat"


def check_time_limit(time_limit_s: float | None) -> float | None:
    """``time_limit_s`` as a float, or a ``KarmaError`` naming it when it is not None or a finite number > 0."""
    from karma_fx.errors import KarmaError

    if time_limit_s is None:
        return None
    if (not isinstance(time_limit_s, numbers.Real) or isinstance(time_limit_s, bool)
            or not math.isfinite(time_limit_s) or time_limit_s <= 0):
        raise KarmaError(f"time_limit_s must be a finite number of seconds above 0, got {time_limit_s!r}; "
                         "pass e.g. 30, or None for cpsat's default (KARMA_TIME_LIMIT=none: no limit)")
    return float(time_limit_s)


def make_strategy(name: str, saved_set: SavedSetFn | None = None, *, time_limit_s: float | None = None) -> Strategy:
    """The strategy called ``name``; ``torch-budget`` needs PyTorch's saved-set oracle for the captured graph.

    ``time_limit_s`` bounds the wall-clock time of a call: ``cpsat`` and ``greedy`` stop starting new work at
    it and return the best plan found so far (at least one plan is always made, and such a plan says so in
    its notes). The other strategies make one pass each and take no limit (torch-budget's partitioner cannot
    be cut short), but the value is still validated."""
    limit = check_time_limit(time_limit_s)
    if name == "cpsat":
        from karma_fx.strategies.cpsat.planner import check_time_limit_env

        check_time_limit_env()  # a bad $KARMA_TIME_LIMIT is said now, not deep inside the first plan
    factories: dict[str, Callable[[], Strategy]] = {
        "keep": Keep,
        "checkpoint": Checkpoint,
        "offload": OffloadAll,
        "karma": Karma,
        "greedy": lambda: Greedy(time_limit_s=limit),
        "remat": lambda: Remat(time_limit_s=limit),
    }
    if name == "torch-budget":
        if saved_set is None:
            raise ValueError("torch-budget needs the captured graph (plan through karma_fx.plan)")
        return TorchBudget(saved_set)
    if name == "cpsat":
        # Our heuristics are the exact planner's fallbacks. torch-budget is not among them: PyTorch's
        # partitioner costs 30-100 s per real model (9 fractions), and in bench/compare it fits in 10 cells,
        # each of which greedy or karma wins (e.g. gpt2 at 0.5: 1.318x against 1.073x).
        # The one-pass heuristics first, greedy last: they cost a few simulations each (karma, the most, 5 s on
        # ResNet-1001 at real size) while greedy searches until its orders run out or the deadline passes
        # (30 s there). Under a time limit the heuristics that would start after the deadline are skipped
        # (once one plan fits), so greedy first left karma out where it wins (ResNet-1001 bf16-mixed at 0.25:
        # karma 1.297x, greedy 1.392x).
        # remat last, and only where there is no host link (``Remat.recompute_only``): it is the one strategy
        # that moves tensors other than saved activations (general rematerialization), the only one that
        # plans a graph without a backward at all, and on Checkmate's problem the fastest in some cells
        # (random layered 100 nodes at 0.9: +0.75% against greedy's +0.86%).
        order = [h for h in HEURISTICS if h not in ("greedy", "torch-budget")] + ["greedy"]
        return SplitKernels(CpSat([make_strategy(h) for h in order] + [Remat()], time_limit_s=limit))
    if name not in factories:
        from karma_fx.errors import KarmaError

        raise KarmaError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    return factories[name]()


__all__ = ["STRATEGY_NAMES", "HEURISTICS", "COMPARED", "DEFAULT_STRATEGY", "CpSat", "SolverOptions", "Strategy", "make_strategy",
           "check_time_limit", "Checkpoint", "Greedy", "Karma", "Keep",
           "OffloadAll", "Remat", "TorchBudget"]
