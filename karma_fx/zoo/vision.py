"""The simple classifiers of the zoo: an MLP, a small CNN and VGG16.

They exist to give the planner small, well-understood graphs (the MLP and CNN) and one classic
activation-heavy network with huge fully connected layers (VGG16, 138M parameters, most in the classifier).
"""
from __future__ import annotations

import torch
from torch import nn

from karma_fx.zoo._common import Request, images, positive_int


class MLP(nn.Module):
    """Three Linear layers with ReLU between them; returns logits."""

    def __init__(self, in_features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def build_mlp(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Overrides: ``hidden``, ``in_features``, ``classes``."""
    in_features = positive_int("in_features", req.opt("in_features", 32 if req.tiny else 1024))
    hidden = positive_int("hidden", req.opt("hidden", 64 if req.tiny else 4096))
    classes = positive_int("classes", req.opt("classes", 10 if req.tiny else 1000))
    model = MLP(in_features, hidden, classes)
    x = torch.randn(req.batch, in_features, dtype=torch.float32, device=req.device)
    return model, (x,), {}


class SmallCNN(nn.Module):
    """Three Conv-BN-ReLU stages (the last two stride 2), global average pool, Dropout, Linear head.

    Small on purpose, but it has every op kind that matters to a planner: in-place-able ReLU, BatchNorm with
    running statistics (a mutated buffer), and Dropout (randomness a recompute must replay).
    """

    def __init__(self, width: int, classes: int, dropout: float = 0.5) -> None:
        super().__init__()
        chans = (3, width, 2 * width, 4 * width)
        layers: list[nn.Module] = []
        for i in range(3):
            layers += [
                nn.Conv2d(chans[i], chans[i + 1], 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                nn.BatchNorm2d(chans[i + 1]),
                nn.ReLU(inplace=True),
            ]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(chans[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x)).flatten(1)
        return self.head(self.dropout(x))


def build_cnn(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Overrides: ``width`` (channels of the first conv), ``classes``, ``image`` (input side)."""
    width = positive_int("width", req.opt("width", 8 if req.tiny else 64))
    classes = positive_int("classes", req.opt("classes", 10))
    side = positive_int("image", req.opt("image", 32))
    return SmallCNN(width, classes), (images(req, 3, side),), {}


# VGG16 ("configuration D"): conv widths, "M" for a 2x2 max pool.
VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)


class VGG(nn.Module):
    """VGG with an optional BatchNorm after each conv, adaptive pooling and the 3-layer classifier."""

    def __init__(
        self,
        cfg: tuple[int | str, ...],
        *,
        width_div: int = 1,
        batch_norm: bool = False,
        pool: int = 7,
        hidden: int = 4096,
        classes: int = 1000,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        chans = 3
        for item in cfg:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            out = max(1, int(item) // width_div)
            layers.append(nn.Conv2d(chans, out, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            chans = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = nn.Sequential(
            nn.Linear(chans * pool * pool, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def build_vgg16(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Overrides: ``batch_norm`` (default False, the original VGG16), ``classes``, ``image``.

    Tiny keeps all 13 convs and 5 pools but divides the widths by 16 and shrinks the classifier, so the graph
    has the real topology at a CPU-test cost.
    """
    batch_norm = bool(req.opt("batch_norm", False))
    classes = positive_int("classes", req.opt("classes", 10 if req.tiny else 1000))
    side = positive_int("image", req.opt("image", 32 if req.tiny else 224))
    if req.tiny:
        model = VGG(VGG16_CFG, width_div=16, batch_norm=batch_norm, pool=1, hidden=64, classes=classes)
    else:
        model = VGG(VGG16_CFG, batch_norm=batch_norm, classes=classes)
    return model, (images(req, 3, side),), {}
