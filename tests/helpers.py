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


def random_problem(n_layers: int, sizes: list[int], skips: list[int], times: list[float]) -> Problem:
    """A layered training step: forward a_i = f_i(a_{i-1}, a_{skip}, w), a loss, and a mirrored backward in
    which layer i's gradient reads its inputs (saved activations) and the incoming gradient."""
    ops: list[Op] = []
    storages: list[Storage] = []
    users: dict[str, list[int]] = {}

    def add(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], phase: str, flops: int = 1) -> None:
        for s in inputs:
            users.setdefault(s, []).append(len(ops))
        ops.append(Op(name, "f", phase, inputs, outputs, flops=flops))

    prev = "x"
    for i in range(n_layers):
        skip = f"a{skips[i]}" if 0 <= skips[i] < i - 1 else None
        add(f"f{i}", (prev, f"w{i}") + ((skip,) if skip else ()), (f"a{i}",), "fwd")
        prev = f"a{i}"
    add("loss", (prev,), ("L",), "fwd")
    nf = len(ops)
    grad = "t"
    for i in reversed(range(n_layers)):
        fwd_inputs = [s for s in ops[i].inputs if not s.startswith("w")]
        add(f"g{i}", tuple([grad] + fwd_inputs + [f"a{i}"]), (f"d{i}",), "bwd")
        add(f"gw{i}", (f"d{i}",) + tuple(fwd_inputs), (f"gw{i}",), "bwd")
        grad = f"d{i}"
    producer = {o: k for k, op in enumerate(ops) for o in op.outputs}
    storages.append(Storage("x", 64, "input", None, tuple(users.get("x", ()))))
    storages.append(Storage("t", 8, "tangent", None, tuple(users.get("t", ())), arrives_at=nf))
    for i in range(n_layers):
        storages.append(Storage(f"w{i}", 32, "param", None, tuple(users.get(f"w{i}", ()))))
        storages.append(Storage(f"a{i}", sizes[i], "activation", producer[f"a{i}"], tuple(users.get(f"a{i}", ()))))
        storages.append(Storage(f"d{i}", sizes[i], "temp", producer[f"d{i}"], tuple(users.get(f"d{i}", ()))))
        storages.append(Storage(f"gw{i}", 32, "gradient", producer[f"gw{i}"], (), is_output=True))
    storages.append(Storage("L", 8, "activation", producer["L"], (), is_output=True))
    cuts = tuple(i for i in range(n_layers) if not any(0 <= skips[j] < i for j in range(i + 1, n_layers)))
    return Problem(ops=tuple(ops), storages=tuple(storages), num_fwd_ops=nf, cut_points=cuts, name="random")


def random_costs(problem: Problem, times: list[float], bytes_per_us: float) -> Costs:
    op_time = tuple(times[k % len(times)] for k in range(len(problem.ops)))
    return Costs(op_time_us=op_time, d2h_bytes_per_us=bytes_per_us, h2d_bytes_per_us=bytes_per_us,
                 copy_latency_us=1.0, device="test")


def load_bench(name: str):
    """``bench/<name>.py`` as a module (registered under its name, so that its dataclasses resolve)."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
