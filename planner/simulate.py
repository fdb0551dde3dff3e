"""The one model of a schedule's peak memory and time.

Every solver's schedule, the ILP's objective and the executor's measurements are held to what
`simulate` says.  It replays the op list on two clocks:

* the compute stream runs ``compute`` ops back to back (node ``time`` each);
* one transfer stream runs ``swap_out`` / ``swap_in`` in issue order, each taking
  ``bytes / bandwidth``; a transfer starts when issued or when the stream is free, whichever
  is later.

Op semantics (DESIGN.md):
``compute i`` needs every input of i resident on the device; an input whose swap-in is still
in flight makes the compute stream wait for it; it allocates i's output (and, while it runs,
its workspace).  ``free i`` releases i's device bytes (it must not race an in-flight transfer of
i: ``wait i`` first).  ``swap_out i`` copies a resident i to the host (its device copy stays
until a ``free i``).  ``swap_in i`` copies a host copy back, allocating the device bytes when it
is issued.  ``wait i`` blocks the compute stream until i's last transfer is done.

Device bytes = fixed bytes + resident outputs (+ workspace of the running node); the peak is
taken over every op.  Host bytes count the host copies made by swap-outs.  Total time is when
both streams are done.  The first violated rule stops the replay and is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph import Graph
from .schedule import Op, Schedule


@dataclass
class Violation:
    op_index: int
    op: Op | None
    message: str

    def __str__(self) -> str:
        where = f"op {self.op_index} ({self.op.op} {self.op.node}, stage {self.op.stage})" if self.op else "end"
        return f"{where}: {self.message}"


@dataclass
class SimResult:
    valid: bool
    violation: Violation | None
    peak_bytes: int            # fixed + activations + workspace, max over ops
    activation_peak_bytes: int  # peak_bytes - fixed_bytes
    time: float                # when both streams are done
    compute_time: float        # sum of compute op times
    transfer_time: float       # sum of transfer times
    host_peak_bytes: int
    compute_counts: list[int]
    # per op: device bytes during the op, after it, host bytes after it, and the compute
    # stream's start/end times of the op (transfers: their stream's start/end)
    timeline: list[dict] = field(default_factory=list, repr=False)

    def overhead(self, graph: Graph) -> float:
        """Time relative to one pass with no recomputation and no transfers (checkpoint-all)."""
        base = graph.total_time
        return self.time / base if base > 0 else 1.0


def simulate(graph: Graph, schedule: Schedule | list[Op], bandwidth: float | None = None,
             timeline: bool = False) -> SimResult:
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    bw = float(bandwidth if bandwidth is not None else graph.bandwidth)
    nodes = graph.nodes
    preds = graph.preds
    n = graph.n

    on_device: set[int] = set()
    on_host: set[int] = set()
    xfer_end: dict[int, float] = {}       # end time of the last transfer issued for a node
    swap_in_end: dict[int, float] = {}    # in-flight swap-ins (until waited or consumed)
    clock = 0.0        # compute stream
    xclock = 0.0       # transfer stream
    cur = 0            # activation bytes on the device
    host = 0
    peak = 0
    host_peak = 0
    compute_time = 0.0
    transfer_time = 0.0
    counts = [0] * n
    tl: list[dict] = []
    violation: Violation | None = None

    def fail(idx: int, op: Op | None, msg: str) -> None:
        nonlocal violation
        violation = Violation(idx, op, msg)

    def issue_transfer(i: int) -> float:
        """Queue i's copy on the transfer stream; returns its start time."""
        nonlocal xclock, transfer_time
        start = max(clock, xclock)
        dur = nodes[i].bytes / bw
        xclock = start + dur
        transfer_time += dur
        xfer_end[i] = xclock
        return start

    def name(i: int) -> str:
        return f"{i} ({nodes[i].name})"

    for idx, op in enumerate(ops):
        i = op.node
        if not 0 <= i < n:
            fail(idx, op, f"node {i} is not in the graph")
            break
        start = clock
        during = cur
        if op.op == "compute":
            missing = None
            for u in preds[i]:
                if u not in on_device:
                    missing = u
                    break
            if missing is not None:
                where = "it is on the host (swap it in first)" if missing in on_host else "it is not resident"
                fail(idx, op, f"input {name(missing)} of node {name(i)} is needed but {where}")
                break
            if i in on_device:
                fail(idx, op, f"node {name(i)} is computed while its output is already resident")
                break
            for u in preds[i]:
                if u in swap_in_end:
                    clock = max(clock, swap_in_end.pop(u))
            start = clock
            during = cur + nodes[i].bytes + nodes[i].workspace_bytes
            cur += nodes[i].bytes
            on_device.add(i)
            clock += nodes[i].time
            compute_time += nodes[i].time
            counts[i] += 1
        elif op.op == "free":
            if i not in on_device:
                fail(idx, op, f"free of node {name(i)}, which is not resident")
                break
            if xfer_end.get(i, 0.0) > clock:
                fail(idx, op, f"free of node {name(i)} while its transfer is in flight (insert 'wait {i}' first)")
                break
            cur -= nodes[i].bytes
            on_device.discard(i)
            swap_in_end.pop(i, None)
        elif op.op == "swap_out":
            if i not in on_device:
                fail(idx, op, f"swap_out of node {name(i)}, which is not resident")
                break
            if i in swap_in_end and swap_in_end[i] > clock:
                fail(idx, op, f"swap_out of node {name(i)} while its swap_in is in flight")
                break
            start = issue_transfer(i)
            if i not in on_host:
                on_host.add(i)
                host += nodes[i].bytes
        elif op.op == "swap_in":
            if i not in on_host:
                fail(idx, op, f"swap_in of node {name(i)}, which has no host copy (swap it out first)")
                break
            if i in on_device:
                fail(idx, op, f"swap_in of node {name(i)}, which is already resident")
                break
            start = issue_transfer(i)
            swap_in_end[i] = xclock
            cur += nodes[i].bytes
            during = cur
            on_device.add(i)
        elif op.op == "wait":
            if i not in xfer_end:
                fail(idx, op, f"wait on node {name(i)}, which has no transfer")
                break
            clock = max(clock, xfer_end[i])
            swap_in_end.pop(i, None)
        else:
            fail(idx, op, f"unknown op {op.op!r}")
            break
        peak = max(peak, during)
        host_peak = max(host_peak, host)
        if timeline:
            end = clock if op.op in ("compute", "free", "wait") else xclock
            tl.append({"op": op.op, "node": i, "stage": op.stage, "device_bytes": during + graph.fixed_bytes,
                       "after_bytes": cur + graph.fixed_bytes, "host_bytes": host,
                       "start": start, "end": end})

    if violation is None:
        never = [i for i in range(n) if counts[i] == 0]
        if never:
            kind = nodes[never[0]].kind
            what = "a gradient" if kind == "backward" else f"a {kind} node"
            fail(len(ops), None, f"node {name(never[0])} ({what}) is never computed"
                 + (f" (and {len(never) - 1} more)" if len(never) > 1 else ""))
    total = max(clock, xclock)
    return SimResult(valid=violation is None, violation=violation,
                     peak_bytes=peak + graph.fixed_bytes, activation_peak_bytes=peak,
                     time=total, compute_time=compute_time, transfer_time=transfer_time,
                     host_peak_bytes=host_peak, compute_counts=counts, timeline=tl)
