"""``keep``: nothing moves. The unplanned step; its peak is what budgets are fractions of."""
from __future__ import annotations

from karma_fx.costs import Costs
from karma_fx.plan import Plan
from karma_fx.problem import Problem


class Keep:
    name = "keep"

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        return Plan(strategy=self.name, budget_bytes=budget_bytes, status="KEEP")
