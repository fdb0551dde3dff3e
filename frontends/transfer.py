"""Device <-> host copies for the executor's swap ops: a reusable host buffer pool and a side
stream.

A swap copies whole *storages* (a tensor and its views share one storage, which moves once).

* CUDA: host buffers are pinned and reused across steps (`HostPool`, keyed by size, so a
  steady training loop allocates pinned memory only in its first step); copies run with
  ``non_blocking=True`` on one side stream that first waits for the compute stream (the values
  it copies were produced there); each transfer records an event, and the executor's ``wait``
  op (or the first use of a swapped-in value) makes the compute stream wait for it.  A
  swapped-out device storage is marked with ``record_stream(side)``, so the caching allocator
  never hands its block to another tensor before the copy has read it.  A swapped-in storage
  is allocated on the compute stream (which then owns it) before the side stream writes it.
* CPU: streams and pinning are no-ops, copies are synchronous, and host buffers are ordinary
  CPU memory taken outside any active `TorchDispatchMode`, so `StorageTracker` (the CPU's
  device accounting) counts them as host, never as device bytes; device copies made by a
  swap-in are ordinary tracked allocations.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .measuring import block_bytes

__all__ = ["HostPool", "Transfers", "StorageSet"]


class StorageSet:
    """Tensors gathered by storage for a swap: `add` returns a layout (slot of the storage, size,
    stride, offset, dtype) and `storages` lists each distinct storage once, so views move with
    their base; `view` rebuilds a tensor from a layout over copied storages."""

    def __init__(self):
        self._slots: dict[int, int] = {}
        self.storages: list = []

    def add(self, t: torch.Tensor) -> tuple:
        st = t.untyped_storage()
        slot = self._slots.setdefault(st._cdata, len(self.storages))
        if slot == len(self.storages):
            self.storages.append(st)
        return slot, t.size(), t.stride(), t.storage_offset(), t.dtype

    @staticmethod
    def view(storages: list, layout: tuple, device: torch.device) -> torch.Tensor:
        slot, size, stride, offset, dtype = layout
        return torch.empty(0, dtype=dtype, device=device).set_(storages[slot], offset, size, stride)


class HostPool:
    """Host buffers (uint8 tensors, pinned when `pin`) reused by size.  `take` hands out a
    buffer for the rest of the step, `release_all` returns every buffer at the step's end.
    ``in_use``/``peak`` count bytes handed out (the step's host bytes); ``capacity`` the bytes
    the pool holds in all."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._used: list[tuple[torch.Tensor, int]] = []   # (buffer, bytes counted)
        self.in_use = 0
        self.peak = 0
        self.capacity = 0

    def take(self, nbytes: int, counted: int | None = None) -> torch.Tensor:
        """A buffer of `nbytes`; `counted` (default `nbytes`) is what it adds to the step's host
        bytes (the device bytes it stands for)."""
        free = self._free[nbytes]
        if free:
            buf = free.pop()
        else:
            with _disable_current_modes():
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.capacity += nbytes
        counted = nbytes if counted is None else counted
        self._used.append((buf, counted))
        self.in_use += counted
        self.peak = max(self.peak, self.in_use)
        return buf

    def release_all(self) -> None:
        for buf, _ in self._used:
            self._free[buf.numel()].append(buf)
        self._used.clear()
        self.in_use = 0

    def reset_peak(self) -> None:
        self.peak = self.in_use


class Transfers:
    """Copies between `device` and the host, on a side stream when the device is CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = HostPool(pin=self.cuda)
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def _event_after(self, fn) -> Any:
        """Run `fn` on the side stream after the compute stream's pending work; an event for
        its completion (None on the CPU, where `fn` has finished when this returns)."""
        if not self.cuda:
            with _disable_current_modes():
                fn()
            return None
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            fn()
            done = torch.cuda.Event()
            done.record(self.side)
        return done

    def to_host(self, storages: list) -> tuple[list[torch.Tensor], Any]:
        """Start copying device `storages` (UntypedStorage) into pool buffers: (buffers, event)."""
        # counted as the device bytes they free (the allocator's blocks), as the plan counts them
        bufs = [self.pool.take(int(s.nbytes()), block_bytes(s.nbytes(), self.device)) for s in storages]

        def copy() -> None:
            for s, b in zip(storages, bufs):
                b.untyped_storage().copy_(s, non_blocking=self.cuda)
                if self.cuda:
                    # the block must outlive the copy even if the compute stream frees it first
                    torch.empty(0, dtype=torch.uint8, device=self.device).set_(s).record_stream(self.side)
        return bufs, self._event_after(copy)

    def to_device(self, bufs: list[torch.Tensor]) -> tuple[list, Any]:
        """Start copying host buffers back into fresh device storages: (storages, event).  The
        device bytes are allocated now, on the compute stream (counted from this moment)."""
        dev = [torch.empty(b.numel(), dtype=torch.uint8, device=self.device) for b in bufs]

        def copy() -> None:
            for d, b in zip(dev, bufs):
                d.copy_(b, non_blocking=self.cuda)
        event = self._event_after(copy)
        return [d.untyped_storage() for d in dev], event

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for a transfer (a no-op on the CPU)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def end_step(self) -> None:
        """All of the step's transfers are done: the host buffers go back to the pool."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.pool.release_all()
