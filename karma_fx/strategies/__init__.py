"""Strategies: one small module each, all returning a ``Plan`` through the same ``Strategy`` protocol.

``STRATEGY_NAMES`` lists what ``karma_fx.plan(strategy=...)`` and the CLI accept; a ``Strategy`` object can
be passed instead of a name.
"""
from __future__ import annotations

from typing import Callable

from karma_fx.strategies.base import Strategy
from karma_fx.strategies.checkpoint import Checkpoint
from karma_fx.strategies.cpsat import CpSat, SolverOptions
from karma_fx.strategies.greedy import Greedy
from karma_fx.strategies.karma import Karma
from karma_fx.strategies.keep import Keep
from karma_fx.strategies.offload import OffloadAll
from karma_fx.strategies.torch_budget import SavedSetFn, TorchBudget

STRATEGY_NAMES = ("keep", "checkpoint", "offload", "torch-budget", "karma", "greedy", "cpsat")
HEURISTICS = ("checkpoint", "offload", "torch-budget", "karma", "greedy")
DEFAULT_STRATEGY = "cpsat"


def make_strategy(name: str, saved_set: SavedSetFn | None = None) -> Strategy:
    """The strategy called ``name``; ``torch-budget`` needs PyTorch's saved-set oracle for the captured graph."""
    factories: dict[str, Callable[[], Strategy]] = {
        "keep": Keep,
        "checkpoint": Checkpoint,
        "offload": OffloadAll,
        "karma": Karma,
        "greedy": Greedy,
    }
    if name == "torch-budget":
        if saved_set is None:
            raise ValueError("torch-budget needs the captured graph (plan through karma_fx.plan)")
        return TorchBudget(saved_set)
    if name == "cpsat":
        # Our heuristics are the exact planner's fallbacks. torch-budget is not among them: PyTorch's
        # partitioner costs 30-100 s per real model (9 fractions), and in bench/compare it fits in 10 cells,
        # each of which greedy or karma wins (e.g. gpt2 at 0.5: 1.318x against 1.073x).
        return CpSat([make_strategy(h) for h in HEURISTICS if h != "torch-budget"])
    if name not in factories:
        from karma_fx.errors import KarmaError

        raise KarmaError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    return factories[name]()


__all__ = ["STRATEGY_NAMES", "HEURISTICS", "DEFAULT_STRATEGY", "CpSat", "SolverOptions", "Strategy", "make_strategy", "Checkpoint", "Greedy", "Karma", "Keep",
           "OffloadAll", "TorchBudget"]
