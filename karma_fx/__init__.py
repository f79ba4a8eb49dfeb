"""karma_fx: an out-of-core training compiler for PyTorch.

``karma_fx.plan(model, args, budget=...)`` traces one training step and returns a ``Plan`` saying, tensor by
tensor, what stays on the device, what is offloaded and prefetched, and what is recomputed, with the simulated
step time and peak device memory.
"""
from karma_fx.errors import (
    BudgetError,
    InfeasibleBudgetError,
    InvalidPlanError,
    KarmaError,
    PlanFormatError,
    UnsupportedModelError,
)
from karma_fx.plan import Offload, Plan, Recompute

__all__ = [
    "BudgetError",
    "InfeasibleBudgetError",
    "InvalidPlanError",
    "KarmaError",
    "Offload",
    "Plan",
    "PlanFormatError",
    "Recompute",
    "UnsupportedModelError",
]

__version__ = "0.1.0"

from karma_fx.api import Planned, Prepared, plan, prepare  # noqa: E402
from karma_fx.compiler import KarmaModule, compile  # noqa: E402
from karma_fx.device import DeviceSpec, get_device  # noqa: E402

__all__ += ["DeviceSpec", "KarmaModule", "Planned", "Prepared", "compile", "get_device", "plan", "prepare"]
