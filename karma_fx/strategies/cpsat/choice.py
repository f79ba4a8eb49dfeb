"""What the solver decides for one candidate tensor: keep it, offload it (with its release and prefetch
positions), recompute it alone, or rebuild it with the rest of its segment.

A value type rather than ad-hoc tuples, so a choice is checked once where it is made (an offload without its
positions, or prefetched before it is released, cannot exist) and read by name everywhere else.

Example::

    Choice.offload(release=4, prefetch=9).kind is Kind.OFFLOAD
    choices.get(name, KEEP).kind is Kind.KEEP
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    SEGMENT = "segment"
    """Dropped with every other candidate of a segment and rebuilt by one chain from the segment's input
    (checkpointing's choice): all members of a segment take it together or none does."""


@dataclass(frozen=True)
class Choice:
    """One candidate's decision. Only an offload has positions: compute waits for the device→host copy
    before op ``release`` (the bytes are free from there), and the host→device copy is issued at op
    ``prefetch``, no earlier than the release."""

    kind: Kind
    release: int | None = None
    prefetch: int | None = None
    group: int | None = None
    """Which segment rebuilds the candidate (``Kind.SEGMENT`` only: a candidate may belong to several, one
    segment per stretch of consecutive cut-point spans)."""

    def __post_init__(self) -> None:
        positioned = self.release is not None and self.prefetch is not None
        if self.kind is Kind.OFFLOAD:
            if not positioned:
                raise ValueError("an offload needs its release and prefetch positions")
            if self.prefetch < self.release:  # type: ignore[operator]
                raise ValueError(f"prefetched at op {self.prefetch} before it is released at op {self.release}")
        elif self.release is not None or self.prefetch is not None:
            raise ValueError(f"a {self.kind.value} choice has no release or prefetch position")
        if (self.kind is Kind.SEGMENT) != (self.group is not None):
            raise ValueError("a segment choice, and only one, names its segment")

    @staticmethod
    def offload(release: int, prefetch: int) -> "Choice":
        return Choice(Kind.OFFLOAD, release, prefetch)

    @staticmethod
    def segment(group: int) -> "Choice":
        return Choice(Kind.SEGMENT, group=group)


KEEP = Choice(Kind.KEEP)
RECOMPUTE = Choice(Kind.RECOMPUTE)
