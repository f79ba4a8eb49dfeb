"""Human-facing views of a plan: text tables (a plan's own is ``Plan.table``), a Chrome/Perfetto trace
and a matplotlib timeline.

Nothing on the solve path imports this module: planning must not pay for tabulate formatting or matplotlib
(which is imported lazily, only when a plot is drawn). Every view reads only the ``Plan`` (which may have been
loaded from JSON, so all it shows must be in the plan itself) or the simulator's ``Timeline``.

Example::

    print(plan_table(planned.plan, max_rows=40))
    write_chrome_trace(planned.timeline, "step.json")     # open in ui.perfetto.dev or chrome://tracing
    plot_timeline(planned.timeline, "step.png", budget_bytes=planned.plan.budget_bytes)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from tabulate import tabulate

from karma_fx.budget import format_bytes
from karma_fx.errors import KarmaError
from karma_fx.plan import Plan
from karma_fx.schedule import MAX_NAMES
from karma_fx.simulate import Interval, Timeline

__all__ = ["chrome_trace", "compare_table", "plan_table", "plot_timeline", "write_chrome_trace"]

_DASH = "-"


def plan_table(plan: Plan, max_rows: int | None = 60, *, max_names: int | None = MAX_NAMES,
               tablefmt: str = "simple") -> str:
    """The plan's schedule and summary as text: ``Plan.table`` (the plan draws its own table, so that
    ``plan.py`` needs nothing from this module)."""
    return plan.table(max_rows, max_names=max_names, tablefmt=tablefmt)


# ---- Chrome / Perfetto trace ----------------------------------------------------------------------------
_THREADS = ((0, "compute"), (1, "D2H (offload)"), (2, "H2D (prefetch)"))
_CATEGORY = {"op": "compute", "recompute": "recompute", "stall": "stall", "issue": "copy ops", "offload": "d2h",
             "prefetch": "h2d"}
_CNAME = {"stall": "terrible", "recompute": "yellow"}  # Chrome's reserved colour names; Perfetto ignores them


def chrome_trace(timeline: Timeline, name: str = "karma_fx") -> dict[str, Any]:
    """The simulated step as a trace-event JSON object for ``chrome://tracing`` or ui.perfetto.dev.

    Seeing the three streams side by side is the quickest way to tell *why* a plan is slow: a stall on the
    compute lane lines up with the copy it waits for. One "X" event per interval (tid 0 compute, 1 D2H,
    2 H2D; ``cat`` is compute/recompute/stall/d2h/h2d), one "C" counter sample "device bytes" per entry of
    ``timeline.memory``, and an instant event at the peak. Times are µs, as the format expects.
    """
    pid = 0
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}]
    for tid, label in _THREADS:
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for tid, stream in enumerate((timeline.compute, timeline.d2h, timeline.h2d)):
        for iv in stream:
            event: dict[str, Any] = {"name": iv.label, "cat": _CATEGORY.get(iv.kind, iv.kind), "ph": "X",
                                     "ts": float(iv.start_us), "dur": float(max(iv.end_us - iv.start_us, 0.0)),
                                     "pid": pid, "tid": tid}
            if iv.kind in _CNAME:
                event["cname"] = _CNAME[iv.kind]
            events.append(event)
    for t, live in timeline.memory:
        events.append({"name": "device bytes", "ph": "C", "ts": float(t), "pid": pid, "args": {"bytes": int(live)}})
    t_peak = next((t for t, m in timeline.memory if m == timeline.peak_bytes), None)
    if t_peak is not None:
        events.append({"name": f"peak {format_bytes(timeline.peak_bytes)} ({timeline.peak_op})", "ph": "i",
                       "s": "g", "ts": float(t_peak), "pid": pid, "tid": 0})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"peak_bytes": int(timeline.peak_bytes), "makespan_us": float(timeline.makespan_us),
                      "stall_us": float(timeline.stall_us), "recompute_us": float(timeline.recompute_us),
                      "issue_us": float(timeline.issue_us),
                      "host_peak_bytes": int(timeline.host_peak_bytes)},
    }


def write_chrome_trace(timeline: Timeline, path: str | Path, name: str = "karma_fx") -> None:
    """Write ``chrome_trace(timeline, name)`` compactly (traces of big models run to tens of MB otherwise)."""
    Path(path).write_text(json.dumps(chrome_trace(timeline, name), separators=(",", ":")))


# ---- matplotlib timeline ----------------------------------------------------------------------------------
def _spans(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
    """(start ms, width ms) pairs for ``broken_barh``: one collection per lane, not one artist per op."""
    return [(iv.start_us / 1e3, max(iv.end_us - iv.start_us, 0.0) / 1e3) for iv in intervals]


def plot_timeline(timeline: Timeline, path: str | Path, *, budget_bytes: int | None = None,
                  title: str = "") -> None:
    """Draw device memory over the step above the three streams, sharing the time axis; save PNG/SVG/PDF.

    The memory curve shows *where* the budget binds, and the lanes below show what the plan does about it
    there. Uses ``Figure`` + ``FigureCanvasAgg`` directly, so the caller's pyplot backend and state are left
    alone; each lane is one ``broken_barh`` collection, which keeps 20,000 intervals well under a second.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - matplotlib is an optional extra
        raise KarmaError("plotting needs matplotlib: pip install 'karma_fx[plot]'") from exc

    top = max([m for _, m in timeline.memory] + [budget_bytes or 0, 1])
    unit, scale = next(((u, float(f)) for u, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                        if top >= f), ("B", 1.0))  # GiB for real models, readable numbers for tiny ones
    fig = Figure(figsize=(12, 6.5))  # fixed margins: constrained layout would draw 20k rectangles twice
    FigureCanvasAgg(fig)
    ax_mem, ax_lanes = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    fig.subplots_adjust(left=0.07, right=0.985, top=0.93 if title else 0.97, bottom=0.08, hspace=0.14)
    end_ms = max(timeline.makespan_us, timeline.memory[-1][0] if timeline.memory else 0.0) / 1e3

    # top: device bytes, a step curve held to the end of the step
    if timeline.memory:
        xs = [t / 1e3 for t, _ in timeline.memory] + [end_ms]
        ys = [m / scale for _, m in timeline.memory]
        ys.append(ys[-1])
        ax_mem.step(xs, ys, where="post", color="tab:blue", linewidth=1.0, label="device memory")
        ax_mem.fill_between(xs, ys, step="post", color="tab:blue", alpha=0.15, linewidth=0)
        k_peak = max(range(len(timeline.memory)), key=lambda k: timeline.memory[k][1])
        x_peak, y_peak = timeline.memory[k_peak][0] / 1e3, timeline.memory[k_peak][1] / scale
        ax_mem.plot([x_peak], [y_peak], marker="v", color="black", linestyle="none",
                    label=f"peak {format_bytes(timeline.memory[k_peak][1])}")
        right_half = end_ms > 0 and x_peak > end_ms / 2  # keep the label inside the axes
        ax_mem.annotate(timeline.peak_op or "peak", (x_peak, y_peak), textcoords="offset points",
                        xytext=(-6 if right_half else 6, 6), ha="right" if right_half else "left", fontsize=8)
    if budget_bytes is not None:
        ax_mem.axhline(budget_bytes / scale, color="tab:red", linestyle="--", linewidth=1.2,
                       label=f"budget {format_bytes(budget_bytes)}")
    ax_mem.set_ylabel(f"device memory ({unit})")
    ax_mem.set_ylim(0, top / scale * 1.22)  # headroom for the legend and the peak label
    ax_mem.grid(True, alpha=0.3)
    if ax_mem.get_legend_handles_labels()[0]:
        ax_mem.legend(loc="upper left", fontsize=8, ncols=3)
    if title:
        ax_mem.set_title(title)

    # bottom: compute (ops, recomputes, stalls), D2H, H2D as three lanes
    lanes = [  # (y, label, [(intervals, colour, legend label)])
        (2, "compute", [([iv for iv in timeline.compute if iv.kind not in ("recompute", "stall")], "tab:blue", "op"),
                        ([iv for iv in timeline.compute if iv.kind == "recompute"], "tab:orange", "recompute"),
                        ([iv for iv in timeline.compute if iv.kind == "stall"], "tab:red", "stall")]),
        (1, "D2H", [(timeline.d2h, "tab:purple", "offload")]),
        (0, "H2D", [(timeline.h2d, "tab:green", "prefetch")]),
    ]
    for y, _, groups in lanes:
        for intervals, colour, label in groups:
            spans = _spans(intervals)
            if spans:
                ax_lanes.broken_barh(spans, (y - 0.4, 0.8), facecolors=colour, linewidth=0, label=label)
    ax_lanes.set_yticks([y for y, _, _ in lanes], [name for _, name, _ in lanes])
    ax_lanes.set_ylim(-0.6, 2.6)
    ax_lanes.set_xlim(0, end_ms if end_ms > 0 else 1.0)
    ax_lanes.set_xlabel("time (ms)")
    ax_lanes.grid(True, axis="x", alpha=0.3)
    if ax_lanes.get_legend_handles_labels()[0]:
        ax_lanes.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncols=5, frameon=False)
    fig.savefig(str(path), dpi=110)


# ---- strategy × budget grid --------------------------------------------------------------------------------
def compare_table(rows: list[dict[str, Any]], *, tablefmt: str = "simple") -> str:
    """A strategy × budget grid for ``karma-fx compare``: the trade-off is visible at a glance per column.

    Each row dict describes one cell:

    - ``strategy`` (str): the grid row; ``budget`` (str): the column label as the user wrote it ("0.5");
    - ``budget_bytes`` (int, optional): the resolved budget, shown in the column header;
    - ``fits`` (bool): whether the plan's simulated peak is within the budget;
    - ``slowdown`` (float | None): step time over the unlimited-memory step time;
    - ``peak_bytes`` (int | None): the plan's simulated peak;
    - ``needs_bytes`` (int | None, optional): for a cell that does not fit, the figure to show as what it
      needs (defaults to ``peak_bytes``, what the strategy reached);
    - ``error`` (str | None, optional): the strategy failed outright; the cell shows "error: …".

    A feasible cell reads "1.083x / 11.20 GiB", an infeasible one "infeasible (needs 12.60 GiB)", a missing
    pair "—". The fastest feasible cell of each column is marked with "*".
    """
    strategies: list[str] = []
    budgets: list[str] = []
    budget_bytes: dict[str, int] = {}
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        s, b = str(row["strategy"]), str(row["budget"])
        if s not in strategies:
            strategies.append(s)
        if b not in budgets:
            budgets.append(b)
        if row.get("budget_bytes") is not None:
            budget_bytes.setdefault(b, int(row["budget_bytes"]))
        cells[(s, b)] = row

    best: dict[str, str] = {}
    for b in budgets:
        feasible = [(cells[(s, b)]["slowdown"], s) for s in strategies
                    if (s, b) in cells and not cells[(s, b)].get("error") and cells[(s, b)].get("fits")
                    and cells[(s, b)].get("slowdown") is not None]
        if feasible:
            best[b] = min(feasible)[1]

    def render(s: str, b: str) -> str:
        cell = cells.get((s, b))
        if cell is None:
            return "—"
        if cell.get("error"):
            message = str(cell["error"])
            return "error: " + (message if len(message) <= 40 else message[:39] + "…")
        if not cell.get("fits"):
            needs = cell.get("needs_bytes", cell.get("peak_bytes"))
            return f"infeasible (needs {format_bytes(needs)})" if needs is not None else "infeasible"
        slowdown = cell.get("slowdown")
        text = f"{slowdown:.3f}x" if slowdown is not None else _DASH
        text += f" / {format_bytes(cell.get('peak_bytes'))}"
        return text + (" *" if best.get(b) == s else "")

    headers = ["strategy"] + [f"{b} ({format_bytes(budget_bytes[b])})" if b in budget_bytes else b
                              for b in budgets]
    body = [[s] + [render(s, b) for b in budgets] for s in strategies]
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)
