"""One row of a simulated schedule, and the text table of those rows.

It sits below ``plan.py``, which stores the rows and draws them through ``Plan.table``, and knows nothing of
plans: the plan adds its own summary under the table. tabulate is loaded only when a table is drawn, so
planning never pays for it.

Example::

    print(schedule_table(plan.schedule, [("strategy", "greedy")], max_rows=40))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["ScheduleRow", "schedule_table", "MAX_NAMES"]

MAX_NAMES = 2
_MAX_CHARS = 28
"""Tensor names shown per prefetch/recompute/free cell before "+N more": a recompute group can drop dozens
of tensors and would make the row wrap. The offload column is never elided: it is the decision itself, and
the other columns only repeat its names (prefetch) or follow from the recompute groups in the summary."""
_HEADERS = ["op", "offload", "prefetch", "recompute", "free", "device bytes", "stall µs"]


@dataclass(frozen=True)
class ScheduleRow:
    """One op of the simulated step at which something happens."""

    op: str
    offload: tuple[str, ...] = ()
    prefetch: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    free: tuple[str, ...] = ()
    device_bytes: int = 0
    stall_us: float = 0.0
    module: str = ""
    """The module the op ran in (``karma_fx.problem.Op.module``), "" when unknown."""


def _names(names: Sequence[str], limit: int | None = MAX_NAMES, max_chars: int = _MAX_CHARS) -> str:
    """Comma-join tensor names, eliding past ``limit`` names or ``max_chars`` characters (always showing at
    least one name) so one busy op cannot blow up the column width; the JSON plan has the full lists."""
    if limit is None:
        return ", ".join(names)
    shown: list[str] = []
    for name in names:
        if shown and (len(shown) >= limit or len(", ".join(shown + [name])) > max_chars):
            break
        shown.append(name)
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f", +{rest} more" if rest else "")


def _row_cells(row: ScheduleRow, max_names: int | None, modules: bool) -> list[str]:
    from karma_fx.budget import format_bytes
    from karma_fx.problem import short_module

    stall = f"{row.stall_us:,.1f}" if row.stall_us else ""
    return [row.op, *([short_module(row.module)] if modules else []), ", ".join(row.offload),
            _names(row.prefetch, max_names), _names(row.recompute, max_names), _names(row.free, max_names),
            format_bytes(row.device_bytes), stall]


def schedule_table(rows: Sequence[ScheduleRow], summary: Sequence[tuple[str, str]], max_rows: int | None = 60, *,
                   max_names: int | None = MAX_NAMES, tablefmt: str = "simple") -> str:
    """The rows as a table, then the ``summary`` (key, value) lines under it.

    With more than ``max_rows`` rows, the first and last ones are shown around a "… N more rows …" line
    (``None``: show all), since the interesting parts are usually the start of the forward pass and the end
    of the backward pass. Prefetch/recompute/free cells list at most ``max_names`` tensors (``None``: all);
    offloaded tensors are always listed in full. Beside each op, the module it ran in (``short_module``: its
    last components), a column shown only when some row knows its module.
    """
    from tabulate import tabulate

    rows = list(rows)
    body: list[list[str]] = []
    limit = None if max_rows is None else max(max_rows, 0)
    cut = limit is not None and len(rows) > limit
    head, tail = ((limit + 1) // 2, limit // 2) if cut else (len(rows), 0)
    shown = rows[:head] + rows[len(rows) - tail:]
    modules = any(r.module for r in shown)  # no empty column for plans that know no modules (hand-made, old)
    headers = _HEADERS[:1] + ["module"] * modules + _HEADERS[1:]
    body += [_row_cells(r, max_names, modules) for r in rows[:head]]
    if cut:
        body.append([f"… {len(rows) - head - tail} more rows …"] + [""] * (len(headers) - 1))
        body += [_row_cells(r, max_names, modules) for r in rows[len(rows) - tail:]]
    parts: list[str] = []
    if body:
        parts.append(tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True))
    else:
        parts.append("(no schedule rows: nothing is offloaded, recomputed or waited for)")
    parts.append("")
    width = max((len(k) for k, _ in summary), default=0)
    parts += [f"{k:<{width}}  {v}" for k, v in summary]
    return "\n".join(parts)
