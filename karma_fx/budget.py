"""Budgets: a size in bytes (``"12GiB"``, ``12e9``) or a fraction of the unplanned peak (``0.5``)."""
from __future__ import annotations

import math
import re

from karma_fx.errors import BudgetError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_budget(budget: str | int | float, unplanned_peak_bytes: int | None = None) -> int:
    """Resolve ``budget`` to bytes.

    Numbers in (0, 1] (and strings such as ``"0.5"``) are fractions of ``unplanned_peak_bytes``, the peak of
    the step with nothing moved; larger numbers are bytes; strings may carry a unit (``KiB``…``TiB``,
    ``KB``…``TB``; a bare ``G`` means GiB).

    >>> parse_budget("1.5GiB")
    1610612736
    >>> parse_budget(0.5, unplanned_peak_bytes=1000)
    500
    """
    if isinstance(budget, bool) or budget is None:
        raise BudgetError(f"budget must be a size such as '12GiB' or a fraction such as 0.5, got {budget!r}")
    if isinstance(budget, str):
        m = _PATTERN.match(budget)
        if not m or m.group(2).lower() not in _UNITS:
            raise BudgetError(f"cannot read budget {budget!r}: use bytes with a unit ('12GiB', '800MB') "
                              "or a fraction of the unplanned peak ('0.5')")
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit:
            return _positive_bytes(value * _UNITS[unit], budget)
        budget = value
    if not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise BudgetError(f"budget must be a finite number or a size string, got {budget!r}")
    if budget <= 0:
        raise BudgetError(f"budget must be positive, got {budget!r}")
    if budget <= 1:
        if unplanned_peak_bytes is None:
            raise BudgetError(f"budget {budget!r} is a fraction of the unplanned peak, which is not known here")
        return _positive_bytes(budget * unplanned_peak_bytes, budget)
    return _positive_bytes(budget, budget)


def _positive_bytes(value: float, original: object) -> int:
    out = int(value)
    if out <= 0:
        raise BudgetError(f"budget {original!r} is less than one byte")
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
