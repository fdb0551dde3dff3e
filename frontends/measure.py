"""Device-agnostic memory accounting: live tensor storages, counted once each.

`StorageTracker` is a `TorchDispatchMode` that sees every ATen op run while it is active (the
forward, and the backward the autograd engine runs on the same thread) and records the storage
of each tensor the op returns.  A storage is counted once, however many views or in-place
results alias it, and is released when the storage itself dies (a `weakref.finalize` on the
storage object; PyTorch keeps one Python object per live storage).  So the tracker's figure is
"bytes of tensor storages alive that were allocated while it watched": what a caching-free
allocator would hold.  Allocations a kernel makes internally (not as op outputs) are invisible,
as they are to any tensor-level accounting.

`measure_peak(step_fn, resident=...)` is the peak of one call: the storages of ``resident``
tensors (parameters, buffers, inputs: alive before the call) plus the peak of what the call
allocates.  On CUDA pass ``device="cuda"`` to read the caching allocator's
``max_memory_allocated`` instead (it already includes every resident tensor).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StorageTracker", "measure_peak", "storage_key", "storage_bytes", "unique_bytes"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage while it is alive (the StorageImpl's address)."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def unique_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages among `tensors` (non-tensors are skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen.setdefault(storage_key(t), storage_bytes(t))
    return sum(seen.values())


class StorageTracker(TorchDispatchMode):
    """Counts bytes of live storages allocated by ops while active.

    ``current`` and ``peak`` are bytes; ``events`` (when ``record_events``) is the list of
    ``(key, +bytes | -bytes)`` allocations and releases in order, so a caller can recompute the
    peak over a window, leaving out storages it learns about only later (`peak_between`).
    Storages already alive when first seen as an op output (views of parameters, say) are
    counted from that moment; pass them to `ignore` to leave them out.
    """

    def __init__(self, record_events: bool = False):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.ignored: set[int] = set()
        self.record_events = record_events
        self.events: list[tuple[int, int]] = []

    # ---- bookkeeping -------------------------------------------------------------------
    def ignore(self, tensors: Iterable[Any]) -> None:
        """Never count these tensors' storages (parameters, inputs: resident already)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.ignored.add(storage_key(t))

    def reset_peak(self) -> None:
        self.peak = self.current

    def mark(self) -> int:
        """Position in the event list (for `peak_between`)."""
        return len(self.events)

    def _release(self, key: int) -> None:
        nb = self.live.pop(key, None)
        if nb is None:
            return
        self.current -= nb
        if self.record_events:
            self.events.append((key, -nb))

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or key in self.ignored:
            return
        nb = int(st.nbytes())
        self.live[key] = nb
        self.current += nb
        if self.current > self.peak:
            self.peak = self.current
        if self.record_events:
            self.events.append((key, nb))
        weakref.finalize(st, self._release, key)

    def peak_between(self, start: int, end: int | None = None, exclude: Iterable[int] = ()) -> int:
        """Peak, relative to the live bytes at event `start`, of the events in [start, end),
        leaving out the storages in `exclude`."""
        ex = set(exclude)
        cur = peak = 0
        for key, delta in self.events[start:end]:
            if key in ex:
                continue
            cur += delta
            peak = max(peak, cur)
        return peak

    def new_live(self, start: int) -> dict[int, int]:
        """Storages allocated since event `start` that are still alive: {key: bytes}."""
        out: dict[int, int] = {}
        for key, delta in self.events[start:]:
            if delta > 0 and key in self.live:
                out[key] = delta
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def measure_peak(step_fn: Callable[[], Any], resident: Iterable[Any] = (), device: "str | torch.device | None" = None) -> int:
    """Peak bytes of one call of `step_fn` (a training step, say).

    CPU (or any device with ``device=None``): unique storages of `resident` (parameters,
    buffers, inputs, gradients that exist before the call) plus the peak of the storages the
    call allocates (`StorageTracker`).  CUDA: ``torch.cuda.max_memory_allocated`` over the call,
    which counts everything on the device.
    """
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step_fn()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev))
    resident = [t for t in resident if isinstance(t, torch.Tensor)]
    base = unique_bytes(resident)
    tracker = StorageTracker()
    tracker.ignore(resident)
    with tracker:
        step_fn()
    return base + tracker.peak
