"""A small model zoo, built locally in plain PyTorch (random init, no downloads).

``get(name, **kw) -> (model, example_inputs)``; ``names()`` lists the models.  Every model has a
*small* default (a few MB, seconds on a CPU, for tests) and a *full* configuration
(``full=True``: the published architecture at its usual input size).  Keyword arguments
override either: ``batch`` and the input size (``image_size`` for the CNNs, ``seq_len`` for
GPT-2) plus each model's own knobs, listed in `CONFIGS`.

=============  ============================================  =================================
name           small default                                 full (``full=True``)
=============  ============================================  =================================
resnet18       batch 2, 3x32x32, width 16                    batch 32, 3x224x224, width 64
resnet50       batch 2, 3x32x32, width 16                    batch 32, 3x224x224, width 64
vgg16          batch 2, 3x32x32, widths /8, hidden 128       batch 32, 3x224x224, hidden 4096
mobilenet_v2   batch 2, 3x32x32, width_mult 0.25             batch 32, 3x224x224, width_mult 1
unet           batch 2, 3x32x32, base 8, depth 3             batch 8, 3x256x256, base 64, depth 4
gpt2           batch 2, seq 32, 2 layers, width 64, vocab 256  batch 8, seq 1024, 12 layers, 768, vocab 50257
=============  ============================================  =================================

The CNNs return logits (the U-Net a segmentation map); `remat.trace`'s default loss sums them.
GPT-2 takes ``(idx, targets)`` and returns the cross-entropy loss, as nanoGPT does; its
``lm_head`` shares its weight with the token embedding.  Structure follows torchvision and
nanoGPT (ReLU in place in the ResNets and VGG, BatchNorm, Dropout in VGG's classifier and
GPT-2), so the zoo covers in-place ops, running statistics, random ops and shared parameters.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["get", "names", "CONFIGS", "SEQUENCE_MODELS"]


# ---- ResNet (torchvision layout) ----------------------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], 2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], 2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# ---- VGG-16 (configuration D) ----------------------------------------------------------------
VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, num_classes: int = 1000, width_div: int = 1, hidden: int = 4096, pool: int = 7,
                 dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for v in VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                out = max(1, v // width_div)
                layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(inplace=True)]
                c = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = nn.Sequential(
            nn.Linear(c * pool * pool, hidden), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes))

    def forward(self, x):
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return self.classifier(x)


# ---- MobileNetV2 -------------------------------------------------------------------------------
def _make_divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class ConvBNReLU(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1, act: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.ReLU6(inplace=True) if act else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = int(round(cin * expand))
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvBNReLU(cin, hidden, 1))
        layers += [ConvBNReLU(hidden, hidden, 3, stride, groups=hidden), ConvBNReLU(hidden, cout, 1, act=False)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1)]

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2):
        super().__init__()
        cin = _make_divisible(32 * width_mult)
        last = _make_divisible(1280 * max(1.0, width_mult))
        feats: list[nn.Module] = [ConvBNReLU(3, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c * width_mult)
            for i in range(n):
                feats.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        feats.append(ConvBNReLU(cin, last, 1))
        self.features = nn.Sequential(*feats)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


# ---- U-Net (Ronneberger et al., with BatchNorm and padding) -----------------------------------
class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class Down(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = DoubleConv(cin, cout)

    def forward(self, x):
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 2, base: int = 64, depth: int = 4):
        super().__init__()
        chans = [base * 2 ** i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, chans[0])
        self.downs = nn.ModuleList([Down(chans[i], chans[i + 1]) for i in range(depth)])
        self.ups = nn.ModuleList([Up(chans[i + 1], chans[i]) for i in reversed(range(depth))])
        self.outc = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


# ---- GPT-2 (nanoGPT layout) -------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 50257, block_size: int = 1024, n_layer: int = 12, n_head: int = 12,
                 n_embd: int = 768, dropout: float = 0.1):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one parameter, two modules
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(pos))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# ---- registry ----------------------------------------------------------------------------------
def _images(batch: int, image_size: int, channels: int = 3) -> tuple:
    return (torch.randn(batch, channels, image_size, image_size),)


def _resnet(block, layers):
    def build(batch: int, image_size: int, width: int, num_classes: int):
        return ResNet(block, layers, num_classes, width), _images(batch, image_size)
    return build


def _vgg16(batch: int, image_size: int, width_div: int, hidden: int, pool: int, num_classes: int, dropout: float):
    return VGG(num_classes, width_div, hidden, pool, dropout), _images(batch, image_size)


def _mobilenet(batch: int, image_size: int, width_mult: float, num_classes: int):
    return MobileNetV2(num_classes, width_mult), _images(batch, image_size)


def _unet(batch: int, image_size: int, base: int, depth: int, num_classes: int):
    if image_size % (2 ** depth):
        raise ValueError(f"unet: image_size {image_size} must be a multiple of 2**depth = {2 ** depth}")
    return UNet(3, num_classes, base, depth), _images(batch, image_size)


def _gpt2(batch: int, seq_len: int, n_layer: int, n_head: int, n_embd: int, vocab_size: int, dropout: float):
    model = GPT(vocab_size, seq_len, n_layer, n_head, n_embd, dropout)
    idx = torch.randint(0, vocab_size, (batch, seq_len))
    targets = torch.randint(0, vocab_size, (batch, seq_len))
    return model, (idx, targets)


# name -> (builder, small defaults, full overrides)
CONFIGS: dict[str, tuple[Callable, dict, dict]] = {
    "resnet18": (_resnet(BasicBlock, [2, 2, 2, 2]), dict(batch=2, image_size=32, width=16, num_classes=10),
                 dict(batch=32, image_size=224, width=64, num_classes=1000)),
    "resnet50": (_resnet(Bottleneck, [3, 4, 6, 3]), dict(batch=2, image_size=32, width=16, num_classes=10),
                 dict(batch=32, image_size=224, width=64, num_classes=1000)),
    "vgg16": (_vgg16, dict(batch=2, image_size=32, width_div=8, hidden=128, pool=1, num_classes=10, dropout=0.5),
              dict(batch=32, image_size=224, width_div=1, hidden=4096, pool=7, num_classes=1000)),
    "mobilenet_v2": (_mobilenet, dict(batch=2, image_size=32, width_mult=0.25, num_classes=10),
                     dict(batch=32, image_size=224, width_mult=1.0, num_classes=1000)),
    "unet": (_unet, dict(batch=2, image_size=32, base=8, depth=3, num_classes=2),
             dict(batch=8, image_size=256, base=64, depth=4)),
    "gpt2": (_gpt2, dict(batch=2, seq_len=32, n_layer=2, n_head=4, n_embd=64, vocab_size=256, dropout=0.1),
             dict(batch=8, seq_len=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50257)),
}


def _shape_settings(name: str, shape: tuple) -> dict:
    if name == "gpt2":
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"gpt2: input shape is (sequence length,), got {shape}")
        return {"seq_len": shape[0]}
    if len(shape) != 3 or shape[0] != 3 or shape[1] != shape[2] or shape[1] < 1:
        raise ValueError(f"{name}: input shape is (3, H, W) with H = W, got {shape}")
    return {"image_size": shape[1]}


SEQUENCE_MODELS = ("gpt2",)  # the zoo models whose input shape is a sequence length


def names() -> list[str]:
    return list(CONFIGS)


def get(name: str, *, full: bool = False, seed: int | None = 0, input_shape: tuple | list | None = None,
        **overrides: Any) -> tuple[nn.Module, tuple]:
    """Build zoo model `name` with its example inputs: ``(model, example_inputs)``.

    ``full=True`` selects the published size; other keywords override single settings (see
    `CONFIGS`; None leaves a setting at its default).  ``input_shape`` is the shape of one
    example without the batch: ``(3, H, W)`` for the CNNs (H = W), ``(T,)`` for GPT-2.
    ``seed`` makes the random init and inputs reproducible (None: leave the global RNG alone).
    The model is in training mode, on the CPU, float32.
    """
    if name not in CONFIGS:
        raise KeyError(f"unknown zoo model {name!r}; available: {', '.join(names())}")
    build, small, large = CONFIGS[name]
    cfg = {**small, **(large if full else {})}
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"zoo model {name!r} has no setting {sorted(unknown)[0]!r}; settings: {', '.join(cfg)}")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    if input_shape is not None:
        cfg.update(_shape_settings(name, tuple(int(d) for d in input_shape)))
    if seed is None:
        model, inputs = build(**cfg)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, inputs = build(**cfg)
    return model.train(), inputs
