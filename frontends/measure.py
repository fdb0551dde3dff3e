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

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StorageTracker", "measure_peak", "measure", "Measurement", "storage_key", "storage_bytes", "unique_bytes"]


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
    ``(uid, +bytes | -bytes)`` allocations and releases in order, so a caller can recompute the
    peak over a window, leaving out storages it learns about only later (`peak_between`).  A
    uid names one storage for its whole life (addresses are reused once a storage dies; uids are
    not); `uid` gives the uid of a live tensor's storage.  Storages already alive when first seen
    as an op output (views of parameters, say) are counted from that moment; pass them to
    `ignore` to leave them out.
    """

    def __init__(self, record_events: bool = False):
        super().__init__()
        self.live: dict[int, tuple[int, int]] = {}   # storage address -> (uid, bytes)
        self.current = 0
        self.peak = 0
        self.ignored: set[int] = set()
        self.record_events = record_events
        self.events: list[tuple[int, int]] = []
        self._next_uid = 0

    # ---- bookkeeping -------------------------------------------------------------------
    def ignore(self, tensors: Iterable[Any]) -> None:
        """Never count these tensors' storages (parameters, inputs: resident already).  They
        must stay alive while the tracker is used."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.ignored.add(storage_key(t))

    def reset_peak(self) -> None:
        self.peak = self.current

    def mark(self) -> int:
        """Position in the event list (for `peak_between`)."""
        return len(self.events)

    def uid(self, t: torch.Tensor) -> int | None:
        """uid of a live tracked tensor's storage (None if not tracked)."""
        entry = self.live.get(storage_key(t))
        return entry[0] if entry else None

    def _release(self, key: int, uid: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[0] != uid:
            return
        del self.live[key]
        self.current -= entry[1]
        if self.record_events:
            self.events.append((uid, -entry[1]))

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or key in self.ignored:
            return
        nb = int(st.nbytes())
        uid = self._next_uid
        self._next_uid += 1
        self.live[key] = (uid, nb)
        self.current += nb
        if self.current > self.peak:
            self.peak = self.current
        if self.record_events:
            self.events.append((uid, nb))
        weakref.finalize(st, self._release, key, uid)

    def peak_between(self, start: int, end: int | None = None, exclude: Iterable[int] = ()) -> int:
        """Peak, relative to the live bytes at event `start`, of the events in [start, end),
        leaving out the storages whose uids are in `exclude`."""
        ex = set(exclude)
        cur = peak = 0
        for uid, delta in self.events[start:end]:
            if uid in ex:
                continue
            cur += delta
            peak = max(peak, cur)
        return peak

    def new_live(self, start: int) -> dict[int, int]:
        """Storages allocated since event `start` that are still alive: {uid: bytes}."""
        alive = {uid for uid, _ in self.live.values()}
        return {uid: delta for uid, delta in self.events[start:] if delta > 0 and uid in alive}

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


@dataclass
class Measurement:
    """One measured step: peak device bytes and wall time (seconds)."""
    peak_bytes: int
    time: float
    device: str


def measure(step_fn: Callable[[], Any], device: "str | torch.device | None" = None,
            resident: Iterable[Any] = ()) -> Measurement:
    """Peak device bytes and wall time of one call of `step_fn` (``remat.measure``).

    CUDA: ``torch.cuda.max_memory_allocated`` over the call (everything on the device counts;
    `resident` is ignored) and the time between synchronisations.  CPU: `measure_peak`'s exact
    accounting of live storages: `resident` tensors (parameters, buffers, inputs, gradients kept
    from a previous step) plus the peak of what the call allocates; host buffers of swapped-out
    tensors are not device bytes (the executor takes them outside the accounting).  The time
    on the CPU includes the accounting's per-op overhead: compare ratios of times measured the
    same way.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    box: list[float] = []

    def timed() -> None:
        t0 = time.perf_counter()
        step_fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        box.append(time.perf_counter() - t0)
    peak = measure_peak(timed, resident=resident, device=dev if dev.type == "cuda" else None)
    return Measurement(int(peak), box[0], str(dev))


def plain_step_peaks(model: torch.nn.Module, inputs: tuple, loss_fn: Callable | None = None) -> tuple[int, int]:
    """Peak bytes of one plain training step (forward, loss, backward) of `model` on `inputs`:
    (with the gradients kept from a previous step, as `zero_grad(set_to_none=False)` leaves
    them; with them freed, PyTorch's default `set_to_none=True`).  The model's state is
    restored afterwards; its gradients are left as None."""
    if loss_fn is None:
        from .trace import default_loss as loss_fn

    def step() -> None:
        loss_fn(model(*inputs), *inputs).backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    resident = list(model.parameters()) + list(model.buffers()) + list(inputs)
    step()
    model.zero_grad(set_to_none=False)
    kept = measure_peak(step, resident=resident + [p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    freed = measure_peak(step, resident=resident)
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    return kept, freed
