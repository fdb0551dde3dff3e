"""Layer placement with micro-batches: where to cut a step into pipeline stages, and what each
stage holds, takes and sends (the cost model of `remat.partitioning.layer_placement`; run by
`remat.pipelining` on `torch.distributed.pipelining`).

**Where a stage may begin** (`stage_starts`): before a module whose ops run as one contiguous
run of the step (a module called once; the outermost one beginning at that op, among the modules
that run an op of their own: a container such as a `ModuleList` is never called).  That is what
PyTorch's ``pipeline(..., split_spec={fqn: SplitPoint.BEGINNING})`` cuts at.

**Where the stages begin** (`choose_cuts`): k - 1 of those places, chosen by a linear-partition
dynamic program that minimises the heaviest stage's weight, exact over the places: by memory (its
parameters with their gradients and optimizer state, the bytes its ops make, and what crosses its
ends: the activations it receives and sends, `crossing_bytes`) or by time (its ops' forward and
backward in the FLOP model, `op_times`, and the crossing activations' copies), the pipeline's
step being its slowest stage's.

**One micro-batch's step of a stage** (`stage_graph`): the step's `OpGraph` with its batch
dimensions divided by the micro-batch count (`microbatch_graph`, the batch followed through the
ops as `tofu.roles` follows it), cut to the stage's ops.  What an earlier stage made arrives
(a node of its own, whose gradient the stage's backward makes and sends back); what a later
stage reads is the stage's output, held until its gradient arrives and its backward runs (the
pipeline keeps every micro-batch's outputs and inputs).  `tofu.device_graph` makes it a remat
graph, and the simulator gives its keep-everything peak and what is live when its forward ends.

**A stage's peak** (`stage_costs`): with ``f`` micro-batches in flight at the first backward
(GPipe: all ``m``; 1F1B, as `Schedule1F1B` warms up: ``min(m, k - s)`` on stage ``s`` of ``k``),
the peak of one micro-batch's step plus ``f - 1`` times what one micro-batch holds between its
forward and its backward; at a later backward ``min(f, m - 1)`` are in flight, and the
parameters' gradients are there from the micro-batch's start (each new gradient is made beside
them, then added in place: `grads_resident`); the larger of the two; in 1F1B one micro-batch's
outputs and input gradients more (its sends are posted with the next receive, so they outlive
its backward); plus the pipeline's receive buffers (one per micro-batch and received tensor or
arriving gradient, made at the first step and kept) and the rest of the batch, which the
schedule cuts into views and holds whole.

**Time** (the FLOP model of `tofu.device_graph`): the slowest stage's micro-batch step times
``m + k - 1`` (the pipeline's fill and drain: a fraction ``(k - 1) / (m + k - 1)`` of it is the
bubble).  **Communication**: every tensor a later stage reads is sent to each stage that reads
it, once per micro-batch (in all, its bytes), and its gradient back; a parameter read on several
stages is copied to each by `pipeline` and its gradient all-reduced over them (a ring: 2 (n - 1)
/ n of its bytes sent per holder).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from remat.core.errors import InvalidInputError
from remat.core.graph import Graph
from remat.core.opgraph import OpGraph, OpInfo, TensorInfo
from remat.core.schedule import Schedule
from remat.core.simulate import simulate

from . import tofu

SCHEDULES = ("gpipe", "1f1b")
RECEIVE, SEND = "_receive", "_send"     # the synthetic ops of a stage graph


def stage_starts(g: OpGraph) -> dict[int, str]:
    """{op index: module} where a stage may begin (module docstring); never op 0."""
    spans: dict[str, list] = {}
    # (a module that runs an op itself is called; a container's name (`ModuleList`) is only a prefix)
    called = {op.module for op in g.ops if op.module}
    for op in g.ops:
        parts = op.module.split(".") if op.module else []
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            span = spans.setdefault(name, [op.id, op.id])
            span[1] = op.id

    def inside(op: OpInfo, name: str) -> bool:
        return op.module == name or op.module.startswith(name + ".")
    out: dict[int, str] = {}
    for name, (a, b) in spans.items():
        if a == 0 or name not in called or not all(inside(g.ops[i], name) for i in range(a, b + 1)):
            continue
        if a not in out or name.count(".") < out[a].count("."):
            out[a] = name
    return out


def op_weights(g: OpGraph, optimizer_factor: float = 0.0) -> list[int]:
    """Per op: the bytes of the parameters it reads first (with gradient and optimizer state) and
    of the outputs it makes (views make none)."""
    factor = 2 + optimizer_factor
    seen: set = set()
    out = []
    for op in g.ops:
        w = 0
        for t in op.inputs:
            info = g.tensors[t]
            if info.kind == "parameter" and t not in seen:
                seen.add(t)
                w += int(info.bytes * (factor if info.grad else 1))
        if not tofu.aliases(op):
            w += sum(g.tensors[t].bytes for t in op.outputs)
        out.append(w)
    return out


def op_times(g: OpGraph) -> list[float]:
    """Per op, its forward and backward in the FLOP model (`tofu.forward_time`, the backward
    twice the forward; views take none)."""
    out = []
    for op in g.ops:
        if tofu.aliases(op):
            out.append(0.0)
            continue
        shapes = [g.tensors[t].shape for t in op.inputs], [g.tensors[t].shape for t in op.outputs]
        out.append(3.0 * tofu.forward_time(g, op, *shapes))
    return out


BALANCES = ("time", "memory")


def choose_cuts(g: OpGraph, devices: int, optimizer_factor: float = 0.0, balance: str = "memory") -> list[int]:
    """The op indices where stages 1..devices-1 begin: `devices - 1` of `stage_starts`, the
    heaviest stage as light as it can be (module docstring), by `balance`: ``"memory"`` (the
    stage's parameters with their gradients and optimizer state, the bytes its ops make, and the
    activations crossing its ends) or ``"time"`` (its ops' forward and backward in the FLOP
    model, and the crossing activations copied once at `tofu.BYTES_PER_S`)."""
    if devices < 1:
        raise InvalidInputError(f"devices: expected at least 1, got {devices}")
    if balance not in BALANCES:
        raise InvalidInputError(f"balance: expected one of {', '.join(BALANCES)}, got {balance!r}")
    if devices == 1:
        return []
    starts = sorted(stage_starts(g))
    if len(starts) < devices - 1:
        raise InvalidInputError(f"devices: the step has {len(starts) + 1} places where a pipeline stage can begin "
                                f"(module boundaries), fewer than {devices} stages; use fewer devices")
    if balance == "memory":
        w: list = op_weights(g, optimizer_factor)
        cross: list = crossing_bytes(g)
    else:
        w = op_times(g)
        cross = [b / tofu.BYTES_PER_S for b in crossing_bytes(g)]
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    pos = [0] + starts + [len(g.ops)]          # pos[0] is the step's start, pos[-1] its end
    n = len(pos)
    inf = float("inf")

    def weight(i: int, j: int) -> float:      # the stage of ops [pos[i], pos[j]), with what crosses its ends
        return prefix[pos[j]] - prefix[pos[i]] + (cross[pos[i]] if i > 0 else 0) + (cross[pos[j]] if j < n - 1 else 0)
    # best[j][c]: the lightest heaviest stage of stages covering ops [0, pos[j]) with c cuts, pos[j] the last
    best = [[inf] * devices for _ in range(n)]
    back = [[-1] * devices for _ in range(n)]
    for j in range(1, n):
        best[j][0] = weight(0, j)
    for c in range(1, devices):
        for j in range(c + 1, n):
            for i in range(c, j):
                v = max(best[i][c - 1], weight(i, j))
                if v < best[j][c]:
                    best[j][c], back[j][c] = v, i
    cuts, j = [], n - 1
    for c in range(devices - 1, 0, -1):
        j = back[j][c]
        cuts.append(pos[j])
    return sorted(cuts)


def crossing_bytes(g: OpGraph) -> list[int]:
    """Per op index p, the bytes of the activations made before op p and read at or after it:
    what a stage beginning at p receives (and holds a buffer for) and what the stage before it
    sends."""
    diff = [0] * (len(g.ops) + 2)
    made = producers(g)
    for t, b in tofu.last_reader(g).items():
        a = made.get(t)
        if a is not None and b > a:
            diff[a + 1] += g.tensors[t].bytes
            diff[b + 1] -= g.tensors[t].bytes
    out, acc = [], 0
    for p in range(len(g.ops) + 1):
        acc += diff[p]
        out.append(acc)
    return out


def microbatch_graph(g: OpGraph, microbatches: int) -> OpGraph:
    """`g` with every batch dimension (`tofu.roles`) divided by `microbatches`."""
    if microbatches < 1:
        raise InvalidInputError(f"microbatches: expected at least 1, got {microbatches}")
    if microbatches == 1:
        return g
    where = tofu.roles(g)
    tensors = {}
    for t, info in g.tensors.items():
        shape = list(info.shape)
        d = where[t].get("batch")
        if d is not None:
            if shape[d] % microbatches:
                raise InvalidInputError(f"microbatches: the batch dimension of {info.name} ({shape[d]}) does not "
                                        f"split into {microbatches} equal micro-batches; choose a divisor of the batch")
            shape[d] //= microbatches
        tensors[t] = TensorInfo(t, info.name, tuple(shape), info.itemsize, info.kind, info.grad)
    return OpGraph(tensors, list(g.ops), g.loss, dict(g.meta))


def stage_of(g: OpGraph, cuts: list[int]) -> list[int]:
    """Per op, its stage."""
    out, s = [], 0
    for op in g.ops:
        while s < len(cuts) and op.id >= cuts[s]:
            s += 1
        out.append(s)
    return out


def producers(g: OpGraph) -> dict:
    return {t: op.id for op in g.ops for t in op.outputs}


def stage_graph(g: OpGraph, cuts: list[int], s: int) -> OpGraph:
    """Stage `s`'s ops of `g` (one micro-batch's shapes) as an `OpGraph` of their own (module
    docstring): a `RECEIVE` op first makes what earlier stages made (activations: their gradients
    are made here and sent back); the last stage keeps the step's loss; another stage ends in a
    `SEND` op reading what later stages read (its backward, the stage's first, reads them: the
    pipeline holds a micro-batch's outputs until then, and it makes their gradients, which
    arrive from the next stage) and a scalar loss after it."""
    where = stage_of(g, cuts)
    made = producers(g)
    ops = [op for op in g.ops if where[op.id] == s]
    mine = {t for op in ops for t in op.outputs}
    received = sorted({t for op in ops for t in op.inputs if t in made and t not in mine})
    tensors = {t: g.tensors[t] for op in ops for t in op.inputs + op.outputs}
    new: list[OpInfo] = []
    if received:
        new.append(OpInfo(0, RECEIVE, (), tuple(received), "", ()))
    for op in ops:
        new.append(OpInfo(len(new), op.op, op.inputs, op.outputs, op.module, op.args))
    loss = g.loss
    if s < len(cuts):
        sent = sorted({t for op in g.ops if where[op.id] > s for t in op.inputs
                       if t in tensors and g.tensors[t].kind == "activation"})
        mark, loss = max(g.tensors) + 1, max(g.tensors) + 2
        tensors[mark] = TensorInfo(mark, "sent", (), 4, "activation", True)
        tensors[loss] = TensorInfo(loss, "stage loss", (), 4, "activation", True)
        new.append(OpInfo(len(new), SEND, tuple(sent), (mark,), "", ()))
        new.append(OpInfo(len(new), "sum", (mark,), (loss,), "", ()))
    return OpGraph(tensors, new, loss, dict(g.meta))


def traffic(sg: OpGraph) -> tuple[int, int, int, int]:
    """Per micro-batch, bytes of a stage graph's (received activations, their gradients (the
    ones the step differentiates), outputs sent, gradients of its outputs that arrive)."""
    got = next((op.outputs for op in sg.ops if op.op == RECEIVE), ())
    sent = next((op.inputs for op in sg.ops if op.op == SEND), ())
    return (sum(sg.tensors[t].bytes for t in got), sum(sg.tensors[t].bytes for t in got if sg.tensors[t].grad),
            sum(sg.tensors[t].bytes for t in sent), sum(sg.tensors[t].bytes for t in sent if sg.tensors[t].grad))


def one_device(g: OpGraph) -> "tofu.Split":
    """The trivial split of `g` over one device (every tensor whole)."""
    return tofu.Split(1, [], {t: () for t in g.tensors}, {op.id: () for op in g.ops},
                      {t: tuple(info.shape) for t, info in g.tensors.items()}, 0, True)


@dataclass
class StageCost:
    stage: int
    first_op: int
    module: str                 # where it begins ("" for the first stage)
    inflight: int               # micro-batches in flight at its peak
    fixed_bytes: int            # parameters (with optimizer state) and the batch it holds
    held_bytes: int             # one micro-batch between its forward and its backward
    peak_bytes: int
    microbatch_time: float      # one micro-batch's forward and backward, FLOP model


def stage_costs(g: OpGraph, cuts: list[int], microbatches: int, schedule: str,
                optimizer_factor: float = 0.0) -> list[StageCost]:
    """Per stage its predicted bytes and time (module docstring)."""
    if schedule not in SCHEDULES:
        raise InvalidInputError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    gm = microbatch_graph(g, microbatches)
    k = len(cuts) + 1
    starts = stage_starts(g)
    out = []
    for s in range(k):
        sg = stage_graph(gm, cuts, s)
        received, received_grads, sent, arriving = traffic(sg)
        dg = _without_buffers(tofu.device_graph(sg, one_device(sg), optimizer_factor))
        first, held = _microbatch_peak(dg)
        # a later micro-batch runs with the parameters' gradients there from its start, and each
        # of its gradients is made beside them before it is added in place
        later, _ = _microbatch_peak(grads_resident(dg))
        # in flight at backward j: all that have run their forward (GPipe: all m; 1F1B, as
        # `Schedule1F1B` warms up: min(m, k - s) + j) less the j done
        f = microbatches if schedule == "gpipe" else min(microbatches, k - s)
        peak = max((first if j == 0 else later) + (min(f, microbatches - j) - 1) * held for j in range(microbatches))
        if schedule == "1f1b" and microbatches > 1:
            # its sends are posted with the next receive: one micro-batch's outputs and input
            # gradients outlive its backward
            peak += sent + received_grads
        # the pipeline's receive buffers, one per micro-batch, kept from the first step on; the
        # batch's tensors this stage reads, held whole (the schedule's micro-batches are views)
        buffers = microbatches * (received + arriving)
        rest = sum(g.tensors[t].bytes - gm.tensors[t].bytes for t, info in sg.tensors.items()
                   if info.kind == "input" and t in g.tensors and g.tensors[t].kind == "input")
        begin = 0 if s == 0 else cuts[s - 1]
        out.append(StageCost(s, begin, starts.get(begin, ""), f, dg.fixed_bytes + buffers + rest, held,
                             peak + buffers + rest, dg.total_time))
    return out


def _without_buffers(dg: Graph) -> Graph:
    """A stage's device graph without the bytes the pipeline's receive buffers hold (counted
    apart, per micro-batch): the received activations (`RECEIVE`'s node) and the gradients of
    the outputs (`SEND`'s backward)."""
    nodes = [replace(v, bytes=0) if v.name.startswith(RECEIVE + ":") and v.kind == "forward"
             or v.name.startswith(SEND + ":") and v.kind == "backward" else v for v in dg.nodes]
    return Graph(nodes, dg.edges, dg.fixed_bytes, dg.meta)


def _microbatch_peak(dg: Graph) -> tuple[int, int]:
    """(the keep-everything peak of one micro-batch's step of a stage, fixed bytes included; the
    bytes above the fixed ones live when its forward ends)."""
    res = simulate(dg, Schedule.keep_all(dg), timeline=True)
    loss = next(i for i, v in enumerate(dg.nodes) if v.kind == "loss")
    after = next(r["after_bytes"] for r in res.timeline if r["op"] == "compute" and r["node"] == loss)
    return res.peak_bytes, max(0, after - dg.fixed_bytes)


def grads_resident(dg: Graph) -> Graph:
    """`dg` with its parameters' gradients (the backward nodes' persistent bytes) resident from
    the start: in the fixed bytes, no longer allocated by the nodes (whose workspace still holds
    the gradient they make)."""
    moved = sum(v.persistent_bytes for v in dg.nodes)
    nodes = [replace(v, persistent_bytes=0) for v in dg.nodes]
    return Graph(nodes, dg.edges, dg.fixed_bytes + moved, dg.meta)


def comm_bytes(g: OpGraph, cuts: list[int]) -> int:
    """Bytes sent per step, all stages (module docstring)."""
    where = stage_of(g, cuts)
    made = producers(g)
    total = 0
    pairs = {(t, where[op.id]) for op in g.ops for t in op.inputs
             if t in made and where[made[t]] != where[op.id]}
    for t, _ in pairs:
        info = g.tensors[t]
        total += info.bytes * (2 if info.grad else 1)
    for t, holders in parameter_holders(g, cuts).items():
        n = len(holders)
        if n > 1 and g.tensors[t].grad:
            total += 2 * (n - 1) * g.tensors[t].bytes
    return total


def parameter_holders(g: OpGraph, cuts: list[int]) -> dict:
    """{parameter: the stages whose ops read it}."""
    where = stage_of(g, cuts)
    out: dict = {}
    for op in g.ops:
        for t in op.inputs:
            if g.tensors[t].kind == "parameter":
                out.setdefault(t, set()).add(where[op.id])
    return {t: sorted(v) for t, v in out.items()}


def step_time(costs: list[StageCost], microbatches: int) -> float:
    """The pipelined step's time: the slowest stage's micro-batch times ``m + k - 1``."""
    return max(c.microbatch_time for c in costs) * (microbatches + len(costs) - 1)


def bubble(stages: int, microbatches: int) -> float:
    """The fraction of the step a stage idles in fill and drain."""
    return (stages - 1) / (microbatches + stages - 1)


__all__ = ["SCHEDULES", "BALANCES", "stage_starts", "choose_cuts", "crossing_bytes", "op_weights", "op_times",
           "microbatch_graph", "stage_graph", "stage_costs", "StageCost", "comm_bytes", "parameter_holders", "step_time",
           "bubble", "one_device"]
