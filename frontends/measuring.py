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

import bisect
import contextlib
import gc
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["StorageTracker", "measure_peak", "allocator_peak", "AllocationLog", "METERS", "measure", "Measurement", "storage_key", "storage_bytes", "unique_bytes",
           "block_bytes", "AllocatorWindow", "LibraryWorkspaces", "untracked_device_bytes",
           "untracked_blocks", "unowned_bytes", "on_autograd_thread"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage while it is alive (the StorageImpl's address)."""
    return t.untyped_storage()._cdata


CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


def block_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes a storage of `nbytes` takes on `device`: on CUDA rounded up to the caching
    allocator's 512-byte blocks (what ``memory_allocated`` counts), elsewhere exact."""
    if device.type == "cuda":
        return max(CUDA_BLOCK, -(-int(nbytes) // CUDA_BLOCK) * CUDA_BLOCK)
    return int(nbytes)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage as its device holds them (`block_bytes`)."""
    return block_bytes(t.untyped_storage().nbytes(), t.device)


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

    Compiled code (``torch.compile``) runs eagerly while the tracker is active, op by op, so what
    it counts is the eager step's storages.  It is entered with ``torch.compiler.set_stance(
    "force_eager")``: dynamo meeting a frame under a dispatch mode would otherwise mark the
    frame's code as never to compile again, and the module would run eagerly ever after.
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

    def __enter__(self) -> "StorageTracker":
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._stance.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._stance.__exit__(None, None, None)

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

    @property
    def next_uid(self) -> int:
        """The uid the next storage seen will get: uids from it on are the storages allocated since."""
        return self._next_uid

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
        if is_traceable_wrapper_subclass(t):
            return   # (a DTensor: its storage is its local tensor's, tracked where an op makes it)
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or key in self.ignored:
            return
        nb = block_bytes(st.nbytes(), t.device)
        uid = self._next_uid
        self._next_uid += 1
        self.live[key] = (uid, nb)
        self.current += nb
        if self.current > self.peak:
            self.peak = self.current
        if self.record_events:
            self.events.append((uid, nb))
        weakref.finalize(st, self._release, key, uid)

    def peak_between(self, start: int, end: int | None = None, exclude: Iterable[int] = (),
                     own_frees_only: bool = False) -> int:
        """Peak, relative to the live bytes at event `start`, of the events in [start, end),
        leaving out the storages whose uids are in `exclude`.  `own_frees_only`: a free counts
        only for a storage allocated within the events, as the CPU allocator's log counts them
        (`AllocationLog`): the peak of what the block itself allocated."""
        ex = set(exclude)
        made: set = set()
        cur = peak = 0
        for uid, delta in self.events[start:end]:
            if uid in ex:
                continue
            if own_frees_only:
                if delta > 0:
                    made.add(uid)
                elif uid not in made:
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


class AllocatorWindow:
    """The allocator over a block: ``peak`` is the most allocated bytes, relative to the start.
    Beside a `StorageTracker` it shows what kernels allocate internally, which no tensor-level
    accounting sees (cuDNN's convolution workspaces, attention kernels' scratch buffers; on a CPU
    a convolution's reordered weights, a dropout's float copy of its mask): `hidden`.  On CUDA
    the caching allocator's counters (counted when allocations are made, on the host: no
    synchronisation); on a CPU, with `cpu_events`, one profiler session (`AllocationLog`, a few
    milliseconds; none while another profiler runs), else nothing (``peak`` 0)."""

    def __init__(self, device: torch.device, cpu_events: bool = False):
        self.cuda = device.type == "cuda"
        self.device = device
        self.peak = self.start = 0
        self._log = (AllocationLog() if not self.cuda and cpu_events and not torch._C._autograd._profiler_enabled()
                     else None)

    def __enter__(self) -> "AllocatorWindow":
        if self.cuda:
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._log is not None:
            self._log.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        elif self._log is not None:
            self._log.__exit__(*exc)
            self.peak = int(self._log.peaks().get(None, 0)) if exc[0] is None else 0
        return False

    @property
    def own_frees_only(self) -> bool:
        """How the tracker's peak must be taken to compare with ``peak``: CUDA's counters see
        every free in the block, the CPU's log only frees of blocks allocated inside it (a
        backward letting go of the forward's saved tensors lowers the one, not the other)."""
        return not self.cuda

    def hidden(self, tracker: "StorageTracker", start: int, end: int | None = None) -> int:
        """Bytes the allocator held above the tracker's peak over the same events [start, end),
        taken as the allocator counts (`own_frees_only`): kernels' internal allocations."""
        return max(0, self.peak - tracker.peak_between(start, end, own_frees_only=self.own_frees_only))


class LibraryWorkspaces:
    """Device bytes the CUDA libraries keep once a step has run: cuBLAS (and cuBLASLt) hold a
    workspace per thread and stream that ran a matrix product (32 MiB and more on Hopper),
    allocated through PyTorch's caching allocator and counted by ``max_memory_allocated``.
    A training step needs two: one on the thread that runs the forward, one on autograd's
    device thread that runs the backward.  Use as ``with LibraryWorkspaces(dev) as w: <run the
    step's kernels on those threads>``, then ``w.bytes`` = `untracked_device_bytes` after the
    block: the allocated bytes no live tensor holds (workspaces made before the block count
    too: they stay resident through the step).  0 off CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = 0

    def __enter__(self) -> "LibraryWorkspaces":
        return self

    def __exit__(self, *exc) -> bool:
        if self.device.type == "cuda" and exc[0] is None:
            self.bytes = untracked_device_bytes(self.device)
        return False


def untracked_device_bytes(device: torch.device) -> int:
    """Bytes in the CUDA caching allocator's live blocks on `device` that no Python-visible
    tensor (nor its ``.grad``) has its storage in: the libraries' workspaces, and whatever C++
    alone keeps (an autograd graph still referenced).  From ``torch.cuda.memory_snapshot``:
    a storage starts at its block's address, so tensors that hold no device memory (fake
    tensors of a captured graph) match no block.  Collects garbage first; 0 off CUDA."""
    return sum(untracked_blocks(device).values())


def untracked_blocks(device: torch.device) -> dict[int, int]:
    """The blocks `untracked_device_bytes` adds up, ``{address: bytes}`` ({} off CUDA)."""
    if device.type != "cuda":
        return {}
    gc.collect()
    torch.cuda.synchronize(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    blocks = {b["address"]: b["size"] for seg in torch.cuda.memory_snapshot() if seg.get("device") == index
              for b in seg.get("blocks", ()) if b.get("state") == "active_allocated"}
    with warnings.catch_warnings():
        # isinstance on every live object touches deprecated module attributes that warn
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return unowned_blocks(blocks, tensors, "cuda")


def unowned_bytes(blocks: dict[int, int], tensors: Iterable[Any], device_type: str) -> int:
    """Bytes of the allocator blocks ``{address: size}`` in which none of `tensors` (nor their
    leaves' ``.grad``) on `device_type` has its storage; tensors without real storage (fake
    tensors, sparse ones) are skipped."""
    return sum(unowned_blocks(blocks, tensors, device_type).values())


def unowned_blocks(blocks: dict[int, int], tensors: Iterable[Any], device_type: str) -> dict[int, int]:
    """The blocks of `unowned_bytes`."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every supported torch has it
        FakeTensor = ()
    blocks = dict(blocks)
    for o in tensors:
        if isinstance(o, FakeTensor):
            continue
        try:
            ts = [o]
            if o.is_leaf and o.requires_grad and o.grad is not None:
                ts.append(o.grad)
            for t in ts:
                if t.device.type == device_type:
                    blocks.pop(t.untyped_storage().data_ptr(), None)
        except Exception:  # noqa: BLE001 - no real storage: holds no block
            continue
    return blocks


class _OnAutogradThread(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


def on_autograd_thread(fn: Callable[[], Any], device: torch.device) -> None:
    """Call `fn` where autograd runs a backward on `device`: on CUDA its device thread (as the
    executors' backward runs), elsewhere the calling thread."""
    x = torch.zeros((), device=device, requires_grad=True)
    with torch.enable_grad():
        _OnAutogradThread.apply(x, fn).backward()


def measure_peak(step_fn: Callable[[], Any], resident: Iterable[Any] = (), device: "str | torch.device | None" = None) -> int:
    """Peak bytes of one call of `step_fn` (a training step, say).

    CPU (or any device with ``device=None``): unique storages of `resident` (parameters,
    buffers, inputs, gradients that exist before the call) plus the peak of the storages the
    call allocates (`StorageTracker`).  CUDA: ``torch.cuda.max_memory_allocated`` over the call,
    which counts everything on the device.
    """
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        gc.collect()    # garbage from earlier steps (reference cycles) is not this call's
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


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment: kineto writes a line to it at every
    profiler start and stop, which would land in the command line's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class AllocationLog:
    """The CPU allocator's allocations and frees over a block, from one profiler session
    (``profile_memory``), by labelled windows: ``with log: ... with log.window(key): <code>``,
    then ``log.peak(key)`` = the largest running sum of the sizes allocated and freed within the
    window, relative to its start.  On the CPU that is what `AllocatorWindow` tells on CUDA: it
    includes what kernels allocate internally (a dropout's float copy of its mask), which no
    tensor-level accounting sees."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._peaks: dict[Any, int] | None = None

    _warned = False   # (class-wide: the allocator's once-a-process warning, `__enter__`)

    def __enter__(self) -> "AllocationLog":
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.simplefilter("ignore")
            if not AllocationLog._warned:
                # the CPU allocator writes to stderr, once a process, when a block allocated before
                # a memory profile is freed inside one, as every step's frees of what the step
                # before it left are: spent here, quietly, on a block of its own
                from torch.profiler import ProfilerActivity, profile
                blocks = [torch.empty(1)]
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
                    blocks.clear()
                AllocationLog._warned = True
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.simplefilter("ignore")
            self._prof.__exit__(*exc)
        return False

    @contextlib.contextmanager
    def window(self, key: Any):
        from torch.profiler import record_function
        with record_function(f"remat.window.{key}"):
            yield

    def peaks(self) -> dict:
        """Window label -> its peak (class docstring); the whole block's under ``None``.  Windows
        are matched to allocations by time, not by nesting (under a dispatch mode the profiler's
        events for a window and for the ops inside it are siblings)."""
        if self._peaks is None:
            from torch._C._profiler import _EventType
            allocs, windows = [], []
            stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
            while stack:
                e = stack.pop()
                if e.tag == _EventType.Allocation:
                    if e.extra_fields.device.type == "cpu":
                        allocs.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
                elif e.name.startswith("remat.window."):
                    windows.append((e.start_time_ns, e.end_time_ns, e.name[len("remat.window."):]))
                stack.extend(e.children)
            allocs.sort(key=lambda x: x[0])
            times = [t for t, _, _ in allocs]
            self._peaks = {None: _running_peak(allocs)}
            for t0, t1, key in windows:
                lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
                self._peaks[key] = _running_peak(allocs[lo:hi])
        return self._peaks

    def peak(self, key: Any) -> int:
        return self.peaks().get(str(key), 0)


def _running_peak(events: list[tuple[int, int, int]]) -> int:
    """The largest running sum of (time, size, address) events, counting a free (a negative
    size) only where the block was allocated among the events: a block allocated before them is
    not in the sum, and the profiler may report a stale size for its free (an earlier session's
    block at the same address), which made a later window's peak depend on what ran before."""
    live = peak = 0
    held: dict[int, int] = {}
    for _, size, ptr in sorted(events, key=lambda x: x[0]):
        if size >= 0:
            held[ptr] = held.get(ptr, 0) + size
        elif ptr in held:
            size = -min(-size, held.pop(ptr))
        else:
            continue
        live += size
        peak = max(peak, live)
    return peak


def allocator_peak(step_fn: Callable[[], Any], resident: Iterable[Any] = ()) -> int:
    """Peak CPU bytes of one call of `step_fn` as the CPU allocator saw them: the unique storages
    of `resident` plus the largest running sum of the sizes the allocator handed out and took
    back while it ran (PyTorch's profiler with ``profile_memory``: one allocation event per
    allocation and free, with its size).  Unlike `StorageTracker` it changes nothing about what
    runs, so it sees inside ``torch.compile``'d code (inductor's buffers), and it sees a
    kernel's internal scratch buffers too.  A free of a block allocated before the call is left
    out of the sum (`_running_peak`: the profiler may report a stale size for it), so what the
    call frees of older blocks does not lower its peak."""
    base = unique_bytes(t for t in resident if isinstance(t, torch.Tensor))
    with AllocationLog() as log:
        step_fn()
    return base + log.peaks()[None]


METERS = ("storage", "allocator")


def measure(step_fn: Callable[[], Any], device: "str | torch.device | None" = None,
            resident: Iterable[Any] = (), meter: str = "storage") -> Measurement:
    """Peak device bytes and wall time of one call of `step_fn` (``remat.measure``).

    CUDA: ``torch.cuda.max_memory_allocated`` over the call (everything on the device counts;
    `resident` is ignored) and the time between synchronisations.  CPU: `measure_peak`'s exact
    accounting of live storages: `resident` tensors (parameters, buffers, inputs, gradients kept
    from a previous step) plus the peak of what the call allocates; host buffers of swapped-out
    tensors are not device bytes (the executor takes them outside the accounting).  The time
    on the CPU includes the accounting's per-op overhead: compare ratios of times measured the
    same way.  ``meter="allocator"`` (CPU): `allocator_peak` instead, which also sees inside
    compiled code (under `StorageTracker`'s dispatch mode a compiled module runs eagerly, for
    that call only) and counts every CPU allocation, host buffers included.
    """
    if meter not in METERS:
        raise ValueError(f"meter: expected one of {METERS}, got {meter!r}")
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
    if meter == "allocator" and dev.type == "cpu":
        peak = allocator_peak(timed, resident)
    else:
        peak = measure_peak(timed, resident=resident, device=dev if dev.type == "cuda" else None)
    return Measurement(int(peak), box[0], str(dev))
