"""Tests for karma_fx.zoo: every model trains a step at tiny size on CPU, builds at real size on meta with the
published parameter count, and the build API is deterministic and strict about its arguments."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from karma_fx.zoo import ZOO, ZooError, ZooModel, build, names, output_to_loss

ALL = names()
LANGUAGE = ["megatron_gpt", "gpt2", "bert", "llama"]

# Published (or, for the zoo-only mlp/cnn, computed) parameter counts of the real sizes, as (low, high).
REAL_PARAMS = {
    "mlp": (25.0e6, 25.2e6),
    "cnn": (0.37e6, 0.38e6),
    "resnet50": (25.4e6, 25.8e6),  # 25.6M
    "resnet200": (64.0e6, 65.5e6),  # 64.7M
    "resnet1001": (10.0e6, 10.5e6),  # 10.2M in the pre-activation paper
    "wrn28_10": (36.0e6, 37.0e6),  # 36.5M
    "vgg16": (138.0e6, 138.7e6),  # 138M
    "megatron_gpt": (1.2e9, 1.6e9),
    "gpt2": (123.5e6, 125.0e6),  # 124M
    "bert": (108.0e6, 111.0e6),  # 110M
    "llama": (1.0e9, 1.25e9),
}


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def test_registry_is_complete() -> None:
    assert set(ALL) == set(REAL_PARAMS)
    for name, entry in ZOO.items():
        assert isinstance(entry, ZooModel) and entry.name == name and entry.description
        assert entry.default_batch_tiny > 0 and entry.default_batch_real > 0
        assert (entry.default_seq_real is not None) == (name in LANGUAGE)
        assert (entry.default_seq_tiny is not None) == (name in LANGUAGE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZOO["mlp"].name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("name", ALL)
def test_tiny_forward_backward_on_cpu(name: str) -> None:
    module, args, kwargs = build(name)
    assert module.training
    for t in _tensors(args, kwargs):
        assert t.device.type == "cpu"
        assert t.dtype == (torch.long if name in LANGUAGE else torch.float32)
    if name not in LANGUAGE:
        (x,) = args
        assert x.dim() in (2, 4) and x.shape[0] == ZOO[name].default_batch_tiny
    start = time.perf_counter()
    out = module(*args, **kwargs)
    loss = output_to_loss(out)
    loss.backward()
    elapsed = time.perf_counter() - start
    assert loss.dim() == 0 and torch.isfinite(loss)
    if name in LANGUAGE:  # a real cross-entropy on random tokens: about log(vocab) at init
        assert 0.5 * math.log(256) < loss.item() < 2.0 * math.log(256)
    else:
        assert torch.isfinite(out).all()
    for pname, p in module.named_parameters():
        assert p.grad is not None, f"{name}: no grad for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite grad for {pname}"
    assert any(p.grad.abs().sum() > 0 for p in module.parameters())
    assert elapsed < 5.0, f"tiny {name} step took {elapsed:.2f}s"  # typically well under 0.1 s


@pytest.mark.parametrize("name", ALL)
def test_real_builds_on_meta_with_published_size(name: str) -> None:
    module, args, kwargs = build(name, "real", device="meta")
    assert all(t.is_meta for t in module.parameters())
    assert all(t.is_meta for t in module.buffers())
    inputs = _tensors(args, kwargs)
    assert inputs and all(t.is_meta for t in inputs)
    entry = ZOO[name]
    assert inputs[0].shape[0] == entry.default_batch_real
    if entry.takes_seq:
        assert all(t.dtype == torch.long and t.shape == (entry.default_batch_real, entry.default_seq_real)
                   for t in inputs)
    low, high = REAL_PARAMS[name]
    assert low <= _params(module) <= high, f"{name}: {_params(module) / 1e6:.2f}M params"


def test_real_architecture_details() -> None:
    resnet1001, _, _ = build("resnet1001", "real", device="meta")
    assert [len(stage) for stage in resnet1001.stages] == [111, 111, 111]
    assert resnet1001.fc.in_features == 256
    resnet200, _, _ = build("resnet200", "real", device="meta")
    assert [len(stage) for stage in resnet200.stages] == [3, 24, 36, 3]
    (x,) = build("resnet50", "real", device="meta")[1]
    assert x.shape == (256, 3, 224, 224)
    gpt, _, _ = build("megatron_gpt", "real", device="meta")
    assert len(gpt.layers) == 48 and gpt.layers[0].attn.qkv.out_features == 3 * 1600
    assert gpt.layers[0].attn.heads == 25
    llama, _, _ = build("llama", "real", device="meta")
    assert llama.config.num_key_value_heads == 8 and llama.config.use_cache is False


def test_megatron_real_meta_forward_shapes() -> None:
    module, (ids, labels), kwargs = build("megatron_gpt", "real", batch=2, device="meta")
    assert not kwargs and ids.shape == labels.shape == (2, 1024)
    loss = module(ids, labels)
    assert loss.is_meta and loss.shape == ()
    logits = module(ids)
    assert logits.is_meta and logits.shape == (2, 1024, 50257)


def test_builds_are_deterministic() -> None:
    for name in ("cnn", "megatron_gpt", "gpt2"):
        m1, a1, k1 = build(name)
        m2, a2, k2 = build(name)
        s1, s2 = m1.state_dict(), m2.state_dict()
        assert s1.keys() == s2.keys()
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
        assert all(torch.equal(x, y) for x, y in zip(_tensors(a1, k1), _tensors(a2, k2)))


def test_layer_and_hidden_overrides_scale_the_model() -> None:
    base = _params(build("megatron_gpt", "real", device="meta")[0])
    four = build("megatron_gpt", "real", device="meta", layers=4)[0]
    assert len(four.layers) == 4
    per_layer = 12 * 1600**2 + 13 * 1600
    assert base - _params(four) == 44 * per_layer
    wide, _, _ = build("megatron_gpt", "tiny", hidden=128, layers=3)
    assert len(wide.layers) == 3 and wide.layers[0].attn.heads == 8  # head dim 16 kept on tiny
    untied, _, _ = build("megatron_gpt", "tiny", tie_embeddings=False)
    assert _params(untied) == _params(build("megatron_gpt")[0]) + 256 * 64
    gpt2, _, kw = build("gpt2", "tiny", layers=3, hidden=96, seq=100)  # seq beyond the default positions
    assert gpt2.config.n_layer == 3 and gpt2.config.n_head == 6 and kw["input_ids"].shape == (2, 100)
    assert torch.isfinite(gpt2(**kw).loss)
    llama, _, _ = build("llama", "real", device="meta", layers=2, hidden=1024)
    assert llama.config.num_attention_heads == 16 and llama.config.intermediate_size == 4096
    r, _, _ = build("resnet1001", "tiny", depth=29)
    assert [len(stage) for stage in r.stages] == [3, 3, 3]


def test_batch_and_seq_overrides() -> None:
    _, (x,), _ = build("resnet50", batch=3)
    assert x.shape == (3, 3, 32, 32)
    _, _, kw = build("bert", batch=5, seq=7)
    assert kw["input_ids"].shape == kw["labels"].shape == (5, 7)
    assert set(kw) == {"input_ids", "labels"}


@pytest.mark.parametrize(
    "call",
    [
        lambda: build("nope"),
        lambda: build("mlp", "huge"),
        lambda: build("mlp", batch=0),
        lambda: build("cnn", seq=16),
        lambda: build("gpt2", seq=0),
        lambda: build("megatron_gpt", layer=4),  # typo must not silently build the default
        lambda: build("resnet1001", depth=1000),
        lambda: build("wrn28_10", depth=27),
        lambda: build("megatron_gpt", hidden=100, heads=3),
    ],
)
def test_bad_requests_raise_zoo_error(call) -> None:
    with pytest.raises(ZooError):
        call()


def test_import_is_lazy_about_transformers() -> None:
    code = "import sys, karma_fx.zoo; assert 'transformers' not in sys.modules, 'transformers imported eagerly'"
    root = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr


def test_hf_models_resolve_their_loss_at_build_time() -> None:
    """GPT-2's class name matches no transformers loss type; without pinning it the forward logs a warning,
    which breaks a dynamo trace. The builder pins it."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    for name, loss_type in (("gpt2", "ForCausalLM"), ("bert", "ForMaskedLM"), ("llama", "ForCausalLM")):
        module, _, _ = build(name)
        assert module.loss_type == loss_type
        assert module.loss_function is LOSS_MAPPING[loss_type]
        assert module.config._attn_implementation == "sdpa"
