"""What the solver decides for one candidate tensor: keep it, offload it (with its release and prefetch
positions), or recompute it.

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


@dataclass(frozen=True)
class Choice:
    """One candidate's decision. Only an offload has positions: compute waits for the device→host copy
    before op ``release`` (the bytes are free from there), and the host→device copy is issued at op
    ``prefetch``, no earlier than the release."""

    kind: Kind
    release: int | None = None
    prefetch: int | None = None

    def __post_init__(self) -> None:
        positioned = self.release is not None and self.prefetch is not None
        if self.kind is Kind.OFFLOAD:
            if not positioned:
                raise ValueError("an offload needs its release and prefetch positions")
            if self.prefetch < self.release:  # type: ignore[operator]
                raise ValueError(f"prefetched at op {self.prefetch} before it is released at op {self.release}")
        elif self.release is not None or self.prefetch is not None:
            raise ValueError(f"a {self.kind.value} choice has no release or prefetch position")

    @staticmethod
    def offload(release: int, prefetch: int) -> "Choice":
        return Choice(Kind.OFFLOAD, release, prefetch)


KEEP = Choice(Kind.KEEP)
RECOMPUTE = Choice(Kind.RECOMPUTE)
