"""Budgets: a size in bytes (``"12GiB"``, ``12e9``, ``4096``) or a fraction of the unplanned peak (``0.5``).

One meaning everywhere (``karma_fx.plan``, ``karma_fx.compile``, ``backend="karma"``, the CLI): a number or a
numeric string in (0, 1] is a fraction; a number of at least 1 KiB is bytes; anything between (``1.5``, ``2``,
``"100"``) is refused as ambiguous rather than read as a handful of bytes. numpy scalars count as numbers.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from karma_fx.errors import BudgetError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
MIN_BYTES = 1024
"""Plain numbers below this (and above 1) are ambiguous: nobody means a 2-byte budget."""


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``fraction`` (of the unplanned peak) and ``size_bytes`` is set."""

    fraction: float | None = None
    size_bytes: int | None = None
    text: str = ""
    """What the user wrote, for messages."""

    @classmethod
    def of(cls, budget: "str | int | float | Budget") -> "Budget":
        """Read ``budget``; raises ``BudgetError`` with what to write instead."""
        if isinstance(budget, Budget):
            return budget
        text = repr(budget)
        if isinstance(budget, bool) or budget is None:
            raise BudgetError(f"budget must be a size such as '12GiB' or a fraction such as 0.5, got {text}")
        if isinstance(budget, str):
            m = _PATTERN.match(budget)
            if not m or m.group(2).lower() not in _UNITS:
                raise BudgetError(f"cannot read budget {text}: use bytes with a unit ('12GiB', '800MB') "
                                  "or a fraction of the unplanned peak ('0.5')")
            value, unit = float(m.group(1)), m.group(2).lower()
            if unit:
                return cls(size_bytes=_positive_bytes(value * _UNITS[unit], text), text=budget)
            return cls._number(value, text)
        if isinstance(budget, numbers.Real):  # int, float, numpy scalars
            return cls._number(float(budget), text)
        raise BudgetError(f"budget must be a finite number or a size string, got {text}")

    @classmethod
    def _number(cls, value: float, text: str) -> "Budget":
        if not math.isfinite(value):
            raise BudgetError(f"budget must be a finite number or a size string, got {text}")
        if value <= 0:
            raise BudgetError(f"budget must be positive, got {text}")
        if value <= 1:
            return cls(fraction=value, text=text)
        if value < MIN_BYTES:
            raise BudgetError(f"budget {text} is ambiguous: a fraction of the unplanned peak is at most 1, and a "
                              f"plain number of bytes at least {MIN_BYTES}; write e.g. '{value:g}GiB', 0.5, or "
                              f"'{value:g}B' (a graph counted in small units)")
        return cls(size_bytes=_positive_bytes(value, text), text=text)

    def resolve(self, unplanned_peak_bytes: int | None) -> int:
        """Bytes: the size itself, or the fraction of ``unplanned_peak_bytes``."""
        if self.size_bytes is not None:
            return self.size_bytes
        if unplanned_peak_bytes is None:
            raise BudgetError(f"budget {self.text} is a fraction of the unplanned peak, which is not known here")
        assert self.fraction is not None
        return _positive_bytes(self.fraction * unplanned_peak_bytes, self.text)

    def __str__(self) -> str:
        return self.text.strip("'\"") if self.text else (
            f"{self.fraction:g}" if self.fraction is not None else format_bytes(self.size_bytes))


def parse_budget(budget: "str | int | float | Budget", unplanned_peak_bytes: int | None = None) -> int:
    """Resolve ``budget`` to bytes (see the module docstring for what numbers mean).

    >>> parse_budget("1.5GiB")
    1610612736
    >>> parse_budget(0.5, unplanned_peak_bytes=1000)
    500
    """
    return Budget.of(budget).resolve(unplanned_peak_bytes)


def _positive_bytes(value: float, original: object) -> int:
    out = int(value)
    if out <= 0:
        raise BudgetError(f"budget {original} is less than one byte")
    return out


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover
