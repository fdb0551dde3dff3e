"""What a user does by hand instead of a plan: ``torch.utils.checkpoint`` on every block.

`Checkpointed` runs a module through the non-reentrant checkpoint (RNG state preserved), so only
its inputs stay saved for the backward and its insides are recomputed there;
`checkpoint_every_block` wraps, in a copy of a model, the blocks a user would pick: the repeated
blocks at the model's automatic depth (`block_names`: a transformer's layers, a ResNet's
bottlenecks), or modules named explicitly.
"""
from __future__ import annotations

import copy
from typing import Iterable

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .segments import auto_depth, group_modules, repeated_blocks


class Checkpointed(nn.Module):
    """A block run through torch.utils.checkpoint (non-reentrant, RNG state preserved)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def block_names(model: nn.Module) -> list[str]:
    """Paths of the repeated blocks at the model's automatic depth, in model order, those with
    submodules of their own where there are such (a transformer's layers, not its two
    embeddings); [] if none."""
    names = repeated_blocks(group_modules(model, auto_depth(model)))
    composite = [n for n in names if any(True for _ in model.get_submodule(n).children())]
    return composite or names


def checkpoint_every_block(model: nn.Module, names: Iterable[str] | None = None) -> nn.Module:
    """A deep copy of `model` with each module of `names` (default `block_names`) wrapped in
    `Checkpointed`.  Raises ValueError for a name that is not a module of the model."""
    model = copy.deepcopy(model)
    mods = dict(model.named_modules())
    for name in block_names(model) if names is None else names:
        if name not in mods or not name:
            raise ValueError(f"checkpoint_every_block: {name!r} is not a submodule of the model")
        parent_name, _, attr = name.rpartition(".")
        parent = mods[parent_name] if parent_name else model
        setattr(parent, attr, Checkpointed(getattr(parent, attr)))
    return model


__all__ = ["Checkpointed", "block_names", "checkpoint_every_block"]
