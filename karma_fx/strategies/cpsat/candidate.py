"""What the exact planner decides on: a candidate tensor with its positions and recompute chain, and the
segments that may rebuild it with others. Plain data, shared by the models (``model.py``) and the segments'
construction (``segments.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from karma_fx.plan import Recompute


@dataclass(eq=False)
class Segment:
    """The candidates of one to ``segments.MAX_SPAN`` consecutive stretches between cut points (or one tensor
    of a stretch, rebuilt alone from its input), and the one chain that rebuilds them all from what stays
    resident (the segment's input, kept candidates it reads, weights, outputs of random ops)."""

    index: int
    members: tuple[str, ...]
    anchor: int
    """The first backward read of any member: the chain runs before it, and every member is back from it."""
    chain: tuple[int, ...]
    decision: Recompute
    temp_bytes: int = 0
    """How far the chain's memory rises above its members, all back, while it runs (at the anchor)."""
    needs_kept: list[str] = field(default_factory=list)
    extends: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass(eq=False)
class Candidate:
    name: str
    size: int
    producer: int
    last_fwd: int
    first_bwd: int
    releases: list[int]
    prefetches: list[int]
    chain: tuple[int, ...] | None = None
    chain_time: float = 0.0
    chain_temp_bytes: int = 0
    needs_kept: list[str] = field(default_factory=list)
    extends: list[tuple[str, int, int]] = field(default_factory=list)  # (storage, from position, to position)
    segments: tuple[Segment, ...] = ()
    """The segments the candidate belongs to (overlapping spans: it may be rebuilt by any one of them)."""
    reading: tuple[Segment, ...] = ()
    """The segments whose chain reads it (it is not among their members)."""
    queued_at: int | None = None
    """Where its copy back sits in the copy-in queue when its prefetch is fixed (a pinned copy: its prefetch
    position, the order the runtime issues it in); ``None``: at its first backward read."""
    before_chains: bool = False
    """A pinned recompute chain that runs before ``first_bwd`` reads it (``first_bwd`` is that op): its copy
    back is waited for before those chains, not after them."""
