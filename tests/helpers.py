"""Hand-built problems with numbers small enough to check by hand."""
from __future__ import annotations

from karma_fx.costs import Costs
from karma_fx.problem import Op, Problem, Storage


def chain_problem() -> Problem:
    """x, w → f0 → A → f1 → B → loss; backward b2 (B, tangent) → gB; b1 (gB, A, w) → gA; gw (gA, x) → gW.

    Sizes: x 10, w 100, A 1000, B 1000, L 4, tangent 4, gB 1000, gA 1000, gW 100 bytes.
    """
    ops = (
        Op("f0", "f", "fwd", ("x", "w"), ("A",), flops=10),
        Op("f1", "f", "fwd", ("A", "w"), ("B",), flops=10),
        Op("loss", "l", "fwd", ("B",), ("L",), flops=10),
        Op("b2", "g", "bwd", ("B", "t"), ("gB",), flops=10),
        Op("b1", "g", "bwd", ("gB", "A", "w"), ("gA",), flops=10),
        Op("gw", "g", "bwd", ("gA", "x"), ("gW",), flops=10),
    )
    storages = (
        Storage("x", 10, "input", None, (0, 5)),
        Storage("w", 100, "param", None, (0, 1, 4)),
        Storage("t", 4, "tangent", None, (3,), arrives_at=3),
        Storage("A", 1000, "activation", 0, (1, 4)),
        Storage("B", 1000, "activation", 1, (2, 3)),
        Storage("L", 4, "activation", 2, (), is_output=True),
        Storage("gB", 1000, "temp", 3, (4,)),
        Storage("gA", 1000, "temp", 4, (5,)),
        Storage("gW", 100, "gradient", 5, (), is_output=True),
    )
    return Problem(ops=ops, storages=storages, num_fwd_ops=3, cut_points=(0, 1, 2), name="chain")


def flat_costs(problem: Problem, op_us: float = 10.0, bytes_per_us: float = 100.0, latency_us: float = 0.0) -> Costs:
    return Costs(op_time_us=tuple(op_us for _ in problem.ops), d2h_bytes_per_us=bytes_per_us,
                 h2d_bytes_per_us=bytes_per_us, copy_latency_us=latency_us, device="test")
