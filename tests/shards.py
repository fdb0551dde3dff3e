"""Simulated shards for the partition tests (`test_partition`, `test_tofu`): a tensor's k device
values under a placement, the tensor put back together from them, and training batch norm of k
parts of a batch with the statistics synchronised."""
from __future__ import annotations

import torch

from remat.solvers.partition import PARTIAL


def place(t, placement, k):
    """The k device values of tensor `t` under `placement` (partial: one device holds it, the
    others zeros, so the values sum to it)."""
    if placement.kind == "shard":
        return list(t.chunk(k, dim=placement.dim))
    if placement == PARTIAL:
        return [t] + [torch.zeros_like(t) for _ in range(k - 1)]
    return [t] * k


def combine(parts, placement):
    """The tensor from its device values under `placement` (replicated ones must agree)."""
    if placement.kind == "shard":
        return torch.cat(parts, dim=placement.dim)
    if placement == PARTIAL:
        return sum(parts)
    assert all(torch.allclose(p, parts[0]) for p in parts[1:])
    return parts[0]


def synced_batch_norm(xs, ws, bs, eps=1e-5):
    """Training batch norm of the parts `xs` of a batch (weights `ws`, biases `bs` per part) with
    the statistics synchronised as the executor does it: each part's per-channel sums added (the
    all-reduce), for the mean and then for the squares about it."""
    over = [0] + list(range(2, xs[0].dim()))
    shape = [1, -1] + [1] * (xs[0].dim() - 2)
    count = sum(x.numel() // x.shape[1] for x in xs)
    mean = sum(x.sum(over) for x in xs) / count
    var = sum((x - mean.view(shape)).square().sum(over) for x in xs) / count
    return [(x - mean.view(shape)) / (var.view(shape) + eps).sqrt() * w.view(shape) + b.view(shape)
            for x, w, b in zip(xs, ws, bs)]
