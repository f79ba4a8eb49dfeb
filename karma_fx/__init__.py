"""karma_fx: an out-of-core training compiler for PyTorch.

``karma_fx.plan(model, args, budget=...)`` traces one training step and returns a ``Plan`` saying, tensor by
tensor, what stays on the device, what is offloaded and prefetched, and what is recomputed, with the simulated
step time and peak device memory; ``karma_fx.compile(model, budget=...)`` trains with it.

The entry points that need torch (``plan``, ``prepare``, ``compile``, ``DeviceSpec``, ...) load it on first use
(PEP 562): importing the package, as the ``karma-fx`` command does first thing, stays quick, so a Ctrl-C in the
first second reaches the command's own handler instead of interrupting torch's import.
"""
from typing import Any

from karma_fx.errors import (
    BudgetError,
    InfeasibleBudgetError,
    InvalidPlanError,
    KarmaError,
    PlanFormatError,
    UnsupportedModelError,
)
from karma_fx.plan import Offload, Plan, Recompute  # also binds the submodule karma_fx.plan, rebound below

__version__ = "0.1.0"

_LAZY = {
    "Planned": "karma_fx.api", "Prepared": "karma_fx.api", "prepare": "karma_fx.api",
    "KarmaModule": "karma_fx.compiler", "compile": "karma_fx.compiler",
    "DeviceSpec": "karma_fx.device", "get_device": "karma_fx.device",
}


def plan(*args: Any, **kwargs: Any) -> Plan:
    """``karma_fx.api.plan``: plan one training step (see there). A function of its own here because the
    submodule ``karma_fx.plan`` (the ``Plan`` record) has the same name."""
    from karma_fx.api import plan as plan_step

    return plan_step(*args, **kwargs)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'karma_fx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BudgetError", "DeviceSpec", "InfeasibleBudgetError", "InvalidPlanError", "KarmaError", "KarmaModule",
    "Offload", "Plan", "PlanFormatError", "Planned", "Prepared", "Recompute", "UnsupportedModelError", "compile",
    "get_device", "plan", "prepare",
]
