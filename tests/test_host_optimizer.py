"""The host optimizer: PyTorch's own AdamW applied bucket by bucket while backward runs, exactly as usual."""
from __future__ import annotations

import copy
import functools
import gc
import threading
import weakref

import pytest
import torch

import karma_fx
from karma_fx import exchange
from karma_fx.errors import KarmaError
from karma_fx.zoo import build, output_to_loss

from test_compile import budgets


@pytest.mark.parametrize("name, strategy, fused, which", [("gpt2", "offload", True, 0), ("cnn", "checkpoint", False, 1)])
def test_parameters_equal_adamw_run_the_ordinary_way(name, strategy, fused, which):
    """``which`` picks the budget: the unplanned peak (offload moves everything anyway) or halfway to the floor."""
    mid = budgets(name)[which]
    model, args, kwargs = build(name, "tiny")
    reference = copy.deepcopy(model)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
    step = karma_fx.compile(model, budget=mid, strategy=strategy, optimizer=adamw, bucket_bytes=4096)
    ordinary = adamw(reference.parameters())
    for i in range(3):
        torch.manual_seed(i)  # the same dropout masks
        output_to_loss(step(*args, **kwargs)).backward()
        torch.manual_seed(i)
        output_to_loss(reference(*args, **kwargs)).backward()
        ordinary.step()
        ordinary.zero_grad()
    step.pipeline.wait_updates()
    assert len(step.pipeline.buckets) > 1 and step.plan.decisions
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is None, f"{n}: the host optimizer consumed its gradient"
        assert ((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item() <= 1e-5, n
    for (n, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), n


def test_updates_overlap_backward():
    model, args, kwargs = build("gpt2", "tiny")
    step = karma_fx.compile(model, budget=1.0, strategy="keep", bucket_bytes=1024,
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    output_to_loss(step(*args, **kwargs)).backward()
    step.pipeline.wait_updates()
    events = {name: (start, end) for name, _, start, end in step.pipeline.trace_events}
    assert events["host update bucket 0"][0] < events["backward"][1], "bucket 0 is updated while backward runs"


def test_bad_optimizer_and_data_parallel_without_a_process_group():
    model, args, kwargs = build("mlp", "tiny")
    with pytest.raises(KarmaError, match="callable"):
        karma_fx.compile(model, budget=1.0, optimizer="adamw")
    with pytest.raises(KarmaError, match="init_process_group"):
        karma_fx.compile(model, budget=1.0, data_parallel=True)
    with pytest.raises(KarmaError, match="torch.optim.Optimizer"):  # refused when compiled, before any step
        karma_fx.compile(model, budget=1.0, optimizer=lambda params: "not an optimizer")


def test_the_host_optimizer_reads_a_gradient_only_once_its_copy_landed():
    """Weights out of core send each gradient to the host with ``karma.offload``; the host update must not
    read the host buffer before that copy is done (5 ms late copies: parameters were 27% off after three
    AdamW steps, and on a GPU the same read races the DMA into pinned memory)."""
    from karma_fx.runtime import copy_mode, set_copy_delay

    model, args, kwargs = build("mlp", "tiny")
    reference = copy.deepcopy(model)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    step = karma_fx.compile(model, budget=1.0, strategy="offload", optimizer=adamw, bucket_bytes=4096,
                            offload_weights=True)
    ordinary = adamw(reference.parameters())
    with copy_mode("threads"):
        set_copy_delay(d2h_s=0.005)
        try:
            for i in range(3):
                output_to_loss(step(*args, **kwargs)).backward()
                output_to_loss(reference(*args, **kwargs)).backward()
                ordinary.step()
                ordinary.zero_grad()
            step.pipeline.wait_updates()
        finally:
            set_copy_delay()
    assert any(type(d).__name__ == "GradToHost" for d in step.plan.decisions)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert ((p - q).abs().max() / q.abs().max()).item() <= 1e-6, n


def test_max_grad_norm_clips_the_total_accumulated_under_no_sync():
    """Gradient accumulation with clipping, as eager training does it: the backward passes under ``no_sync()``
    and the one after it add up, the total is clipped with ``clip_grad_norm_``, then the optimizer steps
    (``no_sync`` used to end its backward by clipping nothing: ``stack expects a non-empty TensorList``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    step = karma_fx.compile(model, budget="1MiB", optimizer=sgd, max_grad_norm=1.0)
    ordinary = sgd(reference.parameters())
    loss = lambda y: (y ** 2).mean()  # noqa: E731
    for i in range(2):
        xs = [torch.randn(16, 8) * 10 for _ in range(3)]  # large inputs: the norm is far above 1, so it clips
        with step.no_sync():
            loss(step(xs[0])).backward()
            loss(step(xs[1])).backward()
        loss(step(xs[2])).backward()
        step.pipeline.wait_updates()
        for x in xs:
            loss(reference(x)).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        assert norm > 10 and step.pipeline.last_grad_norm == pytest.approx(float(norm), rel=1e-6)
        ordinary.step()
        ordinary.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.grad is None, "the update took in the accumulated gradient"
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _compiled_mlp_after_one_step():
    """A compiled MLP with SGD momentum (optimizer state to free) after one step, and weak references to what a
    deleted module must take with it: the model, a weight, the optimizer, and the worker thread's ids."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    step = karma_fx.compile(model, budget=1.0, strategy="keep",
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), bucket_bytes=4096)
    step(torch.randn(4, 64)).sum().backward()
    pipeline = step.pipeline
    assert pipeline.optimizer.state and pipeline._worker_threads  # momentum buffers exist, the worker ran
    watch = {"model": weakref.ref(model), "weight": weakref.ref(model[0].weight),
             "optimizer": weakref.ref(pipeline.optimizer)}
    return step, watch, set(pipeline._worker_threads), pipeline.id


def _left_behind(watch: dict, threads: set[int], pipeline_id: int) -> list[str]:
    gc.collect()
    alive = [name for name, ref in watch.items() if ref() is not None]
    alive += [t.name for t in threading.enumerate() if t.ident in threads]
    return alive + (["the pipeline's registry entry"] if pipeline_id in exchange._pipelines else [])


def test_a_pipeline_tied_to_its_module_is_freed_with_it_without_a_dynamo_reset():
    """Dynamo's caches keep the backend and the compiled graphs of a deleted module (until
    ``torch._dynamo.reset()``), and through them its gradient pipeline: tied to the module, the pipeline lets go
    of the parameters, the optimizer state and its worker thread when the module goes."""
    step, watch, threads, pipeline_id = _compiled_mlp_after_one_step()
    step.pipeline.tie_to(step)
    del step
    assert _left_behind(watch, threads, pipeline_id) == []


def test_a_deleted_compiled_module_frees_its_parameters_optimizer_and_thread():
    step, watch, threads, pipeline_id = _compiled_mlp_after_one_step()
    del step
    assert _left_behind(watch, threads, pipeline_id) == []


def test_a_backward_that_outlives_its_closed_pipeline_says_so():
    step, _, _, _ = _compiled_mlp_after_one_step()
    pipeline = step.pipeline
    loss = step(torch.randn(4, 64)).sum()
    pipeline.close()
    with pytest.raises(KarmaError, match="deleted before its backward ran"):
        loss.backward()
    with pytest.raises(KarmaError, match="was deleted"):
        pipeline.expect([])
    assert pipeline.params == [] and pipeline.optimizer is None
    pipeline.close()  # twice is fine


def test_a_forward_dropped_without_backward_is_forgotten_by_the_pipeline():
    """A call with gradients on whose output is dropped (an evaluation that forgot ``no_grad``) announced
    gradients that never come: the pipeline takes them back when the next step begins. It waited for them, kept
    every later backward's gradients as partial sums, and the weights never updated again, without a word."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    reference = copy.deepcopy(model)
    step = karma_fx.compile(model, budget=1.0, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    for i in range(5):
        if i == 2:
            step(x)  # its output dropped at once
        F.cross_entropy(step(x), y).backward()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    step.optimizer  # waits for the updates
    assert not step.pipeline._expected
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
