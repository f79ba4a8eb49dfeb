"""What a long planning is doing, and when it must stop.

Planning a real model takes from a second to minutes (capture, the heuristics, the CP-SAT models), and a silent
terminal for that long looks hung. So the code that plans reports its stages here:

    with planning("gpt2"):
        report("capture")
        report("heuristics", strategy="greedy", slowdown=1.065, peak_bytes=5 << 30)

Every report is an INFO record of the ``karma_fx`` logger, and updates a one-line display on stderr (a tqdm
bar when tqdm is installed, plain lines otherwise) that appears only once the planning has lasted
``SHOW_AFTER_S``, so quick plans print nothing extra. Outside ``planning`` a report does nothing, so library
code may call it anywhere, cheaply. The current planning lives in a context variable: nested ``planning``
blocks share the outer display, and another thread sees none unless it runs in a copy of the context.

The strategies' wall-clock limit lives here too (``deadline``, ``seconds_left``), for the same reason: it
belongs to the planning in progress, and every strategy, however deeply called (cpsat runs greedy as a
fallback), reads the one clock without a change to the ``Strategy`` call signature.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import re
import sys
import threading
import time
from typing import Any, Iterator

LOGGER = logging.getLogger("karma_fx")
LOGGER.addHandler(logging.NullHandler())  # a library logs; the application decides where records go

SHOW_AFTER_S = 2.0
"""The display appears once a planning has lasted this long: shorter ones would only flicker."""
TICK_S = 1.0
"""Once shown, the display is redrawn this often even without a report, so its elapsed time keeps counting
through a long solve (a still line looks hung)."""
ENV = "KARMA_PROGRESS"
"""``1``: show the display even when stderr is not a terminal (a log file, CI); ``0``: never show it."""


def _wanted(enabled: bool | None) -> bool:
    """Whether to show the display: ``KARMA_PROGRESS=0`` always wins (the user asked for silence), then an
    explicit ``enabled``, then ``KARMA_PROGRESS=1``, then whether stderr is a terminal."""
    env = os.environ.get(ENV, "").strip()
    if env == "0":
        return False
    if enabled is not None:
        return enabled
    if env == "1":
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # stderr replaced by an object without isatty, or closed
        return False


def _format_bytes(n: int) -> str:
    from karma_fx.budget import format_bytes

    return format_bytes(n)


class _Display:
    """One planning's state and its line on stderr; a lock guards it because a timer thread shows it."""

    def __init__(self, label: str, enabled: bool, show_after_s: float) -> None:
        self.label, self.enabled, self.show_after_s = label, enabled, show_after_s
        self.started = time.monotonic()
        self.stage = "starting"
        self.strategy: str | None = None
        self.slowdown: float | None = None
        self.peak_bytes: int | None = None
        self.bar: Any = None
        self.shown = ""
        self.closed = False
        self.lock = threading.Lock()
        self._stop = threading.Event()
        if enabled:  # show at the threshold and tick after it, even when no report comes (a long CP-SAT solve)
            threading.Thread(target=self._tick, name="karma-progress", daemon=True).start()

    def _tick(self) -> None:
        if self._stop.wait(self.show_after_s):
            return
        while True:
            self.refresh(tick=True)
            if self._stop.wait(TICK_S):
                return

    def text(self) -> str:
        """``planning gpt2: heuristics, strategy greedy, best 1.065x at 1.2 GiB``."""
        parts = [f"planning {self.label}: {self.stage}"]
        if self.strategy:
            parts.append(f"strategy {self.strategy}")
        if self.slowdown is not None:
            best = f"best {self.slowdown:.3f}x"
            parts.append(best + (f" at {_format_bytes(self.peak_bytes)}" if self.peak_bytes is not None else ""))
        return ", ".join(parts)

    def refresh(self, tick: bool = False) -> None:
        """Show or update the line, once the planning has lasted ``show_after_s``; a ``tick`` redraws an
        unchanged tqdm line for its elapsed time (plain lines are printed only when they change)."""
        with self.lock:
            if not self.enabled or self.closed or time.monotonic() - self.started < self.show_after_s:
                return
            text = self.text()
            if text == self.shown:
                if tick and self.bar is not None:
                    self.bar.refresh()
                return
            if self.bar is None and not self.shown:
                self.bar = _new_bar()
            if self.bar is not None:
                self.bar.set_description_str(text, refresh=True)
            else:
                print(f"karma-fx: {text}", file=sys.stderr, flush=True)
            self.shown = text

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._stop.set()
            if self.bar is not None:
                self.bar.close()


def _new_bar() -> Any:
    """A tqdm status line (no total: a planning has no known length) or None when tqdm is missing."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=None, bar_format="{desc} [{elapsed}]", file=sys.stderr, leave=False, dynamic_ncols=True)


_current: contextvars.ContextVar[_Display | None] = contextvars.ContextVar("karma_fx_planning", default=None)


@contextlib.contextmanager
def planning(label: str, *, enabled: bool | None = None, show_after_s: float | None = None) -> Iterator[None]:
    """Report the stages of planning ``label`` inside this block (see the module docstring). ``enabled``:
    None shows the display when stderr is a terminal or ``KARMA_PROGRESS=1``; ``KARMA_PROGRESS=0`` hides it
    always. ``show_after_s`` None: ``SHOW_AFTER_S``, read now (not when this module was imported). Nested
    inside another ``planning``, it reuses that display under the new label."""
    outer = _current.get()
    if outer is not None:
        previous, outer.label = outer.label, label
        try:
            yield
        finally:
            outer.label = previous
        return
    display = _Display(label, _wanted(enabled), SHOW_AFTER_S if show_after_s is None else show_after_s)
    token = _current.set(display)
    LOGGER.debug("planning %s", label)
    try:
        yield
    finally:
        _current.reset(token)
        display.close()
        LOGGER.debug("planning %s took %.2f s", label, time.monotonic() - display.started)


def report(stage: str, *, strategy: str | None = None, slowdown: float | None = None,
           peak_bytes: int | None = None) -> None:
    """The planning in progress is at ``stage`` (running ``strategy``; the best plan so far is ``slowdown``
    times the unlimited-memory step at ``peak_bytes``). A no-op outside ``planning``; omitted figures keep
    their last reported value."""
    display = _current.get()
    if display is None:
        return
    with display.lock:
        # A new stage is news (a few INFO lines a planning); each probe within one is detail (DEBUG): a strategy
        # reports every order and quota it tries, 35 lines for one small region.
        level = logging.INFO if _kind(stage) != _kind(display.stage) else logging.DEBUG
        display.stage = stage
        if strategy is not None:
            display.strategy = strategy
        if slowdown is not None:
            display.slowdown = slowdown
        if peak_bytes is not None:
            display.peak_bytes = peak_bytes
        text = display.text() if LOGGER.isEnabledFor(level) else ""
    if text:
        LOGGER.log(level, "%s", text)
    if display.enabled:
        display.refresh()  # shows nothing before the threshold; after it keeps the line current


def _kind(stage: str) -> str:
    """What a stage is, less its particulars: ``"swap quota 0.25, local order"`` -> ``"swap quota"``."""
    return re.sub(r"[\d.]+", "", stage.split(",")[0]).strip()


def current_text() -> str | None:
    """The display's text for the planning in progress (None outside one), whether or not it is shown."""
    display = _current.get()
    return None if display is None else display.text()


# ---- the wall-clock limit of the strategy call in progress -----------------------------------------------
_deadline: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("karma_fx_deadline",
                                                                                       default=None)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Strategies called inside stop starting new work after ``seconds`` (None: no limit). Nested limits
    keep the earlier end, so a fallback never outlives the planner that called it."""
    if seconds is None:
        yield
        return
    end = time.monotonic() + seconds
    outer = _deadline.get()
    token = _deadline.set((end, seconds) if outer is None or end < outer[0] else outer)
    try:
        yield
    finally:
        _deadline.reset(token)


@contextlib.contextmanager
def no_deadline() -> Iterator[None]:
    """Strategies called inside run to their end whatever deadline the caller set: for the leanest plan, whose
    peak is the floor quoted to users and must come out the same inside a time-limited planner as outside."""
    token = _deadline.set(None)
    try:
        yield
    finally:
        _deadline.reset(token)


def seconds_left() -> float:
    """Seconds before the current deadline (negative once past; ``math.inf`` without one)."""
    limit = _deadline.get()
    return math.inf if limit is None else limit[0] - time.monotonic()


def past_deadline() -> bool:
    return seconds_left() <= 0


def stopped_note() -> str:
    """The plain-language note a plan cut short by the deadline carries."""
    limit = _deadline.get()
    seconds = f"{limit[1]:g} s " if limit is not None else ""
    return f"stopped at the {seconds}time limit; the plan may be slower than with more time"
