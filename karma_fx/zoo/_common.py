"""Pieces every zoo builder shares: the request a builder receives, override checking, example inputs.

Builders stay tiny and uniform because ``build`` does the bookkeeping (defaults, seeding, the device context)
once here; a builder only turns a ``Request`` into ``(module, args, kwargs)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from karma_fx.errors import KarmaError

SIZES = ("tiny", "real")


class ZooError(KarmaError, ValueError):
    """A zoo request the caller can fix: unknown model or size, an override the model does not take, …"""


@dataclass(frozen=True)
class Request:
    """Everything a builder needs, already resolved: no ``None`` left except ``seq`` for models without one.

    ``overrides`` holds only keys the model declared (``build`` checked them), so a builder can read them with
    ``opt(name, default)`` and never see a typo.
    """

    size: str
    batch: int
    seq: int | None
    device: torch.device
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tiny(self) -> bool:
        """True for the CPU-test size; builders branch on this rather than comparing strings everywhere."""
        return self.size == "tiny"

    def opt(self, name: str, default: Any) -> Any:
        """An override if the caller gave one, else the builder's default for this size."""
        return self.overrides.get(name, default)


def check_overrides(model: str, given: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    """Reject overrides a model does not understand, so a misspelt ``layer=`` fails loudly instead of silently
    building the default architecture (which would make a scaling study quietly wrong)."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise ZooError(f"zoo model {model!r} does not accept override(s) {unknown}; it accepts: {accepted}")


def positive_int(name: str, value: Any) -> int:
    """Validate a size-like override early: a zero or negative width gives a confusing error deep in nn."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ZooError(f"{name} must be a positive int, got {value!r}")
    return value


def heads_for(hidden: int, heads: int | None, head_dim: int) -> int:
    """Pick the attention head count: the caller's, else ``hidden // head_dim`` so that overriding only
    ``hidden`` in a scaling study keeps the head size fixed, as the published model families do."""
    if heads is None:
        heads = max(1, hidden // head_dim)
    positive_int("heads", heads)
    if hidden % heads:
        raise ZooError(f"hidden={hidden} is not divisible by heads={heads}; pass heads= explicitly")
    return heads


def images(req: Request, channels: int, side: int) -> torch.Tensor:
    """A float32 NCHW batch on the request's device (random values; on meta only the shape matters)."""
    return torch.randn(req.batch, channels, side, side, dtype=torch.float32, device=req.device)


def tokens(req: Request, vocab: int) -> torch.Tensor:
    """A ``[batch, seq]`` torch.long batch of token ids below ``vocab`` on the request's device."""
    assert req.seq is not None
    return torch.randint(0, vocab, (req.batch, req.seq), dtype=torch.long, device=req.device)
