"""Errors a user can act on. Every public entry point raises one of these instead of a deep trace."""
from __future__ import annotations


class KarmaError(Exception):
    """Base class: something about the input or the request that the user can fix."""


class BudgetError(KarmaError, ValueError):
    """The budget is not a positive size in bytes or a fraction in (0, 1]."""


class InfeasibleBudgetError(KarmaError):
    """No plan of the requested strategy fits the budget; ``min_budget_bytes`` is the smallest that would."""

    def __init__(self, message: str, *, min_budget_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.budget_bytes = budget_bytes


class UnsupportedModelError(KarmaError):
    """The model's training step could not be captured (dynamic shapes, data-dependent control flow, …)."""


class PlanFormatError(KarmaError, ValueError):
    """A saved plan could not be read: wrong schema version or malformed JSON."""


class InvalidPlanError(KarmaError):
    """A plan does not fit the problem: a tensor used while off the device, a recompute input missing, …"""
