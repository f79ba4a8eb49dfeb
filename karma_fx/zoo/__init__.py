"""A small model zoo: the networks out-of-core training is evaluated on, each at two sizes.

``"tiny"`` keeps a model's block code and topology but shrinks depth and width so a forward+backward runs on
CPU in milliseconds (for tests); ``"real"`` is the published architecture (for planning at scale, usually on
``device="meta"`` so that even the 1.5B GPT costs no memory). ``build`` returns ``(module, args, kwargs)``
ready for ``module(*args, **kwargs)``; models with labels return their loss, classifiers return logits (use
``output_to_loss`` to get a scalar from any of them).

Overrides (``build(name, size, **overrides)``) change one architecture knob for scaling studies; each model
lists the ones it accepts in ``ZOO[name].overrides`` and rejects any other:

- mlp: hidden, in_features, classes
- cnn: width, classes, image
- resnet50, resnet200: width, classes, image
- resnet1001: depth, width, classes, image
- wrn28_10: depth, widen, dropout, classes, image
- vgg16: batch_norm, classes, image
- megatron_gpt: layers, hidden, heads, vocab, dropout, tie_embeddings
- gpt2: layers, hidden, heads, vocab, dropout
- bert: layers, hidden, heads, intermediate, vocab, dropout
- llama: layers, hidden, heads, kv_heads, intermediate, vocab, dropout

``transformers`` is imported only when gpt2, bert or llama is built.

``precision`` is the regime the step trains in: ``"fp32"``; ``"bf16-mixed"`` (fp32 weights, the forward under
``torch.autocast(dtype=torch.bfloat16)``, as mixed-precision training runs it: the module is wrapped in
``Autocast``, so every door captures the autocast graph); ``"bf16"`` (bf16 weights and float inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from karma_fx.zoo import megatron, resnet, vision
from karma_fx.zoo._common import SIZES, Request, ZooError, check_overrides

Builder = Callable[[Request], "tuple[nn.Module, tuple, dict]"]
PRECISIONS = ("fp32", "bf16-mixed", "bf16")


class Autocast(nn.Module):
    """``module`` run under ``torch.autocast(dtype=...)`` on the device its inputs live on (a meta model is
    traced as if on the CPU): mixed-precision training as a module, so ``karma_fx.plan``, ``karma_fx.compile``
    and ``torch.compile`` all capture the autocast graph (bf16 matmuls, fp32 reductions)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch.utils._pytree as pytree

        devices = [t.device.type for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = devices[0] if devices and devices[0] not in ("meta",) else "cpu"
        with torch.autocast(device_type=device, dtype=self.dtype):
            return self.module(*args, **kwargs)


def _hf(name: str) -> Builder:
    """Defer ``karma_fx.zoo.hf`` (and so transformers) until the builder actually runs."""

    def builder(req: Request) -> tuple[nn.Module, tuple, dict]:
        from karma_fx.zoo import hf

        return getattr(hf, f"build_{name}")(req)

    builder.__name__ = f"build_{name}"
    return builder


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: what the model is, its default batch/sequence at each size, and how to build it.

    ``default_seq_real``/``default_seq_tiny`` are ``None`` for image models, which take no sequence length.
    ``builder`` receives a fully resolved ``Request``; call ``build`` (module function or method) instead of
    calling it directly, so defaults, override checks, seeding and the device context are applied.
    """

    name: str
    description: str
    default_batch_tiny: int
    default_batch_real: int
    default_seq_real: int | None
    builder: Builder
    default_seq_tiny: int | None = None
    overrides: tuple[str, ...] = ()

    @property
    def takes_seq(self) -> bool:
        """Whether the model's inputs have a sequence dimension (language models) or not (image models)."""
        return self.default_seq_real is not None

    def build(
        self,
        size: str = "tiny",
        *,
        batch: int | None = None,
        seq: int | None = None,
        device: str | torch.device | None = None,
        precision: str = "fp32",
        **overrides: Any,
    ) -> tuple[nn.Module, tuple, dict]:
        """Same as ``karma_fx.zoo.build(self.name, ...)``."""
        return build(self.name, size, batch=batch, seq=seq, device=device, precision=precision, **overrides)


_VISION_COMMON = ("classes", "image")
_ENTRIES = [
    ZooModel("mlp", "3-layer MLP with ReLU (tiny 32-64-64-10, real 1024-4096-4096-1000)",
             8, 1024, None, vision.build_mlp, overrides=("hidden", "in_features", "classes")),
    ZooModel("cnn", "small CNN: 3x Conv-BN-ReLU, pool, Dropout, Linear (32x32 input)",
             4, 256, None, vision.build_cnn, overrides=("width",) + _VISION_COMMON),
    ZooModel("resnet50", "ImageNet bottleneck ResNet-50, layers [3,4,6,3], 224x224",
             2, 256, None, resnet.build_resnet50, overrides=("width",) + _VISION_COMMON),
    ZooModel("resnet200", "ImageNet bottleneck ResNet-200, layers [3,24,36,3], 224x224",
             2, 128, None, resnet.build_resnet200, overrides=("width",) + _VISION_COMMON),
    ZooModel("resnet1001", "CIFAR pre-activation bottleneck ResNet-1001 (111 blocks/stage), 32x32",
             2, 64, None, resnet.build_resnet1001, overrides=("depth", "width") + _VISION_COMMON),
    ZooModel("wrn28_10", "Wide ResNet 28-10 for CIFAR, 32x32",
             2, 128, None, resnet.build_wrn28_10, overrides=("depth", "widen", "dropout") + _VISION_COMMON),
    ZooModel("vgg16", "VGG16 (BatchNorm optional, off by default), 224x224",
             2, 128, None, vision.build_vgg16, overrides=("batch_norm",) + _VISION_COMMON),
    ZooModel("megatron_gpt", "Megatron-LM-style GPT, pre-LN, fused QKV, SDPA causal; real 1.56B (h1600 L48)",
             2, 8, 1024, megatron.build_megatron_gpt, default_seq_tiny=16,
             overrides=("layers", "hidden", "heads", "vocab", "dropout", "tie_embeddings")),
    ZooModel("gpt2", "HF GPT2LMHeadModel; real GPT-2 small (124M)",
             2, 8, 1024, _hf("gpt2"), default_seq_tiny=16,
             overrides=("layers", "hidden", "heads", "vocab", "dropout")),
    ZooModel("bert", "HF BertForMaskedLM; real BERT-base (110M)",
             2, 32, 512, _hf("bert"), default_seq_tiny=16,
             overrides=("layers", "hidden", "heads", "intermediate", "vocab", "dropout")),
    ZooModel("llama", "HF LlamaForCausalLM; real ~1.1B (h2048 L16, 32 heads, 8 KV heads)",
             2, 4, 2048, _hf("llama"), default_seq_tiny=16,
             overrides=("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dropout")),
]

ZOO: dict[str, ZooModel] = {m.name: m for m in _ENTRIES}


def names() -> list[str]:
    """The zoo's model names, in registration order (small to large families)."""
    return list(ZOO)


def build(
    name: str,
    size: str = "tiny",
    *,
    batch: int | None = None,
    seq: int | None = None,
    device: str | torch.device | None = None,
    precision: str = "fp32",
    **overrides: Any,
) -> tuple[nn.Module, tuple, dict]:
    """Build zoo model ``name`` at ``size`` ("tiny" or "real") with example inputs: ``(module, args, kwargs)``.

    The module is constructed under ``with torch.device(device)`` (default "cpu"), so ``device="meta"`` costs
    no memory even for the real GPT, and the inputs are created on the same device: images float32 NCHW,
    token ids and labels torch.long. ``torch.manual_seed(0)`` is called first, so two builds with the same
    arguments give identical weights and inputs (note: this reseeds the global RNG, on purpose, so that the
    first training step after a build is reproducible too). The module is returned in training mode.
    ``seq`` is only valid for language models. See the module docstring for the accepted ``overrides`` and
    ``precision``.
    """
    entry = ZOO.get(name)
    if entry is None:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    if size not in SIZES:
        raise ZooError(f"size must be one of {SIZES}, got {size!r}")
    tiny = size == "tiny"
    if batch is None:
        batch = entry.default_batch_tiny if tiny else entry.default_batch_real
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise ZooError(f"batch must be a positive int, got {batch!r}")
    if not entry.takes_seq:
        if seq is not None:
            raise ZooError(f"zoo model {name!r} takes images, not sequences; do not pass seq")
    else:
        if seq is None:
            seq = entry.default_seq_tiny if tiny else entry.default_seq_real
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
            raise ZooError(f"seq must be a positive int, got {seq!r}")
    check_overrides(name, overrides, entry.overrides)
    if precision not in PRECISIONS:
        raise ZooError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    dev = torch.device("cpu" if device is None else device)
    req = Request(size=size, batch=batch, seq=seq, device=dev, overrides=dict(overrides))
    torch.manual_seed(0)
    with torch.device(dev):
        module, args, kwargs = entry.builder(req)
    if precision == "bf16":
        module = module.to(torch.bfloat16)
        args, kwargs = _to_bf16((args, kwargs))
    elif precision == "bf16-mixed":
        module = Autocast(module)
    module.train()
    return module, args, kwargs


def _to_bf16(tree: Any) -> Any:
    """Floating-point tensors in ``tree`` as bfloat16 (token ids and labels stay integers)."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point()
                           else t, tree)


def output_to_loss(output: Any) -> torch.Tensor:
    """A scalar to call ``backward()`` on, from any zoo model's output.

    Language models given labels already return their loss (a tensor, or a HF output with ``.loss``);
    classifiers return logits, for which this returns ``mean(logits**2)``: not a meaningful objective, but a
    cheap, label-free scalar whose gradient reaches every parameter, which is what tests and planners need.
    """
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().square().mean()
    raise ZooError(f"cannot reduce a {type(output).__name__} to a loss")


__all__ = ["PRECISIONS", "ZOO", "Autocast", "ZooError", "ZooModel", "build", "names", "output_to_loss"]
