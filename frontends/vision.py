"""torchvision and timm models for the real-model suite and the benchmarks (random init, no
downloads).

``torchvision()`` imports torchvision.  PyPI's torchvision wheels for x86_64 are CUDA builds
whose compiled ops do not load beside PyTorch's CPU build; their model definitions are plain
Python, but ``import torchvision`` then fails registering fake kernels for two detection ops
(``torchvision::nms``, ``torchvision::qnms``) whose schemas the compiled library would have
defined.  Where that is why the import fails, the two schemas are declared (no kernels: calling
the ops raises) and torchvision is imported again, so its classification models (and timm, which
imports torchvision) work; where torchvision's ops load, nothing is declared.  transformers
imports torchvision too where it is installed: `prepare()` before importing its models.

``get(name, batch=..., **kw) -> (model, (images, labels))`` builds a classifier in training
mode with its example batch; train it with `cross_entropy` (``loss_fn(logits, images, labels)``).
``tiny=True`` (default) gives the suite's configurations (seconds on a CPU), ``tiny=False`` the
published architecture at 224 px.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["torchvision", "prepare", "timm", "get", "names", "cross_entropy"]

_DETECTION_OPS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                  "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_declared: list = []    # the Library objects that hold the declared schemas alive


def torchvision() -> ModuleType:
    """``import torchvision``, declaring the detection ops' schemas where its compiled library did
    not load (see the module docstring).  Raises ImportError when it is not installed."""
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
    for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[key]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _DETECTION_OPS:
        lib.define(schema)
    _declared.append(lib)
    return importlib.import_module("torchvision")


def prepare() -> None:
    """Import torchvision now, where it is installed (see `torchvision`), so that packages that
    import it on their own (transformers' model classes do) find it working: call before
    importing them.  Nothing where torchvision is not installed."""
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        torchvision()


def timm() -> ModuleType:
    """``import timm`` (after `torchvision`, which it imports)."""
    torchvision()
    return importlib.import_module("timm")


def cross_entropy(logits: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The classification loss a user's loop computes: ``loss_fn(output, *inputs)`` for a batch
    ``(images, labels)``, the labels an input of the graph like the images."""
    return F.cross_entropy(logits, labels)


def _resnet50(tiny: bool, dropout: float):
    models = torchvision().models
    if not tiny:
        return models.resnet50(num_classes=1000), 224
    return models.resnet.ResNet(models.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16), 96


def _vit_b_16(tiny: bool, dropout: float):
    models = torchvision().models
    if not tiny:
        return models.vit_b_16(dropout=dropout, attention_dropout=dropout), 224
    return models.VisionTransformer(image_size=64, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64, dropout=dropout, attention_dropout=dropout, num_classes=10), 64


def _convnext(tiny: bool, dropout: float):
    models = torchvision().models
    if not tiny:
        return models.convnext_tiny(), 224
    cfg = models.convnext.CNBlockConfig
    return models.ConvNeXt([cfg(16, 32, 1), cfg(32, None, 1)], stochastic_depth_prob=0.0, num_classes=10), 32


def _timm_vit(tiny: bool, dropout: float):
    create = timm().create_model
    if not tiny:
        return create("vit_small_patch16_224", pretrained=False, drop_rate=dropout), 224
    return create("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2,
                  num_heads=2, mlp_ratio=2.0, num_classes=10, drop_rate=dropout, proj_drop_rate=dropout), 32


_BUILDERS: dict[str, Callable] = {"resnet50": _resnet50, "vit_b_16": _vit_b_16, "convnext": _convnext,
                                  "timm_vit": _timm_vit}


def names() -> list[str]:
    return sorted(_BUILDERS)


def get(name: str, batch: int = 2, tiny: bool = True, dropout: float = 0.1, seed: int = 0):
    """``(model, (images, labels))``: model `name` (`names()`), random init from `seed`, in
    training mode; a batch of `batch` random images at its size and random labels."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown vision model {name!r}; expected one of {names()}")
    torch.manual_seed(seed)
    model, size = _BUILDERS[name](tiny, dropout)
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(batch, 3, size, size, generator=g)
    classes = model.num_classes if hasattr(model, "num_classes") else 10
    labels = torch.randint(0, int(classes), (batch,), generator=g)
    return model, (images, labels)

