"""The one model of a schedule's peak memory and time.

Every solver's schedule, the ILP's objective and the executor's measurements are held to what
`simulate` says.  It replays the op list on two clocks:

* the compute stream runs ``compute`` ops back to back (node ``time`` each);
* one transfer stream runs ``swap_out`` / ``swap_in`` in issue order, each taking
  ``bytes / bandwidth``; a transfer starts when issued or when the stream is free, whichever
  is later.

Op semantics (docs/design.md, "Op semantics"):
``compute i`` needs every input of i resident on the device; an input whose swap-in is still
in flight makes the compute stream wait for it; it allocates i's output (and, while it runs,
its workspace).  i's first compute also allocates its persistent bytes, which stay to the step's
end; its workspace covers them while it runs, and they count from the next op that allocates
(a compute or a swap-in; or the step's end) on, so the frees right after i come first: a
backward node that allocates its parameter gradients while autograd frees the tensors it read
(a module's backward) is counted as it runs.  ``free i`` releases i's device bytes (it must not race an in-flight transfer of
i: ``wait i`` first).  ``swap_out i`` copies a resident i to the host (its device copy stays
until a ``free i``).  ``swap_in i`` copies a host copy back, allocating the device bytes when it
is issued.  ``wait i`` blocks the compute stream until i's last transfer is done.  Two ops model
a compiler's kernels (the compiled class, `remat.core.compiled`): ``inline i`` computes i inside
the kernel of the compute that follows, allocating nothing (i is resident for its readers, its
free releases nothing); ``into i`` hands resident i's buffer to the compute that follows, which
writes its output into it (i stays readable by it; its free releases nothing).  The parts of an op with
several outputs (`remat.core.graph`) are computed together: a later part's compute must follow
the compute of the part before it, and no other compute and no swap-in may come between the
leader's compute and its last part's (only frees, waits and swap-outs, which allocate nothing):
the op really allocates all its outputs when the leader runs, and the model counts them at the
leader's compute (its workspace) and from each part's compute on, which is the same peak only
when nothing else allocates in between.

Device bytes = fixed bytes + resident outputs + the persistent bytes counted so far (+ workspace
of the running node); the peak is taken over every op and the step's end.  Host bytes count the host copies made by swap-outs.  Total time is when
both streams are done.  The first violated rule stops the replay and is reported.

`SimState` is the same model one op at a time, for every replay that builds or inspects a
schedule step by step (DTR's runtime, rotor's block programs, TFLMS's release points, the
rebuild orders of `stage_order`, the memory picture of `viz`): what is resident and how it got
there, the bytes now and at the peak, both clocks.  `simulate` is a loop over it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from .graph import Graph
from .schedule import Op, Schedule

# how a resident value's device copy got there (`SimState.origin`, `SimState.bytes_by_origin`), and
# the persistent bytes of the nodes computed so far
ORIGINS = ("computed", "recomputed", "swapped in", "persistent")


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


class SimState:
    """The simulator's state between two ops of a schedule (module docstring).

    Starts empty, or, for a replay of a fragment, with `resident` values on the device, the nodes
    `computed` before it (their persistent bytes resident, their computes no longer first) and
    `live_bytes` activation bytes (default: the resident values' bytes and the computed nodes'
    persistent bytes; a fragment may count only what it adds above its caller's).  `apply(op)`, or `compute(i)`, `free(i)`, `swap_out(i)`,
    `swap_in(i)`, `wait(i)`, performs one op and returns the rule it violates (a message; the
    state is then undefined) or None.  With ``check=False`` no rule is checked (a replay whose
    program is valid by construction and is simulated as a whole afterwards), which is faster.

    What it tells: ``origin`` (resident node -> one of `ORIGINS`), ``on_host``, ``live`` (activation
    bytes resident now), ``during`` (activation bytes while the last op ran: for a compute its
    output and workspace too), ``peak`` (the largest ``during`` so far, or the starting bytes),
    ``bytes_by_origin``, ``host`` and ``host_peak``, ``clock`` (the compute stream), ``xclock``
    (the transfer stream), ``last_start`` / ``last_end`` (the last op's, on its stream),
    ``compute_time``, ``transfer_time`` and ``counts`` (node -> computes so far).
    `compute_peak(i)` is the activation bytes a compute of i issued now would peak at.
    """

    __slots__ = ("graph", "bandwidth", "check", "origin", "on_host", "xfer_end", "swap_in_end", "clock", "xclock",
                 "live", "during", "peak", "host", "host_peak", "compute_time", "transfer_time", "counts",
                 "bytes_by_origin", "last_start", "last_end", "pending", "expect", "_nodes", "_preds", "_op_of",
                 "inlined")

    def __init__(self, graph: Graph, bandwidth: float | None = None, *, resident: Iterable[int] = (),
                 computed: Iterable[int] = (), live_bytes: int | None = None, check: bool = True):
        self.graph = graph
        self.bandwidth = float(bandwidth if bandwidth is not None else graph.bandwidth)
        self.check = check
        self._nodes, self._preds = graph.nodes, graph.preds
        self.origin: dict[int, str] = {v: "computed" for v in resident}
        self.on_host: set[int] = set()
        self.xfer_end: dict[int, float] = {}     # end time of the last transfer issued for a node
        self.swap_in_end: dict[int, float] = {}  # in-flight swap-ins (until waited or consumed)
        self.clock = 0.0
        self.xclock = 0.0
        self.counts: dict[int, int] = {v: 1 for v in computed}
        self.inlined: set[int] = set()   # (resident without bytes of their own: ``inline`` ops)
        self.pending = 0  # persistent bytes of the last first compute, counted from the next allocation
        # the part of an op that must be computed next (-1: none); checked only with `check`
        self.expect = -1
        self._op_of = graph.op_of if graph.has_parts else None  # (a node's op leader, `Graph.op_of`)
        persistent = sum(self._nodes[v].persistent_bytes for v in self.counts)
        resident_bytes = sum(self._nodes[v].bytes for v in self.origin)
        self.live = resident_bytes + persistent if live_bytes is None else int(live_bytes)
        self.during = self.live
        self.peak = self.live
        self.bytes_by_origin = {o: 0 for o in ORIGINS}
        self.bytes_by_origin["persistent"] = persistent
        self.bytes_by_origin["computed"] = self.live - persistent
        self.host = 0
        self.host_peak = 0
        self.compute_time = 0.0
        self.transfer_time = 0.0
        self.last_start = self.last_end = 0.0

    # ---- what is there ---------------------------------------------------------------
    def resident(self, i: int) -> bool:
        return i in self.origin

    @property
    def device_bytes(self) -> int:
        """Fixed bytes plus the activation bytes resident now."""
        return self.graph.fixed_bytes + self.live

    def compute_peak(self, i: int) -> int:
        """Activation bytes while a compute of i issued now runs: what is resident (with the
        persistent bytes not counted yet), i's output and its workspace."""
        v = self._nodes[i]
        return self.live + self.pending + v.bytes + v.workspace_bytes

    def settle(self) -> None:
        """Count the persistent bytes of the last first compute (module docstring): before an op
        that allocates, and at the step's end (`simulate` calls it after the last op)."""
        if self.pending:
            self.live += self.pending
            self.bytes_by_origin["persistent"] += self.pending
            self.pending = 0
            if self.live > self.peak:
                self.peak = self.live

    # ---- ops -------------------------------------------------------------------------
    # Each op returns the rule it violates (a message), or None; `check=False` skips the rules.
    def apply(self, op: Op) -> str | None:
        i = op.node
        if not 0 <= i < len(self._nodes):
            return f"node {i} is not in the graph"
        kind = op.op
        if kind == "compute":
            return self.compute(i)
        if kind == "inline":
            return self.compute(i, inline=True)
        if kind == "into":
            return self.give(i)
        if kind == "free":
            return self.free(i)
        if kind == "swap_out":
            return self.swap_out(i)
        if kind == "swap_in":
            return self.swap_in(i)
        if kind == "wait":
            return self.wait(i)
        return f"unknown op {kind!r}"

    def _name(self, i: int) -> str:
        return f"{i} ({self._nodes[i].name})"

    def compute(self, i: int, inline: bool = False) -> str | None:
        """Compute node i; `inline` (an ``inline`` op): inside the kernel of the op that reads it
        next, as a compiler that does not store it does: resident for its readers, no bytes of
        its own (its inputs stay resident to its readers instead)."""
        preds, origin = self._preds[i], self.origin
        if self.check:
            for u in preds:
                if u not in origin:
                    where = "it is on the host (swap it in first)" if u in self.on_host else "it is not resident"
                    return f"input {self._name(u)} of node {self._name(i)} is needed but {where}"
            if i in origin:
                return f"node {self._name(i)} is computed while its output is already resident"
            op_of = self._op_of
            if op_of is not None:
                message = self._part_rule(i, op_of)
                if message is not None:
                    return message
        clock = self.clock
        pending = self.swap_in_end
        if pending:
            for u in preds:
                if u in pending:
                    end = pending.pop(u)
                    if end > clock:
                        clock = end
        if self.pending:
            self.settle()
        v = self._nodes[i]
        count = self.counts.get(i, 0)
        nbytes = 0 if inline else v.bytes
        if inline:
            self.inlined.add(i)
        during = self.live + nbytes + v.workspace_bytes
        how = "recomputed" if count else "computed"
        self.live += nbytes
        self.bytes_by_origin[how] += nbytes
        if not count:
            self.pending = v.persistent_bytes
        origin[i] = how
        self.last_start = clock
        took = v.recompute_cost if count else v.time
        self.clock = self.last_end = clock + took
        self.compute_time += took
        self.counts[i] = count + 1
        self.during = during
        if during > self.peak:
            self.peak = during
        return None

    def _part_rule(self, i: int, op_of: list) -> str | None:
        """The parts rule (module docstring) for a compute of i; advances `expect`."""
        e = self.expect
        if e >= 0 and i != e:
            return (f"node {self._name(i)} is computed between the parts of op {self._name(op_of[e])}: its part "
                    f"{self._name(e)} must come next (an op makes all its outputs at once)")
        if e < 0 and op_of[i] != i:
            return (f"part {self._name(i)} of op {self._name(op_of[i])} is computed without the op "
                    "(an op's parts are computed together, leader first)")
        nxt = i + 1
        self.expect = nxt if nxt < len(op_of) and op_of[nxt] != nxt else -1
        return None

    def give(self, i: int) -> str | None:
        """An ``into`` op: resident node i's buffer goes to the next compute, which writes its
        result into it (a compiler's in-place kernel): i stays readable by that compute, its
        bytes are no longer its own (its free releases nothing)."""
        if self.check and (i not in self.origin or i in self.inlined):
            return f"into node {self._name(i)}, which is not resident with a buffer of its own"
        if i not in self.inlined:
            self.inlined.add(i)
            nbytes = self._nodes[i].bytes
            self.live -= nbytes
            self.bytes_by_origin[self.origin.get(i, "computed")] -= nbytes
        self.during = self.live
        return None

    def free(self, i: int) -> str | None:
        if self.check:
            if i not in self.origin:
                return f"free of node {self._name(i)}, which is not resident"
            if self.xfer_end.get(i, 0.0) > self.clock:
                return f"free of node {self._name(i)} while its transfer is in flight (insert 'wait {i}' first)"
        self.during = self.live  # (never above the peak)
        nbytes = self._nodes[i].bytes
        if self.inlined and i in self.inlined:
            self.inlined.discard(i)
            nbytes = 0
        self.live -= nbytes
        self.bytes_by_origin[self.origin.pop(i, "computed")] -= nbytes
        if self.swap_in_end:
            self.swap_in_end.pop(i, None)
        self.last_start = self.last_end = self.clock
        return None

    def _issue_transfer(self, i: int) -> None:
        """Queue i's copy on the transfer stream."""
        start = max(self.clock, self.xclock)
        dur = self._nodes[i].bytes / self.bandwidth
        self.xclock = start + dur
        self.transfer_time += dur
        self.xfer_end[i] = self.xclock
        self.last_start, self.last_end = start, self.xclock

    def swap_out(self, i: int) -> str | None:
        if self.check:
            if i not in self.origin:
                return f"swap_out of node {self._name(i)}, which is not resident"
            if i in self.swap_in_end and self.swap_in_end[i] > self.clock:
                return f"swap_out of node {self._name(i)} while its swap_in is in flight"
        self._issue_transfer(i)
        if i not in self.on_host:
            self.on_host.add(i)
            self.host += self._nodes[i].bytes
            if self.host > self.host_peak:
                self.host_peak = self.host
        self.during = self.live
        return None

    def swap_in(self, i: int) -> str | None:
        if self.check:
            if i not in self.on_host:
                return f"swap_in of node {self._name(i)}, which has no host copy (swap it out first)"
            if i in self.origin:
                return f"swap_in of node {self._name(i)}, which is already resident"
            if self.expect >= 0:
                return (f"swap_in of node {self._name(i)} between the parts of op "
                        f"{self._name(self._op_of[self.expect])} (compute part {self._name(self.expect)} first)")
        if self.pending:
            self.settle()
        self._issue_transfer(i)
        self.swap_in_end[i] = self.xclock
        nbytes = self._nodes[i].bytes
        self.live += nbytes
        self.bytes_by_origin["swapped in"] += nbytes
        self.origin[i] = "swapped in"
        self.during = self.live
        if self.live > self.peak:
            self.peak = self.live
        return None

    def wait(self, i: int) -> str | None:
        if self.check and i not in self.xfer_end:
            return f"wait on node {self._name(i)}, which has no transfer"
        self.last_start = self.clock
        end = self.xfer_end.get(i)
        if end is not None and end > self.clock:
            self.clock = end
        self.swap_in_end.pop(i, None)
        self.last_end = self.clock
        self.during = self.live
        return None


def simulate(graph: Graph, schedule: Schedule | list[Op], bandwidth: float | None = None,
             timeline: bool = False) -> SimResult:
    """Replay `schedule` (module docstring); with `timeline`, one row per op (device bytes during
    and after it, host bytes after it, its start and end on its stream)."""
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    state = SimState(graph, bandwidth)
    fixed = graph.fixed_bytes
    tl: list[dict] = []
    violation: Violation | None = None
    for idx, op in enumerate(ops):
        message = state.apply(op)
        if message is not None:
            violation = Violation(idx, op, message)
            break
        if timeline:
            tl.append({"op": op.op, "node": op.node, "stage": op.stage, "device_bytes": state.during + fixed,
                       "after_bytes": state.live + fixed, "host_bytes": state.host,
                       "start": state.last_start, "end": state.last_end})
    state.settle()
    # the optimizer's step after the last op: what is still live, and its transient
    if graph.optimizer_step_bytes and state.live + graph.optimizer_step_bytes > state.peak:
        state.peak = state.live + graph.optimizer_step_bytes
    counts = [state.counts.get(i, 0) for i in range(graph.n)]
    if violation is None and state.expect >= 0:
        e = state.expect
        violation = Violation(len(ops), None, f"the step ends before part {e} ({graph.nodes[e].name}) of op "
                              f"{graph.nodes[e].part_of} is computed")
    if violation is None:
        never = [i for i in range(graph.n) if counts[i] == 0]
        if never:
            kind = graph.nodes[never[0]].kind
            what = "a gradient" if kind == "backward" else f"a {kind} node"
            violation = Violation(len(ops), None, f"node {never[0]} ({graph.nodes[never[0]].name}) ({what}) is never "
                                  "computed" + (f" (and {len(never) - 1} more)" if len(never) > 1 else ""))
    return SimResult(valid=violation is None, violation=violation,
                     peak_bytes=state.peak + fixed, activation_peak_bytes=state.peak,
                     time=max(state.clock, state.xclock), compute_time=state.compute_time,
                     transfer_time=state.transfer_time, host_peak_bytes=state.host_peak,
                     compute_counts=counts, timeline=tl)


def storage_view(graph: Graph) -> Graph:
    """`graph` as the exact accounting of tensor storages sees it (the CPU's `remat.measure`):
    each node's workspace without what its kernels allocate inside themselves
    (``extra["scratch_bytes"]``, which a frontend measured from the allocator's own figures), and
    the fixed bytes without the saved generator states (``meta["rng_state_bytes"]``: no op makes
    them).  The graph itself when it records neither."""
    rng = int(graph.meta.get("rng_state_bytes") or 0)
    if not rng and not any(v.extra.get("scratch_bytes") for v in graph.nodes):
        return graph
    nodes = [replace(v, workspace_bytes=max(0, v.workspace_bytes - int(v.extra.get("scratch_bytes") or 0)))
             for v in graph.nodes]
    return Graph(nodes, graph.edges, graph.fixed_bytes - rng, graph.meta)


def compute_seconds(graph: Graph, ops: Iterable[Op]) -> float:
    """The compute stream's busy time of an op list, as `simulate` prices it: a node's first
    compute at its ``time``, each later one at its recompute time (no transfers, no checks)."""
    seen: set = set()
    total = 0.0
    for op in ops:
        if op.op in ("compute", "inline"):
            v = graph.nodes[op.node]
            total += v.recompute_cost if op.node in seen else v.time
            seen.add(op.node)
    return total


def keep_all_peak(graph: Graph) -> int:
    """Predicted peak bytes (fixed included) of plain autograd's schedule, `Schedule.keep_all`
    (what a budget of ``1x`` means)."""
    return simulate(graph, Schedule.keep_all(graph)).peak_bytes


__all__ = ["simulate", "compute_seconds", "storage_view", "keep_all_peak", "SimResult", "SimState", "Violation", "ORIGINS"]
