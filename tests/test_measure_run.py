"""LiveBytes counts storages the way an allocator would: created, shared by views, freed with the last holder."""
from __future__ import annotations

import gc

import torch

from karma_fx.measure_run import LiveBytes


def test_counts_live_storages_views_and_host_copies():
    w = torch.ones(256)  # 1 KiB, existed before: baseline
    with LiveBytes([w]) as live:
        a = torch.empty(1000)          # 4000 B
        view = a[:10]                  # shares a's storage: nothing new
        b = w * 2                      # 1024 B
        host = torch.ops.karma.offload(b)  # host tier: not device bytes
        del a
        gc.collect()
        assert live.current_bytes == 4000 + 1024  # the view keeps a's storage alive
        del view
        gc.collect()
        c = torch.empty(100)           # 400 B
        assert live.current_bytes == 1024 + 400
    assert live.baseline_bytes == 1024
    assert live.peak_bytes == 1024 + 4000 + 1024
    del b, c, host
