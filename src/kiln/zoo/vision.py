"""Vision model definitions for the zoo, written in plain ``torch.nn`` (no torchvision).

Every public factory returns a freshly initialised model in eval mode. Weights come from the
global torch RNG, so call :func:`torch.manual_seed` first for deterministic weights. Norm layers
get non-trivial random statistics via :func:`randomize_norms`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "arcface",
    "emotion_ferplus",
    "mobilenetv2",
    "randomize_norms",
    "resnet18",
    "resnet50",
    "shufflenetv2",
    "tinyyolov2",
    "vgg16",
]


@torch.no_grad()
def randomize_norms(model: nn.Module, calib_shape: tuple[int, ...] | None = None) -> nn.Module:
    """Randomise weights and norm layers so the model computes something non-trivial.

    Conv and Linear weights are drawn Kaiming-normal (fan-in, ReLU gain), biases ``N(0, 0.05)``,
    BatchNorm/LayerNorm ``weight ~ U(0.5, 1.5)``, ``bias ~ N(0, 0.1)``, PReLU slopes
    ``~ U(0.05, 0.4)``. BatchNorm running statistics: with ``calib_shape`` they are first
    calibrated on one seeded ``N(0, 1)`` batch of that shape (like a trained network, so
    activations stay O(1) through deep residual stacks) and then perturbed per channel
    (``mean += N(0, 0.1) * std``, ``var *= U(0.5, 1.5)``); without it they are drawn directly,
    ``mean ~ N(0, 0.1)``, ``var ~ U(0.5, 1.5)``. Returns ``model`` in eval mode.
    """
    bns = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                m.bias.normal_(0.0, 0.05)
        elif isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d | nn.LayerNorm):
            if m.weight is not None:
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
            if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                bns.append(m)
        elif isinstance(m, nn.PReLU):
            m.weight.uniform_(0.05, 0.4)
    model.eval()
    if calib_shape is not None and bns:
        for m in bns:  # only the BN layers in train mode: dropout stays off
            m.reset_running_stats()
            m.momentum = None  # cumulative average = exact batch statistics
            m.train()
        model(torch.randn(calib_shape))
        for m in bns:
            m.eval()
            m.momentum = 0.1
            m.running_mean.add_(torch.randn_like(m.running_mean) * 0.1 * m.running_var.sqrt())
            m.running_var.mul_(torch.empty_like(m.running_var).uniform_(0.5, 1.5))
    return model


_IMAGENET = (4, 3, 224, 224)  # calibration batch shape


def _cbr(cin: int, cout: int, k: int, s: int = 1, groups: int = 1, act: nn.Module | None = None):
    """Conv (no bias) + BatchNorm + activation (ReLU by default, ``nn.Identity()`` for none)."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True) if act is None else act,
    )


# ----------------------------------------------------------------------------- ResNet


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _cbr(cin, planes, 3, stride), _cbr(planes, planes, 3, act=nn.Identity())
        )
        self.down = _downsample(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _cbr(cin, planes, 1),
            _cbr(planes, planes, 3, stride),  # stride on the 3x3 ("ResNet v1.5")
            _cbr(planes, planes * 4, 1, act=nn.Identity()),
        )
        self.down = _downsample(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


def _downsample(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ImageNet ResNet (He et al. 2016), torchvision layout: 224x224 input, 1000 logits."""

    def __init__(self, block: type[_Basic | _Bottleneck], layers: list[int]) -> None:
        super().__init__()
        self.stem = nn.Sequential(_cbr(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for i, n in enumerate(layers):
            planes = 64 * 2**i
            for j in range(n):
                stages.append(block(cin, planes, 2 if (j == 0 and i > 0) else 1))
                cin = planes * block.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def resnet18() -> nn.Module:
    """ResNet-18 (11.7M params)."""
    return randomize_norms(ResNet(_Basic, [2, 2, 2, 2]), _IMAGENET)


def resnet50() -> nn.Module:
    """ResNet-50 v1.5 (25.6M params)."""
    return randomize_norms(ResNet(_Bottleneck, [3, 4, 6, 3]), _IMAGENET)


# ----------------------------------------------------------------------------- MobileNetV2


class _InvRes(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hid = cin * expand
        layers = [] if expand == 1 else [_cbr(cin, hid, 1, act=nn.ReLU6(inplace=True))]
        layers += [
            _cbr(hid, hid, 3, stride, groups=hid, act=nn.ReLU6(inplace=True)),
            _cbr(hid, cout, 1, act=nn.Identity()),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


def mobilenetv2() -> nn.Module:
    """MobileNetV2 1.0 (Sandler et al. 2018): ReLU6 (Clip), depthwise convs, 3.5M params."""
    cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1)]
    cfg += [(6, 160, 3, 2), (6, 320, 1, 1)]
    layers: list[nn.Module] = [_cbr(3, 32, 3, 2, act=nn.ReLU6(inplace=True))]
    cin = 32
    for t, c, n, s in cfg:
        for i in range(n):
            layers.append(_InvRes(cin, c, s if i == 0 else 1, t))
            cin = c
    layers += [_cbr(cin, 1280, 1, act=nn.ReLU6(inplace=True)), nn.AdaptiveAvgPool2d((1, 1))]
    layers += [nn.Flatten(1), nn.Dropout(0.2), nn.Linear(1280, 1000)]
    return randomize_norms(nn.Sequential(*layers), _IMAGENET)


# ----------------------------------------------------------------------------- ShuffleNetV2


def _channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.size()
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, c, h, w)


class _ShuffleUnit(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        bf = cout // 2
        self.stride = stride
        if stride > 1:
            self.branch1 = nn.Sequential(
                _cbr(cin, cin, 3, stride, groups=cin, act=nn.Identity()), _cbr(cin, bf, 1)
            )
        self.branch2 = nn.Sequential(
            _cbr(cin if stride > 1 else bf, bf, 1),
            _cbr(bf, bf, 3, stride, groups=bf, act=nn.Identity()),
            _cbr(bf, bf, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return _channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNetV2 (Ma et al. 2018): Split, Concat, Reshape/Transpose channel shuffle."""

    def __init__(self, repeats: tuple[int, ...], channels: tuple[int, ...]) -> None:
        super().__init__()
        self.stem = nn.Sequential(_cbr(3, channels[0], 3, 2), nn.MaxPool2d(3, 2, 1))
        units, cin = [], channels[0]
        for n, c in zip(repeats, channels[1:-1]):
            units += [_ShuffleUnit(cin, c, 2)] + [_ShuffleUnit(c, c, 1) for _ in range(n - 1)]
            cin = c
        self.units = nn.Sequential(*units)
        self.conv5 = _cbr(cin, channels[-1], 1)
        self.fc = nn.Linear(channels[-1], 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv5(self.units(self.stem(x))).mean([2, 3]))


def shufflenetv2() -> nn.Module:
    """ShuffleNetV2 x1.0 (2.3M params)."""
    return randomize_norms(ShuffleNetV2((4, 8, 4), (24, 116, 232, 464, 1024)), _IMAGENET)


# ----------------------------------------------------------------------------- VGG16


def vgg16() -> nn.Module:
    """VGG-16 without BN (Simonyan & Zisserman 2014): 13 convs + 3 FC, 138M params."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M"]
    cfg += [512, 512, 512, "M", 512, 512, 512, "M"]
    layers: list[nn.Module] = []
    cin = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            cin = int(v)
    layers += [nn.Flatten(1), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout()]
    layers += [nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(4096, 1000)]
    return randomize_norms(nn.Sequential(*layers))


# ----------------------------------------------------------------------------- Tiny YOLOv2


class _EdgePadPool(nn.Module):
    """Darknet's size-2 stride-1 maxpool: pad right/bottom by replication, then pool (same size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.pad(x, (0, 1, 0, 1), mode="replicate"), 2, 1)


def tinyyolov2() -> nn.Module:
    """Tiny-YOLOv2-style VOC detector: 416x416 in, 125x13x13 grid out (5 anchors x 25).

    Conv+BN+LeakyReLU(0.1) stack with five stride-2 maxpools and one stride-1 edge-padded pool.
    The two wide 3x3 convs are 512 channels (Darknet uses 1024) to keep the file ~25 MB.
    """
    leaky = lambda: nn.LeakyReLU(0.1, inplace=True)
    layers: list[nn.Module] = []
    cin = 3
    for i, c in enumerate([16, 32, 64, 128, 256, 512]):
        layers += [_cbr(cin, c, 3, act=leaky()), nn.MaxPool2d(2, 2) if i < 5 else _EdgePadPool()]
        cin = c
    layers += [_cbr(512, 512, 3, act=leaky()), _cbr(512, 512, 3, act=leaky())]
    layers.append(nn.Conv2d(512, 125, 1))
    return randomize_norms(nn.Sequential(*layers), (4, 3, 416, 416))


# ----------------------------------------------------------------------------- ArcFace


class _IRBlock(nn.Module):
    """InsightFace IR block: BN - conv3x3 - BN - PReLU - conv3x3(stride) - BN, plus shortcut."""

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin),
            nn.Conv2d(cin, planes, 3, 1, 1, bias=False),
            nn.BatchNorm2d(planes),
            nn.PReLU(planes),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False),
            nn.BatchNorm2d(planes),
        )
        self.down = _downsample(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.down(x)


class IResNet(nn.Module):
    """ArcFace-style IR-ResNet: 112x112 face crop -> 512-d embedding."""

    def __init__(self, layers: list[int], widths: list[int], emb: int = 512) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
            nn.PReLU(widths[0]),
        )
        blocks, cin = [], widths[0]
        for n, w in zip(layers, widths):
            blocks += [_IRBlock(cin, w, 2)] + [_IRBlock(w, w, 1) for _ in range(n - 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.BatchNorm2d(cin), nn.Dropout(0.4), nn.Flatten(1), nn.Linear(cin * 7 * 7, emb),
            nn.BatchNorm1d(emb),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def arcface() -> nn.Module:
    """IR-ResNet-18 at half width (32-256 channels), 512-d embedding, ~9.5M params."""
    return randomize_norms(IResNet([2, 2, 2, 2], [32, 64, 128, 256]), (8, 3, 112, 112))


# ----------------------------------------------------------------------------- FER+


def emotion_ferplus() -> nn.Module:
    """Emotion-FER+-style VGG13-like CNN (Barsoum et al. 2016): 1x64x64 gray in, 8 emotions."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 256, 256, 256, "M"]
    layers: list[nn.Module] = []
    cin = 1
    for v in cfg:
        if v == "M":
            layers += [nn.MaxPool2d(2, 2), nn.Dropout(0.25)]
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            cin = int(v)
    layers += [nn.Flatten(1), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(inplace=True), nn.Dropout()]
    layers += [nn.Linear(1024, 1024), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(1024, 8)]
    return randomize_norms(nn.Sequential(*layers))
