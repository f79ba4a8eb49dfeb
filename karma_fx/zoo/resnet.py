"""Residual networks of the zoo, in plain torch.nn: ImageNet bottleneck ResNets (50, 200), the CIFAR
pre-activation bottleneck ResNet-1001 and Wide ResNet 28-10.

These are the deep, activation-dominated networks that out-of-core training papers evaluate on: hundreds of
blocks whose saved activations dwarf the weights, which is exactly the regime the planner must handle.
Tiny sizes reuse the same block classes with fewer blocks and narrower channels.
"""
from __future__ import annotations

import torch
from torch import nn

from karma_fx.zoo._common import Request, ZooError, images, positive_int


def _conv3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


def _init(module: nn.Module) -> None:
    """He-normal convs, unit BN: the initialisation the ResNet papers use (it keeps deep nets finite)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Bottleneck(nn.Module):
    """Post-activation bottleneck (1x1, 3x3 with the stride, 1x1 expanding 4x), ResNet v1.5 style."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1, self.bn1 = _conv1(cin, planes), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = _conv3(planes, planes, stride), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = _conv1(planes, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ImageNetResNet(nn.Module):
    """7x7/2 stem + max pool, four bottleneck stages (widths base, 2x, 4x, 8x), global pool, Linear."""

    def __init__(self, layers: list[int], base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        cin = base
        for i, blocks in enumerate(layers):
            planes = base * 2**i
            stage: list[nn.Module] = []
            for b in range(blocks):
                stage.append(Bottleneck(cin, planes, stride=2 if (b == 0 and i > 0) else 1))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


def _imagenet_resnet(req: Request, real_layers: list[int], tiny_layers: list[int]) -> tuple[nn.Module, tuple, dict]:
    base = positive_int("width", req.opt("width", 8 if req.tiny else 64))
    classes = positive_int("classes", req.opt("classes", 10 if req.tiny else 1000))
    side = positive_int("image", req.opt("image", 32 if req.tiny else 224))
    model = ImageNetResNet(tiny_layers if req.tiny else real_layers, base=base, classes=classes)
    return model, (images(req, 3, side),), {}


def build_resnet50(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Layers [3, 4, 6, 3]; tiny [1, 1, 1, 1] at width 8. Overrides: ``width``, ``classes``, ``image``."""
    return _imagenet_resnet(req, [3, 4, 6, 3], [1, 1, 1, 1])


def build_resnet200(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Layers [3, 24, 36, 3]; tiny [1, 2, 2, 1] at width 8. Overrides: ``width``, ``classes``, ``image``."""
    return _imagenet_resnet(req, [3, 24, 36, 3], [1, 2, 2, 1])


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck (BN-ReLU-conv three times) from "Identity Mappings in Deep Residual Networks";
    the projection shortcut, when needed, reads the first pre-activation like the paper's reference code."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), _conv1(cin, planes)
        self.bn2, self.conv2 = nn.BatchNorm2d(planes), _conv3(planes, planes, stride)
        self.bn3, self.conv3 = nn.BatchNorm2d(planes), _conv1(planes, cout)
        self.relu = nn.ReLU(inplace=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.shortcut = _conv1(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return out + identity


class _CifarStages(nn.Module):
    """The CIFAR network shape shared by the pre-activation ResNet and the Wide ResNet: a 3x3 stem, three
    stages of ``n`` blocks (the first block of stages 2 and 3 strides by 2), a final BN-ReLU, global average
    pooling and a Linear head. ``make_block(cin, stage, stride) -> (block, cout)`` builds one block."""

    def __init__(self, stem: int, n: int, classes: int, make_block) -> None:
        super().__init__()
        self.conv = _conv3(3, stem)
        stages: list[nn.Module] = []
        cin = stem
        for i in range(3):
            stage: list[nn.Module] = []
            for b in range(n):
                block, cin = make_block(cin, i, 2 if (b == 0 and i > 0) else 1)
                stage.append(block)
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn(self.stages(self.conv(x))))
        return self.fc(self.pool(out).flatten(1))


class PreActResNetCifar(_CifarStages):
    """CIFAR pre-activation bottleneck ResNet: depth = 9n + 2, three stages of n blocks with bottleneck
    widths base, 2x, 4x (outputs 4x that), a final BN-ReLU, global pool and Linear."""

    def __init__(self, depth: int, base: int = 16, classes: int = 10) -> None:
        if (depth - 2) % 9 or depth < 11:
            raise ZooError(f"pre-activation bottleneck ResNet depth must be 9n+2 with n >= 1, got {depth}")

        def block(cin: int, stage: int, stride: int) -> tuple[nn.Module, int]:
            planes = base * 2**stage
            return PreActBottleneck(cin, planes, stride=stride), planes * PreActBottleneck.expansion

        super().__init__(base, (depth - 2) // 9, classes, block)


def build_resnet1001(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Depth 1001 (111 blocks per stage, widths 16/64/128/256); tiny is depth 20 at base width 8.
    Overrides: ``depth`` (9n+2), ``width`` (first conv / first bottleneck width), ``classes``, ``image``."""
    depth = positive_int("depth", req.opt("depth", 20 if req.tiny else 1001))
    base = positive_int("width", req.opt("width", 8 if req.tiny else 16))
    classes = positive_int("classes", req.opt("classes", 10))
    side = positive_int("image", req.opt("image", 32))
    return PreActResNetCifar(depth, base, classes), (images(req, 3, side),), {}


class WideBasicBlock(nn.Module):
    """Wide ResNet block: BN-ReLU-conv3x3, BN-ReLU-Dropout-conv3x3, with a 1x1 projection when the shape
    changes (the projection reads the first pre-activation, as in the WRN reference code)."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), _conv3(cin, cout, stride)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), _conv3(cout, cout)
        self.relu = nn.ReLU(inplace=False)
        self.dropout = nn.Dropout(dropout)
        self.shortcut: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.shortcut = _conv1(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.dropout(self.relu(self.bn2(out))))
        return out + identity


class WideResNet(_CifarStages):
    """WRN-d-k for CIFAR: depth = 6n + 4, three stages of n blocks with widths 16k, 32k, 64k."""

    def __init__(self, depth: int, widen: int, dropout: float = 0.0, classes: int = 10) -> None:
        if (depth - 4) % 6 or depth < 10:
            raise ZooError(f"Wide ResNet depth must be 6n+4 with n >= 1, got {depth}")
        widths = (16 * widen, 32 * widen, 64 * widen)

        def block(cin: int, stage: int, stride: int) -> tuple[nn.Module, int]:
            return WideBasicBlock(cin, widths[stage], stride, dropout), widths[stage]

        super().__init__(16, (depth - 4) // 6, classes, block)


def build_wrn28_10(req: Request) -> tuple[nn.Module, tuple, dict]:
    """WRN-28-10; tiny is WRN-10-1 with dropout 0.3 so the block's Dropout is exercised.
    Overrides: ``depth`` (6n+4), ``widen``, ``dropout`` (real default 0.0), ``classes``, ``image``."""
    depth = positive_int("depth", req.opt("depth", 10 if req.tiny else 28))
    widen = positive_int("widen", req.opt("widen", 1 if req.tiny else 10))
    dropout = float(req.opt("dropout", 0.3 if req.tiny else 0.0))
    classes = positive_int("classes", req.opt("classes", 10))
    side = positive_int("image", req.opt("image", 32))
    return WideResNet(depth, widen, dropout, classes), (images(req, 3, side),), {}
