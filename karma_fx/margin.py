"""What a step's measured peak showed above its plan, kept as a margin for the plans that follow.

The memory model is exact for the eager op-by-op runner wherever it is tested; for a step Inductor compiles it
is a model of Inductor's fusion, buffer reuse and in-place writes, and where that model is short (a DenseNet-
style CNN whose concatenations Inductor lays out its own way: 1.0 MiB, 5%, above the plan at 0.9 of its peak)
the budget broke by the difference. The front door already measures one whole step per sequence of runs (the
allocator's events, ``karma_fx.measure_run.GapMeter``); where that step peaked above the budget and above its
plan, the difference is kept here, per sequence of runs, and counted as held all step by every plan chosen
after it: the next step plans to the budget less the margin, and is measured again, until a measured step fits
(or ``MAX_CHECKS`` steps were measured, or no plan fits and the budget is refused with the margin counted).

A margin only grows (a larger one replaces a smaller one), so the loop ends. It is learnt only where the budget
broke: a step that fitted says nothing about plans at other budgets, and the unplanned step a fraction is taken
of is never changed by it.

Example::

    margins = Margins()
    if margins.learn((0,), measured=19_719_000, planned=18_720_000, budget=19_548_000):
        ...  # choose the plans again: margins.of((0,)) == 999_000, and measure a later step (margins.due)
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_CHECKS = 4
"""Steps measured again after a margin was learnt, per sequence of runs, before the session stops checking."""

Signature = tuple[int, ...]


@dataclass
class Margins:
    """Per sequence of runs (the regions a step ran, in order): bytes the measured step peaked above its plan."""

    bytes_of: dict[Signature, int] = field(default_factory=dict)
    checks: dict[Signature, int] = field(default_factory=dict)
    """Steps of each sequence measured after its margin was learnt."""
    pending: dict[Signature, int] = field(default_factory=dict)
    """Sequences whose plans are chosen again under a new margin -> steps to let pass before measuring one: the
    first step under new plans may compile them and fill the host pool for new offloads (allocations a steady
    step does not make)."""

    steady: set[Signature] = field(default_factory=set)
    """Sequences of which a whole step was measured in which every plan had run before (a plan's first run
    allocates what later runs reuse, the host buffers of its offloads: its climb says nothing of the plans)."""
    tries: dict[Signature, int] = field(default_factory=dict)
    """Steps of each sequence measured while none was yet measured steady."""

    def of(self, signature: Signature) -> int:
        return self.bytes_of.get(signature, 0)

    def due(self, signature: Signature) -> bool:
        """A step of ``signature`` begins: whether to measure it (a margin was learnt and is not yet seen to
        hold). Asked once per step."""
        if signature not in self.pending or self.checks.get(signature, 0) >= MAX_CHECKS:
            return False
        if self.pending[signature] > 0:
            self.pending[signature] -= 1
            return False
        del self.pending[signature]
        self.checks[signature] = self.checks.get(signature, 0) + 1
        return True

    def wanted(self, signature: Signature) -> bool:
        """A step of ``signature`` begins: whether to measure it, because no steady step of it has been measured
        yet (up to ``MAX_CHECKS`` tries) or a margin is ``due``. Asked once per step."""
        if signature not in self.steady and self.tries.get(signature, 0) < MAX_CHECKS:
            self.tries[signature] = self.tries.get(signature, 0) + 1
            return True
        return self.due(signature)

    def unsteady(self, signature: Signature) -> None:
        """The step measured for ``signature`` was not steady, or is the first of two readings in a row that the
        session learns from (the lower of them): where a margin awaits its check, measure the next step too
        (still within ``MAX_CHECKS``)."""
        if signature in self.bytes_of and self.checks.get(signature, 0) < MAX_CHECKS:
            self.pending[signature] = 0

    def learn(self, signature: Signature, measured: int, planned: int, budget: int | None) -> bool:
        """A measured step of ``signature`` peaked at ``measured`` bytes where its plans, without any margin,
        said ``planned``. Returns whether the margin grew (the step broke ``budget``, by more than the margin
        already counted): its plans must then be chosen again."""
        if budget is None or measured <= budget:
            return False
        over = measured - planned
        if over <= self.of(signature):
            return False
        self.bytes_of[signature] = over
        self.pending[signature] = 1
        return True
