"""Roofline cost model and device presets on hand-built problems."""
from __future__ import annotations

import dataclasses
import math

import pytest

from karma_fx.errors import KarmaError
import torch
from hypothesis import given
from hypothesis import strategies as st

from karma_fx.costs import Costs, estimate_costs, op_time_us
from karma_fx.device import PRESETS, DeviceSpec, calibrate, get_device
from karma_fx.problem import Op, Problem, Storage

# 100 TFLOP/s fp32 at 50% efficiency = 50 TFLOP/s effective = 5e7 FLOP/us; 1 TB/s = 1e6 B/us.
TOY = DeviceSpec(
    name="toy", memory_bytes=1 << 30, peak_flops={"float32": 100e12, "bfloat16": 400e12},
    hbm_bytes_per_s=1e12, d2h_bytes_per_s=10e9, h2d_bytes_per_s=20e9, copy_latency_us=5.0,
    kernel_overhead_us=3.0, link="test", efficiency=0.5,
)


def toy_problem() -> Problem:
    m = n = k = 1024
    matmul = Op("mm", "aten.mm.default", "fwd", ("a", "w"), ("y",), flops=2 * m * n * k,
                bytes_accessed=3 * m * n * 4)
    relu = Op("relu", "aten.relu.default", "fwd", ("y",), ("z",), flops=m * n, bytes_accessed=2 * m * n * 4)
    bf16_mm = Op("mm16", "aten.mm.default", "bwd", ("z", "w"), ("g",), flops=2 * m * n * k,
                 bytes_accessed=3 * m * n * 2, dtype="bfloat16")
    fp16_mm = Op("mm_half", "aten.mm.default", "bwd", ("z", "w"), ("h",), flops=2 * m * n * k,
                 bytes_accessed=3 * m * n * 2, dtype="float16")
    nothing = Op("noop", "aten.view.default", "bwd", ("g",), ("v",))
    size = m * n * 4
    storages = (
        Storage("a", size, "input", None, (0,)),
        Storage("w", size, "param", None, (0, 2, 3)),
        Storage("y", size, "activation", 0, (1,)),
        Storage("z", size, "activation", 1, (2, 3)),
        Storage("g", size // 2, "gradient", 2, (4,), is_output=True),
        Storage("h", size // 2, "gradient", 3, (), is_output=True),
        Storage("v", size // 2, "temp", 4, ()),
    )
    return Problem(ops=(matmul, relu, bf16_mm, fp16_mm, nothing), storages=storages, num_fwd_ops=2)


def test_exact_times_on_hand_made_device():
    costs = estimate_costs(toy_problem(), TOY)
    flops = 2 * 1024**3
    # matmul-bound: 2.147e9 FLOP / (100e12 * 0.5) s = 42.949... us (memory would be 12.58 us)
    assert costs.op_time_us[0] == pytest.approx(3.0 + flops / 50e12 * 1e6, rel=1e-12)
    assert costs.op_time_us[0] == pytest.approx(3.0 + 42.94967296, rel=1e-9)
    # bandwidth-bound: 8 MiB / 1 TB/s = 8.388608 us (compute would be 0.02 us)
    assert costs.op_time_us[1] == pytest.approx(3.0 + 8.388608, rel=1e-12)
    # bf16 uses its own peak: 2.147e9 / 200e12 s = 10.737 us (memory 6.29 us)
    assert costs.op_time_us[2] == pytest.approx(3.0 + flops / 200e12 * 1e6, rel=1e-12)
    # float16 has no entry on this device: falls back to the float32 rate
    assert costs.op_time_us[3] == pytest.approx(costs.op_time_us[0], rel=1e-12)
    assert costs.op_time_us[4] == 0.0
    assert costs.compute_time_us == pytest.approx(sum(costs.op_time_us))
    assert costs.device == "toy"
    assert costs.d2h_bytes_per_us == pytest.approx(10e3) and costs.h2d_bytes_per_us == pytest.approx(20e3)
    assert costs.copy_latency_us == 5.0
    assert len(costs.op_time_us) == len(toy_problem().ops)


def test_op_time_formula():
    assert op_time_us(0, 0, "float32", TOY) == 0.0
    assert op_time_us(0, 1_000_000, "float32", TOY) == pytest.approx(4.0)  # 1 MB at 1 TB/s = 1 us + 3 us
    assert op_time_us(5 * 10**7, 0, "float32", TOY) == pytest.approx(4.0)  # 5e7 FLOP at 5e7 FLOP/us
    assert op_time_us(5 * 10**7, 0, "torch.float32", TOY) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        op_time_us(-1, 0, "float32", TOY)


def test_copy_time():
    costs = Costs(op_time_us=(1.0, 2.0), d2h_bytes_per_us=1000.0, h2d_bytes_per_us=4000.0, copy_latency_us=10.0,
                  device="x")
    assert costs.copy_time_us(0, "d2h") == 0.0
    assert costs.copy_time_us(0, "h2d") == 0.0
    assert costs.copy_time_us(8000, "d2h") == pytest.approx(18.0)
    assert costs.copy_time_us(8000, "h2d") == pytest.approx(12.0)
    assert costs.compute_time_us == 3.0
    with pytest.raises(ValueError):
        costs.copy_time_us(10, "sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        costs.copy_time_us(-1, "d2h")
    with pytest.raises(ValueError):
        Costs(op_time_us=(1.0,), d2h_bytes_per_us=0.0, h2d_bytes_per_us=1.0, copy_latency_us=0.0, device="x")
    with pytest.raises(ValueError):
        Costs(op_time_us=(float("nan"),), d2h_bytes_per_us=1.0, h2d_bytes_per_us=1.0, copy_latency_us=0.0,
              device="x")


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.sampled_from(["d2h", "h2d"]))
def test_copy_time_monotone(a, b, direction):
    costs = estimate_costs(toy_problem(), "a100")
    lo, hi = sorted((a, b))
    assert costs.copy_time_us(lo, direction) <= costs.copy_time_us(hi, direction)
    if lo > 0:
        assert costs.copy_time_us(lo, direction) >= costs.copy_latency_us


def test_deterministic_and_hashable():
    first = estimate_costs(toy_problem(), "h100")
    assert first == estimate_costs(toy_problem(), "h100")
    assert first == estimate_costs(toy_problem(), None)  # h100 is the default
    assert hash(first) == hash(estimate_costs(toy_problem(), PRESETS["h100"]))
    assert hash(TOY) == hash(dataclasses.replace(TOY))
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.device = "other"  # type: ignore[misc]


def test_presets_sane():
    assert set(PRESETS) == {"v100", "a100", "h100", "h200", "gh200"}
    for spec in PRESETS.values():
        assert spec.flops_for("bfloat16") >= spec.flops_for("float32")
        assert spec.flops_for("int8") == spec.flops_for("float32")  # fallback
        assert spec.hbm_bytes_per_s > 50 * spec.h2d_bytes_per_s or spec.link == "NVLink-C2C"
        assert 0 < spec.efficiency <= 1
    v100, a100, h100, h200, gh200 = (PRESETS[k] for k in ("v100", "a100", "h100", "h200", "gh200"))
    assert h200.hbm_bytes_per_s > h100.hbm_bytes_per_s > a100.hbm_bytes_per_s > v100.hbm_bytes_per_s
    assert h200.memory_bytes > gh200.memory_bytes > h100.memory_bytes == a100.memory_bytes > v100.memory_bytes
    assert gh200.h2d_bytes_per_s >= 5 * h100.h2d_bytes_per_s
    assert h100.h2d_bytes_per_s > a100.h2d_bytes_per_s > v100.h2d_bytes_per_s
    assert h100.flops_for("float32") == 67e12  # FP32, not TF32
    assert h100.flops_for(torch.bfloat16) == 989e12  # dense, not the sparse headline


@pytest.mark.parametrize("name,expected", [
    ("H100", "h100"), ("h100-80gb", "h100"), ("H100-SXM5-80GB", "h100"), ("  a100 ", "a100"),
    ("NVIDIA H200", "h200"), ("gh200", "gh200"), ("v100_16gb", "v100"),
])
def test_get_device_names(name, expected):
    assert get_device(name) is PRESETS[expected]


def test_get_device_passthrough_and_errors():
    assert get_device(TOY) is TOY
    assert get_device(None) is PRESETS["h100"]
    for bad in ("tpu-v5", "a100-40gb", "h1000", ""):
        with pytest.raises(ValueError, match="presets: v100"):
            get_device(bad)
    with pytest.raises(KarmaError, match="preset name or a DeviceSpec"):
        get_device(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [
    {"memory_bytes": 0}, {"memory_bytes": 1.5}, {"hbm_bytes_per_s": -1.0}, {"d2h_bytes_per_s": 0},
    {"h2d_bytes_per_s": math.inf}, {"copy_latency_us": -1.0}, {"kernel_overhead_us": math.nan},
    {"efficiency": 0.0}, {"efficiency": 1.5}, {"peak_flops": {"bfloat16": 1e12}},
    {"peak_flops": {"float32": 0.0}}, {"peak_flops": {"float32": "fast"}}, {"name": ""},
])
def test_device_spec_validation(change):
    with pytest.raises(ValueError, match="DeviceSpec"):
        dataclasses.replace(TOY, **change)


def test_peak_flops_stored_as_pairs():
    assert TOY.peak_flops == (("bfloat16", 400e12), ("float32", 100e12))
    same = DeviceSpec(name="toy", memory_bytes=1 << 30, peak_flops=(("float32", 100e12), ("bfloat16", 400e12)),
                      hbm_bytes_per_s=1e12, d2h_bytes_per_s=10e9, h2d_bytes_per_s=20e9, copy_latency_us=5.0,
                      kernel_overhead_us=3.0, link="test", efficiency=0.5)
    assert same == TOY


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_calibrate_without_cuda():
    with pytest.raises(RuntimeError, match="calibrate\\(\\) needs a CUDA device"):
        calibrate()
