"""The runtime ops on the CPU: registered under torch.ops.karma, copies with exact values, fake kernels."""
from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from karma_fx.runtime import host_pool, is_host_tier


def test_offload_prefetch_wait_round_trip():
    x = torch.randn(3, 5)
    host = torch.ops.karma.offload(x)
    assert host.device.type == "cpu" and torch.equal(host, x)
    assert host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert is_host_tier(host) and not is_host_tier(x)
    back = torch.ops.karma.prefetch(host, x.device)
    assert torch.equal(back, x) and back.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    waited = torch.ops.karma.wait(back)
    assert waited.data_ptr() == back.data_ptr() and torch.equal(waited, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_values_survive_any_dtype_and_layout(dtype):
    x = (torch.randn(4, 6) * 10).to(dtype).t()  # non-contiguous: strides survive, so views of it still work
    back = torch.ops.karma.prefetch(torch.ops.karma.offload(x), x.device)
    assert back.dtype == dtype and torch.equal(back, x) and back.stride() == x.stride()
    assert torch.equal(back.view(-1) if back.is_contiguous() else back.t().view(-1), x.t().reshape(-1))


def test_fake_kernels_trace():
    with FakeTensorMode():
        x = torch.empty(2, 3)
        host = torch.ops.karma.offload(x)
        back = torch.ops.karma.prefetch(host, torch.device("cpu"))
        assert host.shape == x.shape and back.shape == x.shape and torch.ops.karma.wait(back).shape == x.shape

    def step(x):
        return torch.ops.karma.wait(torch.ops.karma.prefetch(torch.ops.karma.offload(x), x.device)) * 2

    graph = make_fx(step)(torch.randn(3)).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert targets[:3] == ["karma.offload.default", "karma.prefetch.default", "karma.wait.default"]


def test_host_pool_stops_growing():
    host_pool.clear()
    x = torch.randn(256, 256)
    for _ in range(5):
        host = torch.ops.karma.offload(x)
        del host
        gc.collect()
    assert host_pool.allocated_bytes == x.numel() * x.element_size()
    assert host_pool.hits >= 4
