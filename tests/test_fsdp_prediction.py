"""FSDP2's step predicted on many GPUs (``karma_fx.fsdp``): units read off the modules, all-gathers prefetched
one unit ahead, gradients reduce-scattered, the network shared one collective after another."""
from __future__ import annotations

import pytest

from karma_fx.cluster import Cluster
from karma_fx.fsdp import ROOT, fsdp_step, fsdp_units, gather_us, unit_of

from conftest import prepared


def test_units_are_numbered_module_prefixes():
    assert unit_of("transformer.h.3.mlp.c_fc") == "transformer.h.3"
    assert unit_of("model.layers.10.self_attn") == "model.layers.10"
    assert unit_of("transformer.wte") == ROOT and unit_of("") == ROOT


@pytest.fixture(scope="module")
def planned():
    return prepared("megatron_gpt").plan(1.0)


def test_every_weight_is_in_one_unit_in_forward_order(planned):
    units = fsdp_units(planned.problem)
    assert units[0].name == ROOT and len(units) == 3  # two blocks and the root
    assert sum(u.param_bytes for u in units) == planned.problem.param_bytes
    blocks = units[1:]
    assert [u.forward[0] for u in blocks] == sorted(u.forward[0] for u in blocks)
    assert all(u.backward is not None and u.backward[0] > u.forward[1] for u in blocks)


def test_one_gpu_pays_nothing_and_a_slower_network_never_helps(planned):
    tl = planned.timeline
    one = fsdp_step(planned.problem, tl, Cluster())
    assert one.step_time_us == pytest.approx(tl.makespan_us) and one.allreduce_us == 0
    times = [fsdp_step(planned.problem, tl, Cluster(nodes=4, gpus_per_node=4, network_gbps=g)).step_time_us
             for g in (1000.0, 100.0, 10.0, 1.0)]
    assert times == sorted(times) and times[0] >= tl.makespan_us
    slow = fsdp_step(planned.problem, tl, Cluster(nodes=4, gpus_per_node=4, network_gbps=0.01))
    units = fsdp_units(planned.problem)
    cluster = Cluster(nodes=4, gpus_per_node=4, network_gbps=0.01)
    # on a crawling network every collective is on the critical path: all-gathers (twice for the blocks, once
    # for the root) and one reduce-scatter per unit
    traffic = sum(gather_us(cluster, u.param_bytes) * (2 if u.name == ROOT else 3) for u in units)
    assert slow.allreduce_us == pytest.approx(traffic)
    assert slow.step_time_us >= traffic


def test_the_cli_prints_it_beside_data_parallel(capsys):
    from karma_fx.cli import main

    assert main(["plan", "megatron_gpt", "--size", "tiny", "--budget", "1.0", "--nodes", "2", "--gpus-per-node",
                 "4", "--fsdp", "-q"]) == 0
    out = capsys.readouterr().out
    assert "data parallel on 2 node(s)" in out and "FSDP2 on 8 GPUs (3 units: 2 blocks and the root" in out
