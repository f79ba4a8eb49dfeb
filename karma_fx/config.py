"""``KarmaConfig``: everything that says how to plan, validated once, carried unchanged through ``karma_fx.plan``,
``karma_fx.compile`` and ``torch.compile(backend="karma", options=...)``.

Each entry point builds one from its arguments (the backend from its ``options`` dict, with the budget taken
from the ``KARMA_BUDGET`` environment variable where a framework passes no options), so a bad value fails
before any tracing, with the same message whichever door the user came through.

Example::

    config = KarmaConfig.make(budget="12GiB", strategy="greedy", device="h100")
    KarmaConfig.from_options({"budget": 0.5})
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from karma_fx.budget import Budget
from karma_fx.device import DeviceSpec, get_device
from karma_fx.errors import KarmaError
from karma_fx.strategies import DEFAULT_STRATEGY, STRATEGY_NAMES, Strategy

if TYPE_CHECKING:
    from karma_fx.pricing import Pricing

BUDGET_ENV = "KARMA_BUDGET"
PLAN_CACHE_ENV = "KARMA_PLAN_CACHE"
COMPILER_ENV = "KARMA_COMPILER"
OPTIONS = ("budget", "strategy", "device", "offload_weights", "time_limit_s", "plan_cache", "costs", "compiler",
           "loss_chunk")
"""The keys ``backend="karma"`` accepts in ``options``."""
COST_MODELS = ("roofline", "measured")
COMPILERS = ("eager", "inductor")
DEFAULT_COMPILER = "inductor"
"""``torch.compile``'s own: the planned step is the step users would otherwise run, Inductor's kernels with
the copies and waits kept where the plan put them. Where the model of its fusion falls short of what the
allocator measures, the measured step teaches a margin (``karma_fx.margin``). ``"eager"`` runs the graphs op
by op (debugging: every op a breakpoint), and is what runs with the gradient pipeline (``optimizer=`` or
``data_parallel=``), which Inductor does not compile."""


def default_compiler() -> str:
    """The compiler used where none is asked for: ``$KARMA_COMPILER`` if set (``inductor`` to run a whole job
    under Inductor, ``eager`` to debug one op by op, without touching its code), else ``DEFAULT_COMPILER``."""
    compiler = os.environ.get(COMPILER_ENV) or DEFAULT_COMPILER
    if compiler not in COMPILERS:
        raise KarmaError(f"${COMPILER_ENV} must be one of {', '.join(COMPILERS)} or unset, got {compiler!r}")
    return compiler


def resolve_compiler(compiler: Any) -> str:
    """``compiler`` as asked for (``None``: ``default_compiler()``), or a ``KarmaError`` naming the choices."""
    if compiler is None:
        return default_compiler()
    if not isinstance(compiler, str) or compiler not in COMPILERS:
        raise KarmaError(f"compiler must be one of {', '.join(repr(c) for c in COMPILERS)}, got {compiler!r}")
    return compiler


@dataclass(frozen=True)
class KarmaConfig:
    """How to plan: the budget, the strategy, the device whose costs are modelled, and the options."""

    budget: Budget
    strategy: "str | Strategy" = DEFAULT_STRATEGY
    device: DeviceSpec = field(default_factory=get_device)
    offload_weights: bool = False
    time_limit_s: float | None = None
    """Wall-clock limit for planning one region (capture excluded); the best plan found by then is used."""
    costs: str | None = None
    """``"roofline"``: op times from FLOPs and bytes on ``device`` (plan a device you do not have);
    ``"measured"``: the step's ops timed on the device it runs on, with the copy ops' measured speed; ``None``
    (the default): measured where the step runs on the machine planning it and no ``device`` preset was named,
    else roofline (``karma_fx.pricing``). Where the step runs here its kernels' scratch is measured either way."""
    device_named: bool = False
    """Whether ``device`` was asked for (a preset to plan for) rather than left to its default."""
    compiler: str = DEFAULT_COMPILER
    """What runs the planned forward and backward graphs: ``"inductor"`` (compiled by Inductor, the karma ops as
    extern kernels kept where the plan put them; the default) or ``"eager"`` (op by op, as ``aot_eager``)."""
    loss_chunk: int | None = None
    """The loss head (a cross-entropy over a linear layer's logits, ``karma_fx.passes.loss_head``): ``None`` (the
    default) lets the planner chunk it where that makes a better plan, ``0`` never chunks it, ``n`` always
    computes it ``n`` tokens at a time."""
    plan_cache: str | None = None
    """A directory where plans are saved, keyed by the captured graph, the device, the strategy and the
    budget, so that a restarted job reuses them instead of planning again (default ``$KARMA_PLAN_CACHE``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget, Budget):
            object.__setattr__(self, "budget", Budget.of(self.budget))
        strategy = self.strategy
        if isinstance(strategy, str):
            if strategy not in STRATEGY_NAMES:
                raise KarmaError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
        elif not callable(strategy):
            raise KarmaError(f"strategy must be one of {', '.join(STRATEGY_NAMES)} or a Strategy object "
                             f"(a callable with a name), got {strategy!r}")
        if not isinstance(self.device, DeviceSpec):
            object.__setattr__(self, "device", get_device(self.device))
        if not isinstance(self.offload_weights, bool):
            raise KarmaError(f"offload_weights must be True or False, got {self.offload_weights!r}")
        limit = self.time_limit_s
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Real)
                                  or not math.isfinite(float(limit)) or float(limit) <= 0):
            raise KarmaError(f"time_limit_s must be a positive number of seconds, got {limit!r}")
        if limit is not None:
            object.__setattr__(self, "time_limit_s", float(limit))
        else:  # the default limit's override: a bad one is said where the step is compiled, not at its first plan
            from karma_fx.strategies.cpsat.planner import check_time_limit_env

            check_time_limit_env()
        if self.costs is not None and self.costs not in COST_MODELS:
            raise KarmaError(f"costs must be one of {COST_MODELS} or None (the default: measured where the step "
                             f"runs here), got {self.costs!r}")
        if self.compiler is None or resolve_compiler(self.compiler) != self.compiler:  # None: only ``make``'s
            raise KarmaError(f"compiler must be one of {', '.join(repr(c) for c in COMPILERS)}, got None")
        chunk = self.loss_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
            raise KarmaError(f"loss_chunk must be None (the planner decides), 0 (never chunk the loss head) or a "
                             f"number of tokens per chunk, got {chunk!r}")
        cache = self.plan_cache if self.plan_cache is not None else os.environ.get(PLAN_CACHE_ENV) or None
        if cache is not None and not isinstance(cache, (str, os.PathLike)):
            raise KarmaError(f"plan_cache must be a directory path, got {cache!r}")
        object.__setattr__(self, "plan_cache", os.fspath(cache) if cache is not None else None)

    @classmethod
    def make(cls, *, budget: Any, strategy: Any = None, device: Any = None, offload_weights: Any = False,
             time_limit_s: Any = None, plan_cache: Any = None, costs: Any = None,
             compiler: Any = None, loss_chunk: Any = None) -> "KarmaConfig":
        """From keyword arguments as the public functions take them (``None`` means the default)."""
        return cls(budget=Budget.of(budget), strategy=DEFAULT_STRATEGY if strategy is None else strategy,
                   device=get_device(device), offload_weights=offload_weights, time_limit_s=time_limit_s,
                   plan_cache=plan_cache, costs=costs, device_named=device is not None,
                   compiler=resolve_compiler(compiler), loss_chunk=loss_chunk)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "KarmaConfig":
        """From ``torch.compile(backend="karma", options=...)``; the budget defaults to ``$KARMA_BUDGET``."""
        options = dict(options or {})
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise KarmaError(f"unknown karma backend options {sorted(unknown)}; known: {list(OPTIONS)}")
        if "budget" not in options:
            env = os.environ.get(BUDGET_ENV)
            if not env:
                raise KarmaError('torch.compile(backend="karma") needs a budget: options={"budget": "12GiB"} '
                                 '(bytes) or {"budget": 0.5} (a fraction of the unplanned peak), or set the '
                                 f"environment variable {BUDGET_ENV}")
            options["budget"] = env
        return cls.make(**options)

    def pricing(self, runs_here: bool) -> "Pricing":
        """How a step planned with this configuration is priced (``karma_fx.pricing.choose``)."""
        from karma_fx.pricing import choose

        return choose(self.costs, self.device if self.device_named else None, runs_here, self.compiler)

    def describe(self) -> str:
        name = self.strategy if isinstance(self.strategy, str) else getattr(self.strategy, "name", "custom")
        device = self.device.name if self.device_named else "the one it runs on"
        return f"budget {self.budget}, strategy {name}, device {device}, compiler {self.compiler}"
