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


def test_a_buffer_is_not_reused_while_a_copy_still_reads_it():
    """Worker-thread copies with the H2D copy slowed down: the graph drops the host tensor right after its
    prefetch is issued, and the next offload of the same size must not write into that buffer until the
    prefetch has read it (the race that corrupts values silently on a GPU)."""
    from karma_fx.runtime import copy_mode, set_copy_delay

    host_pool.clear()
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    with copy_mode("threads"):
        set_copy_delay(h2d_s=0.2)
        try:
            host = torch.ops.karma.offload(a)
            back = torch.ops.karma.prefetch(host, a.device)
            del host
            gc.collect()                                  # the buffer goes back to the pool, still being read
            other = torch.ops.karma.offload(b)            # same size: must not overwrite a's buffer now
            assert torch.equal(torch.ops.karma.wait(back), a)
            assert torch.equal(torch.ops.karma.wait(torch.ops.karma.prefetch(other, b.device)), b)
        finally:
            set_copy_delay()


def test_a_buffer_is_not_reused_while_a_view_of_it_lives():
    host_pool.clear()
    a = torch.randn(64, 64)
    host = torch.ops.karma.offload(a)
    view = host.detach()                                  # the host tensor dies, its storage does not
    del host
    gc.collect()
    again = torch.ops.karma.offload(torch.zeros(64, 64))
    assert again.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert torch.equal(view, a)


def test_worker_thread_copies_train_exactly_as_eager():
    """offload / prefetch / wait on worker threads (slowed down) give the same loss and gradients."""
    import copy

    import karma_fx
    from karma_fx.runtime import copy_mode, set_copy_delay
    from karma_fx.zoo import build, output_to_loss

    model, args, kwargs = build("gpt2", "tiny")
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1 << 40, strategy="offload")  # every saved tensor moves
    with copy_mode("threads"):
        set_copy_delay(d2h_s=0.002, h2d_s=0.002)
        try:
            for i in range(2):
                torch.manual_seed(i)
                loss = output_to_loss(step(*args, **kwargs))
                loss.backward()
                torch.manual_seed(i)
                want = output_to_loss(reference(*args, **kwargs))
                want.backward()
                assert torch.equal(loss, want)
                for p, q in zip(model.parameters(), reference.parameters()):
                    assert torch.equal(p.grad, q.grad)
                    p.grad = q.grad = None
        finally:
            set_copy_delay()
    assert step.plan.offloads


def test_late_swap_outs_keep_a_step_at_its_plan():
    """Copies 10 ms late on the copy thread: compute waits for each swap-out where the plan has it landed
    (``release_before``) and the source is dropped on the compute thread, so the allocator-measured peak is
    the plan's (it was twice the plan: compute ran ahead while the sources waited for their copies, and the
    copy thread's frees were invisible to the profiler's allocator events)."""
    import karma_fx
    from karma_fx.measure_run import measure_step_peak
    from karma_fx.runtime import copy_mode, set_copy_delay
    from karma_fx.zoo import build, output_to_loss

    model, args, kwargs = build("megatron_gpt", "tiny", batch=2, seq=64, layers=2, hidden=64, heads=4, vocab=128)
    step = karma_fx.compile(model, budget=1.0, strategy="offload")  # every saved tensor swapped out
    with copy_mode("threads"):
        set_copy_delay(d2h_s=0.01)
        try:
            for _ in range(2):
                output_to_loss(step(*args, **kwargs)).backward()
                model.zero_grad(set_to_none=True)
            peak = measure_step_peak(model, step, args, kwargs, output_to_loss).peak_bytes
        finally:
            set_copy_delay()
    assert len(step.plan.offloads) > 20 and all(d.release_before for d in step.plan.offloads)
    assert peak <= step.plan.peak_bytes + 16  # the autograd engine's scalar gradient seed beside the loss


def test_the_compute_thread_holds_a_swapped_out_source_until_it_waits_for_the_copy():
    """The source of a slow offload outlives the graph's reference to it (the copy still reads it) and goes
    exactly at ``wait(host)``, on the calling thread; unwaited, it goes when its host tensor dies, once the
    copy is done."""
    import weakref

    from karma_fx.runtime import copy_mode, set_copy_delay

    with copy_mode("threads"):
        set_copy_delay(d2h_s=0.05)
        try:
            x = torch.randn(64, 64)
            want = x.clone()
            source = weakref.ref(x)
            host = torch.ops.karma.offload(x)
            del x
            assert source() is not None, "the copy is still reading it"
            waited = torch.ops.karma.wait(host)
            assert source() is None, "waited for: let go right there"
            assert torch.equal(waited, want) and is_host_tier(waited)

            y = torch.randn(32, 32)
            source = weakref.ref(y)
            host = torch.ops.karma.offload(y)
            done = host_pool._copies[host.untyped_storage().data_ptr()][0]
            del y, host  # the copy has 50 ms to go
            assert done.done() and source() is None, "its host tensor died unwaited: let go after the copy"
        finally:
            set_copy_delay()


def test_an_unwaited_cuda_source_is_let_go_only_after_record_stream_on_its_copy_stream():
    """The CUDA branch of the hold, driven with stand-ins (no GPU here): when the host tensor dies before any
    wait, the source gets ``record_stream`` on the copy stream before it is dropped, so the caching allocator
    cannot hand its block out while the queued copy may still read it; a wait lets go without it."""
    from karma_fx import runtime

    class Source:
        def __init__(self):
            self.recorded = []

        def record_stream(self, stream):
            self.recorded.append(stream)

    class Event:
        def query(self):
            return False  # still copying: only the host tensor's death or a wait may let go

    stream = object()
    unwaited, waited = Source(), Source()
    host = torch.empty(4)
    runtime._hold(host, unwaited, Event(), stream, stream)
    runtime._let_go_of_finished()
    assert unwaited.recorded == [] and id(host) in runtime._in_flight
    del host
    assert unwaited.recorded == [stream]
    host = torch.empty(4)
    runtime._hold(host, waited, Event(), stream, stream)
    runtime._let_go(host)
    assert id(host) not in runtime._in_flight
    del host
    assert waited.recorded == []


def test_finished_copies_are_let_go_in_issue_order_per_engine():
    """An engine finishes its copies in issue order, so a copy op drops what finished copies held from the
    front of each engine's queue and stops at the first copy still running; one already let go by a wait is
    skipped."""
    import weakref

    from karma_fx import runtime

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    tensors = [torch.empty(1) for _ in range(4)]
    events = [Event(True), Event(False), Event(True), Event(True)]
    alive = [weakref.ref(t) for t in tensors]
    for t, e in zip(tensors, events):
        runtime._hold(t, t, e, None, "test engine")
    runtime._let_go(tensors[3])  # waited for: gone from the queue's point of view
    del t, tensors
    runtime._let_go_of_finished()
    assert [a() is None for a in alive] == [True, False, False, True]  # the third waits behind the second
    events[1].done = True
    runtime._let_go_of_finished()
    assert all(a() is None for a in alive) and not runtime._issued["test engine"]


@pytest.mark.parametrize("make", [lambda: torch.randn(8, 10)[:, 2:7], lambda: torch.randn(6, 4).t(),
                                  lambda: torch.randn(3, 1, 5).expand(3, 4, 5), lambda: torch.randn(0, 3),
                                  lambda: (torch.randn(4, 6) * 10).to(torch.int64)[1:3]],
                         ids=["slice", "transposed", "expanded", "empty", "int64 rows"])
def test_late_threaded_copies_of_any_layout_are_exact(make):
    """The copy workers read and write every tensor through raw views of its memory (they own none of it):
    a slice, a transposed, an expanded or an empty tensor still round-trips exactly with late copies."""
    from karma_fx.runtime import copy_mode, set_copy_delay

    x = make()
    with copy_mode("threads"):
        set_copy_delay(d2h_s=0.01, h2d_s=0.01)
        try:
            host = torch.ops.karma.offload(x)
            back = torch.ops.karma.wait(torch.ops.karma.prefetch(host, x.device))
            assert torch.equal(torch.ops.karma.wait(host), x) and torch.equal(back, x)
        finally:
            set_copy_delay()


def test_landed_returns_a_host_copy_once_filled_and_refuses_what_is_not_a_tensor():
    from karma_fx.errors import KarmaError
    from karma_fx.runtime import copy_mode, landed, set_copy_delay

    x = torch.randn(16, 16)
    with copy_mode("threads"):
        set_copy_delay(d2h_s=0.02)
        try:
            host = torch.ops.karma.offload(x)
            assert landed(host) is host and torch.equal(host, x)  # read on this thread, after the copy
        finally:
            set_copy_delay()
    assert landed(x) is x  # not a copy: nothing to wait for
    with pytest.raises(KarmaError, match="takes a tensor"):
        landed([x])


def test_a_waited_host_copy_keeps_its_copy_event_for_host_readers():
    """``wait`` on a host copy returns an alias; on CUDA it only makes the compute stream wait, so host code
    reading the alias (``landed``, the widening of a gradient sent bf16) must still find the copy's event, or it
    reads a pinned buffer the copy is still filling."""
    from karma_fx import runtime

    with runtime.copy_mode("threads"):
        host = torch.ops.karma.offload(torch.randn(64))
        event = runtime._copy_done.get(host)
        waited = torch.ops.karma.wait(host)
        assert event is not None and runtime._copy_done.get(waited) is event
        assert runtime.landed(waited) is waited and torch.equal(waited, host)
