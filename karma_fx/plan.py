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
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from karma_fx.budget import format_bytes
from karma_fx.errors import InvalidPlanError, PlanFormatError
from karma_fx.schedule import MAX_NAMES, ScheduleRow, schedule_table


class PlanValueError(PlanFormatError, InvalidPlanError):
    """A saved plan whose field holds a value no plan can have: a negative byte count or time, a recompute
    group without ops. Both a malformed file (``PlanFormatError``, like every other unreadable plan) and an
    invalid plan (``InvalidPlanError``), so either ``except`` catches it."""


SCHEMA_VERSION = 6
"""2 added the weights-out-of-core decisions (``stream_weight``, ``grad_to_host``); 3 the wait of a gradient's
copy (``grad_to_host.release_before``) and streams of a weight's bf16 cast or a gradient sent narrow
(``karma_fx.wire``), which a version 2 reader would misread; 4 kernels split along the batch (``splits``),
which a version 3 reader would ignore and so run over the plan's peak; 5 offloads of tensors the backward
makes (``leanest.backward_swaps``), which a version 4 rewrite cannot place; 6 backward loops joined to a recompute
chain (``Recompute.joins``), whose replay a version 5 simulator would count elsewhere."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
"""Plans of earlier versions are still valid plans of this one, with the same meaning."""
OPTIMAL_TOLERANCE = 1e-3
"""A step within this fraction of its proven lower bound is shown as plainly OPTIMAL (``Plan.shown_status``)."""


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
    joins: tuple[str, ...] = ()
    """Backward loop ops that run with the chain, moved from after ``reload_before`` to just after the chain so
    that Inductor fuses them with it (``karma_fx.joins``); empty op by op."""


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
    release_before: str | None = None
    """Op before which compute waits for the copy to land (``wait_where_copies_land`` puts it where the replay
    has it landed): a copy engine running late then stalls compute instead of holding the gradient's device
    bytes past where the plan freed them. ``None``: freed whenever the copy is seen done."""


Decision = Union[Offload, Recompute, StreamWeight, GradToHost]


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
    loss_chunk: int = 0
    """Tokens per chunk of the chunked loss head (``karma_fx.loss_ops``), which the step is traced with and the
    decisions name nodes of; 0: the loss head as the model computes it."""
    splits: tuple[tuple[str, int], ...] = ()
    """Ops run a piece of the batch at a time, each with its number of pieces (``karma_fx.split``): their
    kernels' scratch is a piece's. The decisions are planned on the step so run (``split_problem``)."""

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

    def table(self, max_rows: int | None = 60, *, max_names: int | None = MAX_NAMES, tablefmt: str = "simple") -> str:
        """The schedule, one row per op where something happens (``karma_fx.schedule.schedule_table``), then
        the ``summary``. Only the plan's own fields are read, so a plan loaded with ``Plan.load`` prints exactly
        as it did when it was made."""
        return schedule_table(self.schedule, self.summary(), max_rows, max_names=max_names, tablefmt=tablefmt)

    def shown_status(self) -> str:
        """``status`` as the tables show it. OPTIMAL is CP-SAT's word for the model it solved (the tensors it
        decided on, the copy and release points it considers, its own timing; or one repeated block), not for
        every possible plan: unless the simulated step meets the proven lower bound, the text says so and how
        far above the bound the plan is (a plan 2.2x above its bound shown as plain OPTIMAL misled readers)."""
        status, step, bound = self.status, self.step_time_us, self.lower_bound_us
        if "OPTIMAL" not in status or step is None:
            return status
        if bound is None or bound <= 0:
            return f"{status} within the solver's model; no proven lower bound to compare with"
        ratio = step / bound
        if ratio <= 1 + OPTIMAL_TOLERANCE:
            return status
        above = f"{ratio - 1:.1%} above" if ratio < 1.1 else f"{ratio:.2f}x"
        return f"{status} within the solver's model only; {above} the proven lower bound"

    def summary(self) -> list[tuple[str, str]]:
        """Key/value lines under the table; every simulated field may be ``None`` (an unsimulated plan)."""
        lines: list[tuple[str, str]] = [("strategy", f"{self.strategy} ({self.shown_status()})")]
        lines.append(("model", self.model or _DASH))
        lines.append(("device", self.device or _DASH))
        step = _ms(self.step_time_us)
        if self.slowdown is not None:
            step += f"  ({self.slowdown:.3f}x the unlimited-memory {_ms(self.unlimited_step_time_us)})"
        lines.append(("step time", step))
        if self.lower_bound_us is not None:
            lines.append(("lower bound", _ms(self.lower_bound_us)))
        stall_us = sum(r.stall_us for r in self.schedule)
        if stall_us:
            lines.append(("stalls", _ms(stall_us)))
        peak = f"{format_bytes(self.peak_bytes)} of {format_bytes(self.budget_bytes)} budget"
        if self.peak_bytes is None:
            peak += " (not simulated)"
        elif self.fits:
            peak += " (fits)"
        else:
            peak += f" (OVER by {format_bytes(self.peak_bytes - self.budget_bytes)})"
        if self.unplanned_peak_bytes:
            peak += f"; unplanned peak {format_bytes(self.unplanned_peak_bytes)}"
            if self.peak_bytes is not None:
                peak += f" ({self.peak_bytes / self.unplanned_peak_bytes:.0%})"
        lines.append(("peak", peak))
        lines.append(("host memory", format_bytes(self.host_peak_bytes)))
        n_recomputed = sum(len(r.tensors) for r in self.recomputes)
        lines.append(("decisions", f"{_count(len(self.offloads), 'offload')}, "
                                   f"{_count(len(self.recomputes), 'recompute group')} "
                                   f"({_count(n_recomputed, 'tensor')} recomputed)"
                                   + (f", {_count(len(self.streamed_weights), 'weight')} streamed from the host, "
                                      f"{_count(len(self.grads_to_host), 'gradient')} sent to it"
                                      if self.streamed_weights or self.grads_to_host else "")))
        if self.loss_chunk:
            lines.append(("loss head", f"chunked, {self.loss_chunk} tokens at a time"))
        if self.splits:
            lines.append(("kernels split", ", ".join(f"{name} in {k} pieces" for name, k in self.splits)))
        lines += [("notes" if i == 0 else "", note) for i, note in enumerate(self.notes)]
        return lines

    # ---- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "decisions":
                value = [_decision_to_dict(d) for d in value]
            elif f.name == "schedule":
                value = [dataclasses.asdict(r) for r in value]
            elif f.name == "splits":
                value = [[name, k] for name, k in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """The plan ``to_dict`` wrote. Every field's type is checked first (a hand-edited or truncated file must
        not surface later as a deep error in the rewrite), then every tensor may be moved by one decision only."""
        if not isinstance(data, dict):
            raise PlanFormatError(f"a plan is a JSON object, got {type(data).__name__}; pass what Plan.to_dict "
                                  "or Plan.save wrote")
        version = data.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise PlanFormatError(f"plan schema_version {version!r} is not one of {READABLE_VERSIONS}; "
                                  "re-plan the model")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"schema_version"}
        if unknown:
            raise PlanFormatError(f"unknown plan fields: {sorted(unknown)}; remove them or re-plan the model")
        kwargs = {k: v for k, v in data.items() if k in names}
        _check_record(kwargs, cls, "plan")
        _check_ranges(kwargs, "plan")
        for i, row in enumerate(kwargs.get("schedule", ())):
            _check_ranges(row, f"schedule[{i}]")
        kwargs["decisions"] = tuple(_decision_from_dict(d, f"decisions[{i}]")
                                    for i, d in enumerate(kwargs.get("decisions", ())))
        kwargs["schedule"] = tuple(ScheduleRow(**{k: tuple(v) if isinstance(v, (list, tuple)) else v
                                                  for k, v in r.items()})
                                   for r in kwargs.get("schedule", ()))
        kwargs["notes"] = tuple(kwargs.get("notes", ()))
        kwargs["splits"] = tuple((name, k) for name, k in kwargs.get("splits", ()))
        plan = cls(**kwargs)
        _check_one_decision_per_tensor(plan.decisions)
        split_ops = [name for name, _ in plan.splits]
        if len(set(split_ops)) != len(split_ops):
            raise PlanValueError("malformed plan: splits names an op twice; fix the file or re-plan the model")
        return plan

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        try:
            data = json.loads(text)
        except UnicodeDecodeError as exc:
            raise PlanFormatError(f"plan is not UTF-8 text ({exc.reason} at byte {exc.start}); pass the JSON file "
                                  "that Plan.save wrote") from None
        except ValueError as exc:  # json.JSONDecodeError
            raise PlanFormatError(f"plan is not valid JSON: {exc}; pass the file that Plan.save wrote") from None
        except RecursionError:
            raise PlanFormatError("plan is not a plan: its JSON is nested too deeply to read; pass the file that "
                                  "Plan.save wrote") from None
        except TypeError as exc:
            raise PlanFormatError(f"a plan is JSON text, got {type(text).__name__}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by ``save``; any unreadable file is a ``PlanFormatError`` naming the path."""
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise PlanFormatError(f"no plan file at {str(path)!r}; check the path") from None
        except OSError as exc:
            raise PlanFormatError(f"cannot read the plan file {str(path)!r}: {exc.strerror or exc}") from None
        try:
            return cls.from_json(raw)
        except PlanFormatError as exc:
            raise type(exc)(f"{path}: {exc}") from None  # keep the class: a PlanValueError stays one


_DASH = "-"


def _ms(us: float | None) -> str:
    return _DASH if us is None else f"{us / 1e3:,.3f} ms"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


_KINDS = {"offload": "Offload", "recompute": "Recompute", "stream_weight": "StreamWeight",
          "grad_to_host": "GradToHost"}


def _decision_to_dict(d: Decision) -> dict[str, Any]:
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(d).items()
            if not (k == "joins" and not v)}  # a plan without joins reads as it did before they existed
    kind = next(k for k, cls in _KINDS.items() if cls == type(d).__name__)
    return {"kind": kind, **body}


# ---- reading JSON back: types checked field by field ---------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a byte count


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_strings(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)


def _is_splits(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(
        isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) and _is_int(x[1]) and x[1] >= 1
        for x in v)


def _is_records(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, dict) for x in v)


_CHECKS: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "float": (_is_number, "a number"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "int | None": (lambda v: v is None or _is_int(v), "an integer or null"),
    "float | None": (lambda v: v is None or _is_number(v), "a number or null"),
    "tuple[str, ...]": (_is_strings, "a list of strings"),
    "tuple[Decision, ...]": (_is_records, "a list of objects"),
    "tuple[ScheduleRow, ...]": (_is_records, "a list of objects"),
    "tuple[Window, ...]": (_is_records, "a list of objects"),
    "tuple[tuple[str, int], ...]": (_is_splits, "a list of [op name, pieces >= 1] pairs"),
}
"""Annotation (as written in the dataclasses above) → its JSON check. A field with an annotation missing here
fails ``_SHAPES`` at import, so a new field cannot silently go unchecked."""


def _shape(cls: type) -> dict[str, tuple[Any, str, bool]]:
    """Each field of ``cls``: (check, what it must be, required)."""
    return {f.name: (*_CHECKS[str(f.type)],
                     f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


_SHAPES = {cls: _shape(cls) for cls in (Plan, Offload, Recompute, Window, StreamWeight, GradToHost, ScheduleRow)}


def _check_record(data: dict[str, Any], cls: type, where: str) -> None:
    """Reject a missing, unknown or wrongly typed field of ``cls`` in ``data``, naming it by its path."""
    shape = _SHAPES[cls]
    unknown = sorted(set(data) - set(shape))
    if unknown:
        raise PlanFormatError(f"malformed plan: {where} has unknown fields {unknown}; fix the file or re-plan "
                              "the model")
    for name, (check, expected, required) in shape.items():
        if name not in data:
            if required:
                raise PlanFormatError(f"malformed plan: {where} lacks {name!r}; fix the file or re-plan the model")
            continue
        if not check(data[name]):
            raise PlanFormatError(f"malformed plan: {where}.{name} must be {expected}, got {data[name]!r:.80}; "
                                  "fix the file or re-plan the model")
    for i, row in enumerate(data.get("schedule", ()) if cls is Plan else ()):
        _check_record(row, ScheduleRow, f"schedule[{i}]")


_NON_NEGATIVE = ("budget_bytes", "loss_chunk", "peak_bytes", "unplanned_peak_bytes", "host_peak_bytes", "step_time_us",
                 "unlimited_step_time_us", "lower_bound_us", "predicted_step_time_us", "device_bytes", "stall_us")
"""Byte counts and times, of the plan and of its schedule rows: none can be negative, infinite or NaN (JSON
as Python writes it may hold ``NaN`` and ``Infinity``), and the rewrite and the tables would compute with
them as if they were real."""


def _check_ranges(data: dict[str, Any], where: str) -> None:
    """Refuse a number no plan can hold in a record whose types ``_check_record`` already checked."""
    for name in _NON_NEGATIVE:
        value = data.get(name)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise PlanValueError(f"malformed plan: {where}.{name} must be a finite number >= 0, got {value!r}; fix "
                                 "the file or re-plan the model")


def _check_one_decision_per_tensor(decisions: tuple[Decision, ...]) -> None:
    """Two decisions about one tensor (offloaded twice, offloaded and recomputed, in two recompute chains)
    contradict each other: the rewrite would free or rebuild it twice."""
    seen: dict[str, int] = {}
    for i, d in enumerate(decisions):
        for tensor in (d.tensors if isinstance(d, Recompute) else (d.tensor,)):
            if tensor in seen:
                where = f"decisions {seen[tensor]} and {i}" if seen[tensor] != i else f"decision {i}"
                raise PlanFormatError(f"malformed plan: {where} both move tensor {tensor!r}; keep one decision per "
                                      "tensor or re-plan the model")
            seen[tensor] = i


def _decision_from_dict(data: Any, where: str) -> Decision:
    if not isinstance(data, dict):
        raise PlanFormatError(f"malformed plan: {where} must be an object, got {data!r:.80}; fix the file or "
                              "re-plan the model")
    body = dict(data)
    kind = body.pop("kind", None)
    if not isinstance(kind, str) or kind not in _KINDS:
        raise PlanFormatError(f"malformed plan: {where}.kind is {kind!r:.40}, not one of {sorted(_KINDS)}; fix the "
                              "file or re-plan the model")
    cls = {"Offload": Offload, "Recompute": Recompute, "StreamWeight": StreamWeight,
           "GradToHost": GradToHost}[_KINDS[kind]]
    where = f"{where} ({kind})"
    _check_record(body, cls, where)
    if cls is Recompute:
        for name in ("tensors", "ops"):
            if not body[name]:
                raise PlanValueError(f"malformed plan: {where}.{name} is empty: a recompute group drops at least "
                                     "one tensor and re-runs at least one op; fix the file or re-plan the model")
    if cls is StreamWeight:
        for j, w in enumerate(body["windows"]):
            _check_record(w, Window, f"{where}.windows[{j}]")
        body["windows"] = tuple(Window(**w) for w in body["windows"])
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()})
