"""Ground truth for every memory claim: the simulator's profile of the unplanned step equals a real run.

Each tiny zoo model's joint graph is executed for real on the CPU while the bytes of live storages are
counted node by node (``passes/measure.py``); the simulator's device bytes for the "keep" plan must equal
that count at every op and at the peak, to the byte.
"""
from __future__ import annotations

import pytest

from karma_fx.passes.measure import measure_step
from karma_fx.simulate import simulate
from karma_fx.zoo import names

from conftest import prepared, tiny


@pytest.mark.parametrize("name", names())
def test_keep_profile_matches_real_run_to_the_byte(name):
    prep = prepared(name)
    model, args, kwargs = tiny(name)
    measured = measure_step(prep.step, model, args, kwargs)
    timeline = simulate(prep.problem, (), prep.costs)
    assert timeline.peak_bytes == measured.peak_bytes
    simulated = {op.name: bytes_ for op, (_, bytes_) in zip(prep.problem.ops, timeline.memory)}
    mismatched = {n: (simulated[n], measured.live_bytes[n]) for n in simulated if simulated[n] != measured.live_bytes[n]}
    assert not mismatched, f"{len(mismatched)} ops differ, e.g. {list(mismatched.items())[:3]}"


def test_measurement_sees_parameters_gradients_and_activations():
    """The measurement is not trivially equal: it grows with the batch (activations) and counts weights."""
    import karma_fx
    from karma_fx.zoo import build

    small = build("mlp", "tiny", batch=4)
    big = build("mlp", "tiny", batch=64)
    peaks = []
    for model, args, kwargs in (small, big):
        prep = karma_fx.prepare(model, args, kwargs)
        peaks.append(measure_step(prep.step, model, args, kwargs).peak_bytes)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert peaks[-1] > 2 * param_bytes  # weights and their gradients at least
    assert peaks[1] > peaks[0]
