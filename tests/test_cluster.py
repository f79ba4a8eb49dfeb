"""The data-parallel step model: ring all-reduce per bucket, overlap with backward, host update."""
from __future__ import annotations

import pytest

from helpers import flat_costs, random_problem
from karma_fx.cluster import Cluster, parallel_step, weak_scaling_efficiency
from karma_fx.errors import KarmaError
from karma_fx.simulate import simulate


def layered():
    problem = random_problem(6, [100] * 6, [-1] * 6, [1.0])
    costs = flat_costs(problem, op_us=10.0, bytes_per_us=100.0)
    return problem, costs, simulate(problem, (), costs)


def test_ring_allreduce_time():
    # 8 Gbit/s = 1000 bytes/us; 4 nodes: 2*3/4 of the bytes cross each link, plus the latency
    c = Cluster(nodes=4, gpus_per_node=1, network_gbps=8.0, network_latency_us=5.0)
    assert c.allreduce_us(1000) == pytest.approx(2 * 3 / 4 * 1000 / 1000 + 5.0)
    assert Cluster().allreduce_us(10**9) == 0.0  # one GPU: nothing to exchange
    inside = Cluster(nodes=1, gpus_per_node=4, intra_node_gbps=8.0)
    assert inside.allreduce_us(1000) == pytest.approx(2 * 3 / 4 * 1000 / 1000)


def test_buckets_overlap_backward_and_one_gpu_has_no_exchange():
    problem, costs, timeline = layered()
    backward_end = timeline.makespan_us
    one = parallel_step(problem, timeline, costs, Cluster(bucket_bytes=64, host_update=False))
    assert one.step_time_us == timeline.makespan_us and one.allreduce == ()
    many = parallel_step(problem, timeline, costs, Cluster(nodes=8, network_gbps=0.08, bucket_bytes=64,
                                                           host_update=False))
    assert many.buckets == 3  # six 32-byte gradients, two per bucket
    assert many.allreduce[0].start_us < backward_end, "the first bucket must be exchanged during backward"
    starts = [iv.start_us for iv in many.allreduce]
    ends = [iv.end_us for iv in many.allreduce]
    assert all(e <= s for e, s in zip(ends, starts[1:])), "one bucket at a time on the network"
    assert many.step_time_us == pytest.approx(max(timeline.makespan_us, ends[-1]))


def test_host_update_and_efficiency():
    problem, costs, timeline = layered()
    slow_host = Cluster(bucket_bytes=64, host_update_params_per_s=1e3)  # 16 fp32 params per bucket: 16 ms each
    step = parallel_step(problem, timeline, costs, slow_host)
    assert len(step.host) == 3 and step.host_update_us == pytest.approx(3 * 16 / 1e3 * 1e6)
    assert step.step_time_us > timeline.makespan_us
    fast, slow = (weak_scaling_efficiency(problem, timeline, costs, Cluster(nodes=16, network_gbps=g, bucket_bytes=64))
                  for g in (100.0, 0.01))
    assert 0 < slow < fast <= 1.0


def test_bad_cluster():
    for bad in (dict(nodes=0), dict(gpus_per_node=-1), dict(network_gbps=0), dict(bucket_bytes=1.5)):
        with pytest.raises(KarmaError):
            Cluster(**bad)
