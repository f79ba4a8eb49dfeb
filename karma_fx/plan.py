"""The plan: what every strategy returns and what the rewrite consumes.

A ``Plan`` is a frozen, JSON-serialisable record keyed by graph node names, so it can be printed, saved, diffed
and replayed against the same model. Decisions say *what* moves and *when* (in terms of op positions); the
simulated figures (peak, step time, per-op schedule) are filled in by ``karma_fx.simulate`` so every strategy's
numbers come from the same oracle.

Example::

    plan = Plan(strategy="keep", budget_bytes=1 << 30)
    assert Plan.from_json(plan.to_json()) == plan
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

SCHEMA_VERSION = 2
"""2 added the weights-out-of-core decisions (``stream_weight``, ``grad_to_host``)."""
READABLE_VERSIONS = (1, 2)
"""Version 1 plans (offload / recompute only) are still valid version 2 plans."""


@dataclass(frozen=True)
class Offload:
    """Copy ``tensor`` to host, drop it from the device, copy it back before it is needed again."""

    tensor: str
    offload_after: str
    """Op after which the device→host copy is issued (the producer or later)."""
    free_after: str
    """Last op that reads the tensor before the gap; its device copy is dropped after it (once the copy landed)."""
    prefetch_at: str
    """Op at whose start the host→device copy is issued (the device buffer is allocated then)."""
    reload_before: str
    """First op that reads the tensor after the gap; compute waits for the copy before it."""
    release_before: str | None = None
    """If set, compute waits before this op until the device→host copy has landed, so the device bytes are
    surely free from there on (a swap-out that must finish to make room). ``None``: never wait for it."""


@dataclass(frozen=True)
class Recompute:
    """Drop ``tensors`` after their last use before ``reload_before``; re-run ``ops`` just before it."""

    tensors: tuple[str, ...]
    ops: tuple[str, ...]
    """Op names re-executed in order; their inputs must be resident, or made earlier in the same chain."""
    reload_before: str


@dataclass(frozen=True)
class Window:
    """One stay of a host-resident parameter on the device."""

    prefetch_at: str
    """Op at whose start the host→device copy is issued."""
    reload_before: str
    """First op of the window that reads the parameter; compute waits for the copy before it."""
    free_after: str
    """Last op of the window that reads it; the device copy is dropped after it."""


@dataclass(frozen=True)
class StreamWeight:
    """A parameter that lives in host memory: copied to the device for each window of uses, dropped after
    (KARMA's weights out of core: one window for its forward uses, one for its backward uses)."""

    tensor: str
    windows: tuple[Window, ...]


@dataclass(frozen=True)
class GradToHost:
    """A parameter gradient copied to host memory as soon as it is produced; its device copy is dropped once
    the copy lands, and the step returns the host copy."""

    tensor: str


Decision = Union[Offload, Recompute, StreamWeight, GradToHost]


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


@dataclass(frozen=True)
class Plan:
    """A strategy's answer for one model, device and budget, with the simulator's verdict on it."""

    strategy: str
    budget_bytes: int
    decisions: tuple[Decision, ...] = ()
    status: str = "HEURISTIC"
    """KEEP / HEURISTIC / OPTIMAL / FEASIBLE (solver, with its bound) / FALLBACK."""
    model: str = ""
    device: str = ""
    peak_bytes: int | None = None
    step_time_us: float | None = None
    unlimited_step_time_us: float | None = None
    unplanned_peak_bytes: int | None = None
    host_peak_bytes: int | None = None
    lower_bound_us: float | None = None
    predicted_step_time_us: float | None = None
    """The solver's own prediction of the step time (exact planners only); the simulator's is ``step_time_us``."""
    notes: tuple[str, ...] = ()
    schedule: tuple[ScheduleRow, ...] = ()

    # ---- derived views -------------------------------------------------------------------------------
    @property
    def offloads(self) -> tuple[Offload, ...]:
        return tuple(d for d in self.decisions if isinstance(d, Offload))

    @property
    def recomputes(self) -> tuple[Recompute, ...]:
        return tuple(d for d in self.decisions if isinstance(d, Recompute))

    @property
    def streamed_weights(self) -> tuple[StreamWeight, ...]:
        return tuple(d for d in self.decisions if isinstance(d, StreamWeight))

    @property
    def grads_to_host(self) -> tuple[GradToHost, ...]:
        return tuple(d for d in self.decisions if isinstance(d, GradToHost))

    @property
    def slowdown(self) -> float | None:
        """Simulated step time over the unlimited-memory step time (1.0 = no cost)."""
        if self.step_time_us is None or not self.unlimited_step_time_us:
            return None
        return self.step_time_us / self.unlimited_step_time_us

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None and self.peak_bytes <= self.budget_bytes

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    def table(self, max_rows: int | None = 60) -> str:
        """The schedule as a text table (tabulate) with a summary; see ``karma_fx.report``."""
        from karma_fx.report import plan_table

        return plan_table(self, max_rows=max_rows)

    # ---- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "decisions":
                value = [_decision_to_dict(d) for d in value]
            elif f.name == "schedule":
                value = [dataclasses.asdict(r) for r in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        from karma_fx.errors import PlanFormatError

        if not isinstance(data, dict):
            raise PlanFormatError(f"a plan is a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise PlanFormatError(f"plan schema_version {version!r} is not one of {READABLE_VERSIONS}; "
                                  "re-plan the model")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"schema_version"}
        if unknown:
            raise PlanFormatError(f"unknown plan fields: {sorted(unknown)}")
        kwargs = {k: v for k, v in data.items() if k in names}
        try:
            kwargs["decisions"] = tuple(_decision_from_dict(d) for d in kwargs.get("decisions", ()))
            kwargs["schedule"] = tuple(
                ScheduleRow(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})
                for r in kwargs.get("schedule", ())
            )
            kwargs["notes"] = tuple(kwargs.get("notes", ()))
            plan = cls(**kwargs)
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise PlanFormatError(f"malformed plan: {exc}") from exc
        _check_types(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        from karma_fx.errors import PlanFormatError

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())


_KINDS = {"offload": "Offload", "recompute": "Recompute", "stream_weight": "StreamWeight",
          "grad_to_host": "GradToHost"}


def _decision_to_dict(d: Decision) -> dict[str, Any]:
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(d).items()}
    kind = next(k for k, cls in _KINDS.items() if cls == type(d).__name__)
    return {"kind": kind, **body}


def _check_types(plan: Plan) -> None:
    """Reject a plan whose fields have the wrong types (hand-edited JSON), naming the field."""
    from karma_fx.errors import PlanFormatError

    if not isinstance(plan.strategy, str) or not isinstance(plan.budget_bytes, int) or isinstance(plan.budget_bytes, bool):
        raise PlanFormatError("malformed plan: strategy must be a string and budget_bytes an integer")
    for d in plan.decisions:
        if isinstance(d, (StreamWeight, GradToHost)):
            windows = d.windows if isinstance(d, StreamWeight) else ()
            names = (d.tensor,) + tuple(getattr(w, f.name) for w in windows for f in dataclasses.fields(Window))
            if not all(isinstance(n, str) for n in names) or not all(isinstance(w, Window) for w in windows):
                raise PlanFormatError(f"malformed plan: decision {d} must name tensors and ops with strings")
            continue
        names = (d.tensors + d.ops + (d.reload_before,)) if isinstance(d, Recompute) else tuple(
            getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "release_before") + (
            (d.release_before,) if d.release_before is not None else ())
        if not all(isinstance(n, str) for n in names):
            raise PlanFormatError(f"malformed plan: decision {d} must name tensors and ops with strings")


def _decision_from_dict(data: dict[str, Any]) -> Decision:
    if not isinstance(data, dict):
        raise TypeError(f"a decision is a JSON object, got {data!r}")
    data = dict(data)
    kind = data.pop("kind")
    if kind == "offload":
        return Offload(**data)
    if kind == "recompute":
        if not isinstance(data["tensors"], list) or not isinstance(data["ops"], list):
            raise TypeError("recompute tensors and ops must be lists")
        return Recompute(tensors=tuple(data["tensors"]), ops=tuple(data["ops"]), reload_before=data["reload_before"])
    if kind == "stream_weight":
        if not isinstance(data["windows"], list) or not all(isinstance(w, dict) for w in data["windows"]):
            raise TypeError("stream_weight windows must be a list of objects")
        return StreamWeight(tensor=data["tensor"], windows=tuple(Window(**w) for w in data["windows"]))
    if kind == "grad_to_host":
        return GradToHost(**data)
    raise KeyError(f"decision kind {kind!r}")
