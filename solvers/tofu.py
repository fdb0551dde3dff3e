"""Tofu's partition search: split every op of a training step across k = 2^m devices.

The graph (`OpGraph`) is the forward of one step, loss included, as ATen ops with their tensors'
shapes (`remat.frontends.partitioning` captures it); each op carries its description in index
notation (`partition.rule_for`).  The backward is not listed: each op's backward is costed from
its forward's strategy, as Tofu costs an op's forward and backward together.

**One 2-way cut** chooses a placement per tensor (`REPLICATE`, or `Shard(d)` along a dimension
of even size) and a strategy per op (a split along one index, `partition.strategies`; light
ops, and ops with no split, may also run *replicated*: every device the whole op, as Megatron
runs layer norms).  A tensor's gradient has its tensor's placement.  Communicated bytes, summed
over both devices (`conversion`: 2 x `partition.redistribute_bytes` at k = 2), for an op run with
strategy s, its inputs placed P_i and its outputs P_o:

* forward: each input converted P_i -> s.in_i; each output s.out_o (partial sums included) -> P_o;
* backward: each output's gradient P_o -> what s needs of it (the shard s produced; whole where
  s's output was a partial sum or replicated); each input's gradient (`grad_placement`: computed
  as s.in_i where that is a shard, as partial sums where the input was whole under a split, whole
  under a replicated run) converted to P_i; a parameter is converted P_i -> s.in_i again for the
  backward (FSDP's second gather: the gathered copy is not kept), an activation's converted copy
  is kept from the forward;
* a split with synchronised statistics (training batch norm along its batch, `Strategy.sync`):
  the all-reduces of its per-channel sums (`sync_costs`).

**The search** (`cut`): a dynamic program over the ops in order whose state is the placement of
every tensor still to be read (the frontier).  It is exact (the minimum of the cost above) while
the frontier's states stay under ``max_states``; beyond, it keeps the cheapest states and says so
(``exact: False``).  A memory term steers it: the objective is bytes communicated + lambda x
bytes per device (parameters with their gradient and optimizer state, each activation once, the
copies an op converts and keeps); `partition` raises lambda by bisection until the per-device
peak fits the budget.

**k = 2^m devices** (Tofu's recursion): cut the graph in 2, halve every tensor along its placement,
cut each half again with the same strategies (the halves are alike, so one solve serves both):
total bytes = sum over levels l of 2^l x (the cut's bytes at level l).  A tensor's placement is
one per mesh dimension, as DTensor places it on a ``(2, 2, ...)`` device mesh.

**Per-device memory** is the simulator's (`device_graph`): each forward op a node with its
outputs' bytes per device (views, and dropout that drops nothing, share their base's storage),
and beside it a node of what its backward keeps that is not its output (the converted copies of
its inputs, a slice of the batch included; max pooling's indices; what a random op keeps,
`drawn_bytes`), so that the output is let go after its last reader as eager autograd lets it go;
gathered parameters are the op's workspace (and its backward's, where the backward reads them
again); the loss; each op's backward a node that reads the forward tensors it saves (its inputs
as it read them, but for the ops whose backward reads none or reads its output instead; its
output for the ops that save it) and allocates its inputs' gradients, parameter gradients at
their first accumulation; parameters (and optimizer state) fixed.  A parameter's gradient
arrives as the op's strategy makes it (partial sums, or a shard) and is reduced to the
parameter's placement as soon as it is complete (FSDP's reduce-scatter, data parallel's
all-reduce): the arriving gradient is a transient of the backward node that accumulates it
first.  Conversions take memory as DTensor runs them: an output made otherwise than placed
(partial sums, say) is a transient of its op while it is converted; in the backward an output's
gradient the op reads otherwise than placed (whole, where it made partial sums) is converted in
a node of its own before the op's backward (``:gather``), and an input's gradient made otherwise
than placed is made in that form and converted in a node after it (``:convert``); a step that
gathers or reduce-scatters along a tensor dimension other than the first stages one more copy
(`staging_bytes`).  The keep-everything schedule's peak is the partition's prediction;
`remat.plan` on that graph composes the single-device planner (recompute, swap) with it.  Each op's
node names its op (``extra["op"]``); the nodes the distributed executor cannot recompute without
communicating are marked ``extra["always_saved"]`` (the compiled class's pin,
`remat.core.compiled.pinned`): what a backward keeps beside an op's output, and every op that does
not `runs_locally`.  Node
times are a FLOP model (``FLOPS`` per second for the products, ``BYTES_PER_S`` for the rest), enough
for the planner's trade-offs, not a measurement.

Nothing here imports torch.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from remat.core.errors import InvalidInputError
from remat.core.graph import Graph, Node

from remat.core.opgraph import OpGraph, OpInfo

from .partition import (BATCH_NORMS, LIGHT, PARTIAL, REPLICATE, Placement, Shard, Strategy, letter_sizes,
                        redistribute_bytes, rule_for, strategies)

FORMAT = "remat.partition"
VERSION = 1
FLOPS = 1e11            # per second, products and attention (the FLOP model of `device_graph`)
BYTES_PER_S = 1e10      # per second, every other op (read and write once)
VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "transpose", "t", "permute", "unsqueeze", "squeeze",
         "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "expand", "alias", "detach",
         "expand_as", "lift_fresh_copy", "_assert_tensor_metadata"}
# ops whose backward reads their own output, and of those the ones that read it instead of their input
OUTPUT_INSTEAD = {"softmax", "_softmax", "log_softmax", "_log_softmax", "tanh", "sigmoid", "exp", "relu", "relu_"}
SAVES_OUTPUT = OUTPUT_INSTEAD | {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"}
# ops whose backward reads none of their inputs (only their output's gradient, or their output)
READS_NO_INPUT = {"add", "sub", "neg", "cat", "split", "split_with_sizes", "chunk", "contiguous", "clone", "_to_copy",
                  "sum", "mean", "slice", "select", "expand", "unsqueeze", "squeeze", "permute", "transpose", "t",
                  "view", "reshape", "_unsafe_view", "flatten", "alias", "detach", "unbind", "narrow",
                  "dropout", "native_dropout"} | OUTPUT_INSTEAD    # (dropout: only its factors, `drawn_bytes`)
SCALED = {"mul", "div"}     # by a number when they have one tensor input (`reads_inputs`)
# ops whose autograd saves a tensor the graph does not list: max pooling's int64 indices, one per output element
SAVES_INDICES = {"max_pool1d", "max_pool2d", "max_pool3d"}
# a loss whose backward makes the gradient of its log-probabilities (its input's size) on the way
# to its input's: a transient of its backward node
LOG_PROBS_INSIDE = {"cross_entropy_loss"}
HEAVY = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "convolution", "conv1d", "conv2d", "conv3d",
         "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu", "embedding"}
CREATION = {"arange", "zeros", "ones", "full", "empty", "randn", "rand", "new_zeros", "new_ones", "new_empty",
            "new_full", "scalar_tensor"}
REPLICATED = Strategy("", (), ())   # every device runs the whole op (its placements: all whole)


def draws(op: OpInfo) -> bool:
    """Whether `op` draws random numbers as it runs: dropout in training with a probability
    above 0, and attention with dropout (its ``dropout_p`` argument above 0)."""
    if op.op in ("dropout", "native_dropout"):
        p = op.args[1] if len(op.args) > 1 and op.args[1] is not None else 0.5
        return bool(p) and (len(op.args) < 3 or op.args[2] is None or bool(op.args[2]))
    if op.op == "scaled_dot_product_attention":
        return len(op.args) > 4 and bool(op.args[4])
    return False


def noisy_attention(op: OpInfo) -> bool:
    """Attention with dropout: computed as ATen's math path computes it, its backward reads the
    copies it made (`drawn_bytes`), neither its inputs nor its output."""
    return op.op == "scaled_dot_product_attention" and draws(op)


def reads_inputs(op: OpInfo) -> bool:
    """Whether `op`'s backward reads its inputs: not for `READS_NO_INPUT`, nor for a product or
    quotient by a number (one tensor input: its gradient is the incoming one scaled), nor for
    attention with dropout (`noisy_attention`)."""
    if op.op in READS_NO_INPUT or noisy_attention(op):
        return False
    return not (op.op in SCALED and len(op.inputs) == 1)


def aliases(op: OpInfo) -> bool:
    """Whether `op`'s output is its input's storage: the views, and dropout that drops nothing
    (evaluation, or a probability of 0: ATen returns its input)."""
    return op.op in VIEWS or op.op == "dropout" and not draws(op)


def runs_locally(op: OpInfo, strategy: tuple, placement: dict) -> bool:
    """Whether `op`, run with `strategy` (one per mesh dimension) on tensors placed as `placement`
    says, runs on each device's own parts alone: every input read as it lies, every output made
    as it is placed, no partial sums, no random draw, no synchronised statistics, not a view.
    Such an op can be recomputed in the backward from the parts its inputs were, with no
    communication (what the distributed executor recomputes)."""
    if aliases(op) or draws(op) or any(s.sync for s in strategy):
        return False
    for which, tensors in (("in", op.inputs), ("out", op.outputs)):
        for i, t in enumerate(tensors):
            want = tuple(placed(s, which, i) for s in strategy)
            if PARTIAL in want or want != tuple(placement[t]):
                return False
    return True


def kept_statistics(g: OpGraph, op: OpInfo, ins: list) -> int:
    """Bytes per device of the statistics an op's autograd keeps beside the tensors the graph
    lists (floats of at least 4 bytes): layer norm's mean and reciprocal deviation per
    normalised row; attention's log-sum-exp per query (the fused kernels'; with dropout see
    `drawn_bytes`).  `ins`: the op's inputs' shapes per device."""
    item = max(4, g.tensors[op.inputs[0]].itemsize) if op.inputs else 4
    if op.op == "layer_norm":
        normalized = op.args[1] if len(op.args) > 1 and op.args[1] is not None else ()
        return 2 * math.prod(ins[0][:len(ins[0]) - len(normalized)]) * item
    if op.op == "scaled_dot_product_attention" and not draws(op):
        return math.prod(ins[0][:-1]) * item
    return 0


def drawn_bytes(g: OpGraph, op: OpInfo, ins: list, sp: "Split") -> tuple[int, int]:
    """(bytes per device a random op (`draws`) keeps for its backward beyond its output, bytes of
    the whole tensor of random numbers it draws): dropout keeps its factors (its output's size);
    attention with dropout, computed as ATen's math path computes it, keeps the scaled queries and
    keys, the values (a copy: the product reshapes them, transposed as attention reads them), the
    probabilities, the factors and the dropped probabilities (each of the scores' size).
    `ins`: the op's inputs' shapes per device."""
    item = g.tensors[op.outputs[0]].itemsize
    if op.op in ("dropout", "native_dropout"):
        return math.prod(sp.shapes[op.outputs[0]]) * item, g.tensors[op.outputs[0]].bytes
    q, k = ins[0], ins[1]
    scores = math.prod(q[:-1]) * k[-2]
    whole = math.prod(g.tensors[op.inputs[0]].shape[:-1]) * g.tensors[op.inputs[1]].shape[-2]
    return (3 * scores + math.prod(q) + 2 * math.prod(k)) * item, whole * item


# ---- the ops' descriptions ------------------------------------------------------------------------
def describe(g: OpGraph) -> list:
    """Each op's `OpRule` at its shapes (`partition.rule_for`), in the order of `g.ops`; computed
    once per graph."""
    cached = g.cache.get("rules")
    if isinstance(cached, list) and len(cached) == len(g.ops):
        return cached
    rules = []
    for o in g.ops:
        rule = rule_for(o.op, [g.tensors[t].shape for t in o.inputs], [g.tensors[t].shape for t in o.outputs], o.args)
        n_in = len(rule.inputs) if o.inputs or rule.inputs != [""] else 0   # ("->a": no inputs)
        if n_in != len(o.inputs) or len(rule.outputs) != len(o.outputs):
            raise InvalidInputError(f"op {o.id} ({o.op}): its description {rule.spec!r} does not match its "
                                    f"{len(o.inputs)} inputs and {len(o.outputs)} outputs")
        rules.append(rule)
    g.cache["rules"] = rules
    return rules


def last_reader(g: OpGraph) -> dict:
    """{tensor: the id of the last op that reads it} (computed once per graph)."""
    cached = g.cache.get("last_reader")
    if isinstance(cached, dict):
        return cached
    out = {t: o.id for o in g.ops for t in o.inputs}
    g.cache["last_reader"] = out
    return out


def reduces_here(g: OpGraph, op: OpInfo, t: int, converted: bool = False) -> bool:
    """Whether `op` is where the gradient of input `t` is converted to `t`'s placement: for an
    activation, every reader (each converts its contribution); for a parameter, a reader that
    `converted` it (the conversion's backward returns the contribution in the parameter's
    placement) and its last reader (the contributions of readers that read it as it lies are
    summed where it accumulates, and the sum is reduced once; `mesh_comm` counts exactly which
    reader that is and the other contributions)."""
    return g.tensors[t].kind != "parameter" or converted or last_reader(g).get(t) == op.id


def rule(g: OpGraph, op: OpInfo):
    """`op`'s description (`describe`)."""
    return describe(g)[op.id]


def undescribed(g: OpGraph) -> list:
    """Names of the ops `partition.rule_for` does not describe (they run whole on every device)."""
    return sorted({o.op for o, r in zip(g.ops, describe(g))
                   if r.indices and all(why == "not described" for _, why in r.fixed) and len(r.fixed) == len(r.indices)})


# ---- one cut's costs --------------------------------------------------------------------------
def conversion(src: Placement, dst: Placement, nbytes: int, gloo: bool = False) -> int:
    """Bytes across a 2-way cut (both devices' sends) to turn `src` into `dst`.  With `gloo`
    (a CPU process group, which has no all-to-all) a shard moves to another dimension by an
    all-gather, as DTensor does it there."""
    if gloo and src.kind == "shard" and dst.kind == "shard" and src != dst:
        dst = REPLICATE
    return 2 * redistribute_bytes(src, dst, nbytes, 2)


def placements(shape: tuple) -> list:
    """A tensor's placements in one cut: whole, or halved along a dimension of even size."""
    return [REPLICATE] + [Shard(d) for d, n in enumerate(shape) if n >= 2 and n % 2 == 0]


def halved(shape: tuple, p: Placement) -> tuple:
    if p.kind != "shard":
        return tuple(shape)
    return tuple(n // 2 if d == p.dim else n for d, n in enumerate(shape))


def local_shape(shape: tuple, placements, skip: int | None = None) -> tuple:
    """One device's shape of a tensor of global `shape` placed `placements` (one per mesh
    dimension of 2), leaving out mesh dimension `skip`."""
    shape = tuple(shape)
    for level, p in enumerate(placements):
        if level != skip:
            shape = halved(shape, p)
    return shape


def op_strategies(g: OpGraph, op: OpInfo, shapes: dict) -> list:
    """The strategies of `op` at these shapes: splits along an index of even size; the replicated
    run for a light op or an op with no split."""
    ins, outs = [shapes[t] for t in op.inputs], [shapes[t] for t in op.outputs]
    r = rule(g, op)
    if not op.inputs or op.op in CREATION:
        return [REPLICATED]          # (made whole on every device, then sliced where placed)
    sizes = letter_sizes(r, ins, outs)
    found = [s for s in strategies(r) if sizes.get(s.index, 0) >= 2 and sizes[s.index] % 2 == 0]
    if op.op in LIGHT or op.op not in HEAVY or not found:
        found.append(REPLICATED)
    return found


def placed(s: Strategy, which: str, i: int) -> Placement:
    if s is REPLICATED:
        return REPLICATE
    return (s.inputs if which == "in" else s.outputs)[i]


def grad_placement(s: Strategy, want: Placement) -> Placement:
    """Where an input's gradient is when `s` read the input as `want`: the same shard; partial
    sums where a split op read it whole (each device's part contributes to all of it) or as
    summands (a bias under a summed split, which one device holds: only its gradient is nonzero);
    whole under a replicated run."""
    if s is REPLICATED:
        return REPLICATE
    return want if want.kind == "shard" else PARTIAL


NOT_READ_BACK = {"add", "sub", "embedding", "cat"}   # ops whose backward never reads their parameters
# ops whose autograd saves their input and weight together whenever any gradient is wanted (one
# backward formula computes them all): a convolution's weight is read back even where only the
# weight's own gradient is needed
SAVES_INPUT_AND_WEIGHT = {"convolution", "conv1d", "conv2d", "conv3d"}


def regathered(g: OpGraph, op: OpInfo, i: int, strats: tuple = ()) -> bool:
    """Whether `op`'s backward reads its parameter input i (so a gathered parameter is gathered
    again): it does where another input, not one added to the result (a bias, whose gradient
    needs only the output's), needs a gradient, unless i is itself added or the op's backward
    reads no input; a convolution's weight wherever any gradient is wanted
    (`SAVES_INPUT_AND_WEIGHT`); a batch norm's weight, and its running statistics unless `strats`
    (the op's strategy per level) synchronise its statistics (`BATCH_NORMS`), never its bias."""
    added = rule(g, op).added
    if op.op in NOT_READ_BACK or i in added:
        return False
    if op.op in BATCH_NORMS:      # (training: ATen's backward saves the weight and the running
        # statistics with the input; the synchronised split, `remat.distributed`, the weight only)
        synced = any(s.sync for s in strats)
        wanted = any(g.tensors[t].grad for t in op.inputs)
        if len(op.inputs) != 5:      # (no affine parameters or no running statistics: positions differ)
            return wanted and not synced
        return wanted and (i == 1 or i in (3, 4) and not synced)
    if op.op in SAVES_INPUT_AND_WEIGHT:
        return any(g.tensors[t].grad for t in op.inputs)
    return any(g.tensors[t].grad for j, t in enumerate(op.inputs) if j != i and j not in added)


def input_costs(g: OpGraph, op: OpInfo, s: Strategy, i: int, p: Placement, nbytes: int) -> tuple[int, int]:
    """(communicated bytes, kept bytes per device) of input i of `op` placed `p` under `s`: the
    conversion to what `s` reads, and its gradient's conversion back to `p`.  An activation's
    converted copy is kept for the backward; a parameter's is not: it is converted again for the
    backward (FSDP's second gather), so it costs its bytes twice and holds memory only while
    the op and its backward run."""
    t = g.tensors[op.inputs[i]]
    want = placed(s, "in", i)
    cpu = g.meta.get("device_type") == "cpu"
    comm = conversion(p, want, nbytes, cpu)
    kept = 0
    if t.kind == "parameter":
        if regathered(g, op, i, (s,)):
            comm *= 2
    elif t.kind == "activation" and want != p:
        kept = per_device(want, nbytes)
    if t.grad and reduces_here(g, op, op.inputs[i], want != p):
        comm += conversion(grad_placement(s, want), p, nbytes, cpu)
    return comm, kept


def output_costs(g: OpGraph, op: OpInfo, s: Strategy, j: int, p: Placement, nbytes: int) -> tuple[int, int]:
    """(communicated bytes, bytes per device) of output j of `op` placed `p` under `s`."""
    t = g.tensors[op.outputs[j]]
    made = placed(s, "out", j)
    cpu = g.meta.get("device_type") == "cpu"
    comm = conversion(made, p, nbytes, cpu)
    if t.grad:
        need = made if made.kind == "shard" else REPLICATE
        comm += conversion(p, need, nbytes, cpu)
    return comm, (0 if aliases(op) else per_device(p, nbytes))


def sync_costs(g: OpGraph, op: OpInfo, s: Strategy, shapes: dict) -> int:
    """Bytes across a 2-way cut of the all-reduces of a split with synchronised statistics
    (`Strategy.sync`: training batch norm split along its batch or space): two of the statistics
    in the forward (the sum, then the squares about the mean), one of two such vectors in the
    backward where the input has a gradient; 0 for every other strategy."""
    if not s.sync:
        return 0
    return _sync_reduces(g, op) * conversion(PARTIAL, REPLICATE, _stats_bytes(g, op, s, shapes[op.inputs[0]]))


def _sync_reduces(g: OpGraph, op: OpInfo) -> int:
    """The all-reduces of one statistics vector a synchronised split runs (`sync_costs`)."""
    return 2 + (2 if g.tensors[op.inputs[0]].grad else 0)


def _stats_bytes(g: OpGraph, op: OpInfo, s: Strategy, x_shape: tuple) -> int:
    """Bytes of one statistics vector of `op` split by `s`, its input 0 being `x_shape`."""
    letters = rule(g, op).inputs[0]
    return math.prod(x_shape[letters.index(c)] for c in s.sync) * g.tensors[op.inputs[0]].itemsize


def per_device(p: Placement, nbytes: int) -> int:
    """Bytes per device of a tensor of `nbytes` placed `p` in one 2-way cut."""
    return -(-nbytes // 2) if p.kind == "shard" else nbytes


def held_factor(info, optimizer_factor: float) -> float:
    """How many times a tensor's bytes a device holds for it: a trained parameter with its
    gradient and optimizer state (2 + `optimizer_factor`), anything else once."""
    return 2 + optimizer_factor if info.kind == "parameter" and info.grad else 1


# ---- the dynamic program ----------------------------------------------------------------------
@dataclass
class Cut:
    """One 2-way cut: a placement per tensor and a strategy per op, its communicated bytes (both
    devices), its memory term (bytes per device, the objective's proxy) and whether the program
    was exact."""
    placement: dict
    strategy: dict
    comm: int
    memory: int
    exact: bool
    states: int


def cut(g: OpGraph, shapes: dict, lam: float = 0.0, allowed: dict | None = None, max_states: int = 4096,
        optimizer_factor: float = 0.0, only=None) -> Cut:
    """The cheapest 2-way cut of `g` at `shapes` (tensor id -> shape): communicated bytes +
    `lam` x bytes per device (``g.meta["device_type"] == "cpu"``: costed as on gloo, `conversion`).  `allowed` (tensor id -> placements) and `only` (``only(op,
    strategy) -> bool``) restrict tensors and ops (the baselines); an op none of whose splits
    `only` allows runs replicated."""
    allowed = allowed or {}
    last: dict = {}
    first: dict = {}
    for idx, op in enumerate(g.ops):
        for t in op.inputs:
            last[t] = idx
            first.setdefault(t, idx)
        for t in op.outputs:
            first.setdefault(t, idx)
            last.setdefault(t, idx)
    last[g.loss] = len(g.ops)

    def cands(t: int) -> list:
        own = placements(shapes[t])
        return [p for p in own if p in allowed[t]] or [REPLICATE] if t in allowed else own

    factor = {t: held_factor(info, optimizer_factor) for t, info in g.tensors.items()}
    # the frontier (tensors placed and still to be read), in a fixed order; a state is the tuple
    # of their placements -> (objective, comm, memory, back pointer)
    frontier: list = []
    states: dict = {(): (0.0, 0, 0, None)}
    exact = True
    peak_states = 1
    for idx, op in enumerate(g.ops):
        nb = {t: math.prod(shapes[t]) * g.tensors[t].itemsize for t in op.inputs + op.outputs}
        strats = op_strategies(g, op, shapes)
        if only is not None:
            strats = [x for x in strats if x is REPLICATED or only(op, x)] or [REPLICATED]
        pos = {t: k for k, t in enumerate(frontier)}
        old_in = [(i, pos[t]) for i, t in enumerate(op.inputs) if t in pos]
        new_in = [t for i, t in enumerate(op.inputs) if t not in pos and t not in op.inputs[:i]]
        new = new_in + [t for t in op.outputs if t not in new_in]
        staying = [t for t in frontier if last[t] > idx]
        born = [t for t in new if last[t] > idx]
        nxt_frontier = staying + born
        keep = [pos[t] for t in staying]
        plans = []   # per strategy: (its table for placed inputs, [(comm, memory, born placements, choice)])
        for s in strats:
            table = [(i, k, {p: input_costs(g, op, s, i, p, nb[op.inputs[i]]) for p in cands(op.inputs[i])})
                     for i, k in old_in]
            options = []
            for t in new:
                opts = []
                for p in cands(t):
                    c = m = 0
                    if t in new_in:
                        m = factor[t] * per_device(p, nb[t])
                        for i2, t2 in enumerate(op.inputs):
                            if t2 == t:
                                c2, m2 = input_costs(g, op, s, i2, p, nb[t])
                                if g.tensors[t].kind == "input" and p == placed(s, "in", i2):
                                    c2 = 0                            # the loader places it so
                                c, m = c + c2, m + m2
                    if t in op.outputs:
                        c2, m2 = output_costs(g, op, s, op.outputs.index(t), p, nb[t])
                        c, m = c + c2, m + m2
                    opts.append((p, c, m))
                if last[t] <= idx:   # not read after this op: only its cheapest placement matters
                    opts = [min(opts, key=lambda o: o[1] + lam * o[2])]
                options.append(opts)
            combos = []
            for combo in itertools.product(*options):
                chosen = tuple((t, o[0]) for t, o in zip(new, combo))
                combos.append((sum(o[1] for o in combo), sum(o[2] for o in combo),
                               tuple(o[0] for t, o in zip(new, combo) if last[t] > idx), (s, chosen)))
            plans.append((table, combos, sync_costs(g, op, s, shapes)))
        nxt: dict = {}
        for key, (obj, comm, mem, back) in states.items():
            kept = tuple(key[k] for k in keep)
            for table, combos, sync in plans:
                bc, bm = sync, 0
                for i, k, costs in table:
                    c, m = costs[key[k]]
                    bc += c
                    bm += m
                base = obj + bc + lam * bm
                for c, m, born_p, choice in combos:
                    k2 = kept + born_p
                    o = base + c + lam * m
                    if k2 not in nxt or o < nxt[k2][0]:
                        nxt[k2] = (o, comm + bc + c, mem + bm + m, (back, op.id, choice))
        if not nxt:
            raise InvalidInputError(f"partition: op {op.id} ({op.op}) has no placement its tensors allow")
        if len(nxt) > max_states:
            exact = False
            nxt = dict(sorted(nxt.items(), key=lambda kv: kv[1][0])[:max_states])
        peak_states = max(peak_states, len(nxt))
        states = nxt
        frontier = nxt_frontier
    obj, comm, mem, back = min(states.values(), key=lambda v: v[0])
    placement: dict = {}
    strategy: dict = {}
    while back is not None:
        back, op_id, (s, chosen) = back
        strategy[op_id] = s
        for t, p in chosen:
            placement.setdefault(t, p)
    for t in g.tensors:
        placement.setdefault(t, REPLICATE)
    return Cut(placement, strategy, comm, mem, exact, peak_states)


def op_cost(g: OpGraph, shapes: dict, op: OpInfo, s: Strategy, placement: dict) -> int:
    """Communicated bytes of `op` run with strategy `s`, its tensors placed by `placement`."""
    total = sync_costs(g, op, s, shapes)
    for i, t in enumerate(op.inputs):
        nb = math.prod(shapes[t]) * g.tensors[t].itemsize
        if g.tensors[t].kind == "input" and placement[t] == placed(s, "in", i):
            continue                                        # the loader places it so
        total += input_costs(g, op, s, i, placement[t], nb)[0]
    for j, t in enumerate(op.outputs):
        nb = math.prod(shapes[t]) * g.tensors[t].itemsize
        total += output_costs(g, op, s, j, placement[t], nb)[0]
    return total


def evaluate(g: OpGraph, shapes: dict, placement: dict, strategy: dict) -> int:
    """Communicated bytes of a given cut (the cost `cut` minimises, lambda = 0)."""
    return sum(op_cost(g, shapes, op, strategy[op.id], placement) for op in g.ops)


def memory_term(g: OpGraph, shapes: dict, placement: dict, strategy: dict, optimizer_factor: float = 0.0) -> int:
    """The memory term of a given cut (bytes per device, as `cut` sums it: each tensor no op
    makes once, `held_factor` times, and what `input_costs` and `output_costs` keep)."""
    made = {t for op in g.ops for t in op.outputs}
    seen: set = set()
    total = 0
    for op in g.ops:
        s = strategy[op.id]
        for i, t in enumerate(op.inputs):
            nb = math.prod(shapes[t]) * g.tensors[t].itemsize
            if t not in made and t not in seen:
                seen.add(t)
                total += held_factor(g.tensors[t], optimizer_factor) * per_device(placement[t], nb)
            total += input_costs(g, op, s, i, placement[t], nb)[1]
        for j, t in enumerate(op.outputs):
            total += output_costs(g, op, s, j, placement[t], math.prod(shapes[t]) * g.tensors[t].itemsize)[1]
    return total


# ---- k = 2^m devices ----------------------------------------------------------------------------
@dataclass
class Split:
    """The recursive partition over ``2^len(levels)`` devices: per tensor its placement per mesh
    dimension, per op its strategy per level, the per-device shapes and the bytes communicated
    per step (all devices; `Cut.comm` of level l counted 2^l times)."""
    devices: int
    levels: list
    placement: dict
    strategy: dict
    shapes: dict
    comm: int
    exact: bool

    def used_shape(self, g: OpGraph, op: OpInfo, i: int) -> tuple:
        """Per device, the shape of input i as `op` reads it (after its conversions)."""
        return local_shape(g.tensors[op.inputs[i]].shape, [placed(s, "in", i) for s in self.strategy[op.id]])


def levels_of(devices: int) -> int:
    m = int(round(math.log2(devices))) if devices >= 1 else -1
    if devices < 1 or 2 ** m != devices:
        raise InvalidInputError(f"devices: Tofu's recursive search splits in halves, so the device count must be a "
                                f"power of 2 (1, 2, 4, 8, ...), got {devices}")
    return m


def split(g: OpGraph, devices: int, lam: float = 0.0, **options) -> Split:
    """Tofu's recursion: cut in 2, halve the tensors, cut again, `levels_of(devices)` times."""
    shapes = {t: tuple(info.shape) for t, info in g.tensors.items()}
    levels: list = []
    comm, exact = 0, True
    for level in range(levels_of(devices)):
        c = cut(g, shapes, lam, **options)
        if all(c.placement[t].kind != "shard" for t in g.tensors):
            raise InvalidInputError(f"devices: more devices than the model can use: at {2 ** (level + 1)} devices no "
                                    f"tensor can be split again (the most this search uses is {2 ** level}); "
                                    "use fewer devices or a larger batch")
        levels.append(c)
        comm += 2 ** level * c.comm
        exact = exact and c.exact
        shapes = {t: halved(shapes[t], c.placement[t]) for t in shapes}
    placement = {t: tuple(c.placement[t] for c in levels) for t in g.tensors}
    strategy = {op.id: tuple(c.strategy[op.id] for c in levels) for op in g.ops}
    return Split(devices, levels, placement, strategy, shapes, comm, exact)


def mesh_steps(src: tuple, dst: tuple) -> list:
    """The conversions DTensor runs to turn placements `src` (one per mesh dimension of 2) into
    `dst`, as [(mesh dimension, from, to)] in order: its greedy plan (torch 2.13,
    ``generate_greedy_transform_infos``): where `src` shards the tensor, first from the last mesh
    dimension to the first, each to its target (to whole instead where a target shard is nested
    differently under the dimensions before it), then from the first to the last, what is left;
    where `src` shards nothing (partial sums, whole), from the first to the last only."""
    cur = list(src)
    steps = []
    if any(p.kind == "shard" for p in cur):
        for level in reversed(range(len(cur))):
            target = dst[level]
            if target.kind == "shard":
                before = [i for i in range(level) if cur[i] == target]
                wanted = [i for i in range(level) if dst[i] == target]
                if before != wanted:
                    target = REPLICATE
            if cur[level] != target:
                steps.append((level, cur[level], target))
                cur[level] = target
    for level in range(len(cur)):
        if cur[level] != dst[level]:
            steps.append((level, cur[level], dst[level]))
            cur[level] = dst[level]
    return steps


def mesh_conversion(src: tuple, dst: tuple, shape: tuple, itemsize: int, device_type: str = "cuda") -> int:
    """Bytes all devices send to turn a tensor of global `shape` placed `src` (one placement per
    mesh dimension of 2) into `dst` as DTensor does it: one mesh dimension at a time, in
    `mesh_steps`' order, each of the 2^(m-1) pairs along it exchanging its local tensor (the global
    shape halved along the current shards of the other dimensions).  On ``"cpu"`` (gloo, which has
    no all-to-all) DTensor moves a shard to another dimension by an all-gather."""
    cur = list(src)
    m = len(cur)
    total = 0
    for level, frm, to in mesh_steps(tuple(src), tuple(dst)):
        local = local_shape(shape, cur, skip=level)
        total += 2 ** (m - 1) * conversion(frm, to, math.prod(local) * itemsize, device_type == "cpu")
        cur[level] = to
    return total


def mesh_comm(g: OpGraph, sp: Split, device_type: str = "cuda") -> int:
    """Bytes all devices send in one step of `sp` as DTensor runs it (`mesh_conversion` for each
    conversion `op_cost` counts, with every level's placements at once).  Equal to the
    recursion's sum (`Split.comm`) at 2 devices; above, it counts what a level's conversion costs
    on every device pair of the other levels, which Tofu's recursion (a group as one worker)
    does not."""
    total = 0
    m = len(sp.levels)
    # per parameter, the last reader that reads it as it lies (no conversion): where the
    # contributions of such readers are summed and reduced once
    plain_last: dict = {}
    for op in g.ops:
        for i, t in enumerate(op.inputs):
            if g.tensors[t].kind == "parameter" and tuple(placed(s, "in", i) for s in sp.strategy[op.id]) == \
                    sp.placement[t]:
                plain_last[t] = (op, i)
    for op in g.ops:
        strats = sp.strategy[op.id]
        for s in strats:           # synchronised statistics: all-reduced along that mesh dimension
            if s.sync:
                x = local_shape(g.tensors[op.inputs[0]].shape, [placed(s2, "in", 0) for s2 in strats])
                total += 2 ** (m - 1) * _sync_reduces(g, op) * conversion(PARTIAL, REPLICATE,
                                                                           _stats_bytes(g, op, s, x))
        for i, t in enumerate(op.inputs):
            info = g.tensors[t]
            want = tuple(placed(s, "in", i) for s in strats)
            if info.kind == "input" and want == sp.placement[t]:
                continue
            c = mesh_conversion(sp.placement[t], want, info.shape, info.itemsize, device_type)
            if info.kind == "parameter" and regathered(g, op, i, strats):
                c *= 2
            if info.grad:
                grad = tuple(grad_placement(s, w) for s, w in zip(strats, want))
                last = plain_last.get(t)
                if info.kind != "parameter" or want != sp.placement[t] or last[0] is op:
                    # an activation's contribution, a converted parameter's (the conversion's
                    # backward), or the sum of the plain readers' (where it accumulates)
                    c += mesh_conversion(grad, sp.placement[t], info.shape, info.itemsize, device_type)
                else:     # a plain reader's contribution, converted to the last one's to be summed
                    into = tuple(grad_placement(s2, placed(s2, "in", last[1])) for s2 in sp.strategy[last[0].id])
                    c += mesh_conversion(grad, into, info.shape, info.itemsize, device_type)
            total += c
        for j, t in enumerate(op.outputs):
            info = g.tensors[t]
            made = tuple(placed(s, "out", j) for s in strats)
            total += mesh_conversion(made, sp.placement[t], info.shape, info.itemsize, device_type)
            if info.grad:
                need = tuple(p if p.kind == "shard" else REPLICATE for p in made)
                total += mesh_conversion(sp.placement[t], need, info.shape, info.itemsize, device_type)
    return total


# ---- per-device memory: the simulator's graph --------------------------------------------------
def forward_time(g: OpGraph, op: OpInfo, ins: list, outs: list) -> float:
    """Seconds of `op`'s forward in the FLOP model, its inputs and outputs of shapes `ins` and
    `outs`: products and attention at `FLOPS`, every op's bytes read and written at `BYTES_PER_S`.
    Its backward is costed twice its forward."""
    flops = _flops(op, rule(g, op), ins, outs) if op.op in HEAVY else 0.0
    moved = sum(math.prod(s) * g.tensors[t].itemsize for s, t in zip(ins + outs, op.inputs + op.outputs))
    return flops / FLOPS + moved / BYTES_PER_S


def _flops(op: OpInfo, r, ins: list, outs: list) -> float:
    sizes = letter_sizes(r, ins, outs)
    out_letters = "".join(r.outputs)
    if op.op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        q, k, v = ins[:3]
        return 2.0 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    summed = {c for c in "".join(r.inputs) if c not in out_letters and sum(c in t for t in r.inputs) >= 2}
    n = 2.0 * math.prod(sizes[c] for c in set(out_letters) | summed)
    if op.op.startswith("conv"):
        n *= math.prod(ins[1][2:])
    return n


def between_bytes(src: tuple, dst: tuple, shape: tuple, itemsize: int) -> int:
    """Per device, the bytes of the intermediate forms a conversion from `src` to `dst` passes
    through (one mesh dimension at a time, as `mesh_conversion`; neither end counted)."""
    cur = list(src)
    total = 0
    for level, _, to in mesh_steps(tuple(src), tuple(dst))[:-1]:
        cur[level] = to
        total += math.prod(local_shape(shape, cur)) * itemsize
    return total


def staging_bytes(src: tuple, dst: tuple, shape: tuple, itemsize: int) -> int:
    """Per device, the most bytes of the copy DTensor stages inside one step of a conversion from
    `src` to `dst` that gathers or reduce-scatters along a tensor dimension other than the first:
    the collective works along the first, so the pieces are concatenated (or split and
    concatenated) into one more tensor of the step's size whole along that mesh dimension."""
    cur, most = list(src), 0
    for level, frm, to in mesh_steps(tuple(src), tuple(dst)):
        dim = frm.dim if frm.kind == "shard" and to.kind != "shard" else \
            to.dim if frm.kind == "partial" and to.kind == "shard" else None
        if dim:
            whole = list(cur)
            whole[level] = REPLICATE
            most = max(most, math.prod(local_shape(shape, whole)) * itemsize)
        cur[level] = to
    return most


def passing_bytes(src: tuple, dst: tuple, shape: tuple, itemsize: int) -> int:
    """Per device, the bytes a conversion from `src` to `dst` passes through besides its two
    ends: its intermediate forms (`between_bytes`) and the copy it stages (`staging_bytes`)."""
    return between_bytes(src, dst, shape, itemsize) + staging_bytes(src, dst, shape, itemsize)


def conversion_transient(src: tuple, dst: tuple, shape: tuple, itemsize: int) -> int:
    """Per device, the bytes a tensor made placed `src` takes while it is converted to `dst`,
    beside its converted form (which the graph counts): itself and what the conversion passes
    through (`passing_bytes`); 0 where nothing moves."""
    if tuple(src) == tuple(dst):
        return 0
    return math.prod(local_shape(shape, list(src))) * itemsize + passing_bytes(src, dst, shape, itemsize)


def _arrival_bytes(g: OpGraph, sp: Split, op: OpInfo, i: int) -> tuple[int, int]:
    """Per device, (the bytes of parameter input i's gradient as `op` makes it, those of the
    intermediate forms its reduction to the parameter's placement passes through: one mesh
    dimension at a time, as `mesh_conversion`); (0, 0) where it arrives in place."""
    t = op.inputs[i]
    info = g.tensors[t]
    src = [grad_placement(s, placed(s, "in", i)) for s in sp.strategy[op.id]]
    dst = sp.placement[t]
    if tuple(src) == tuple(dst):
        return 0, 0
    return (math.prod(local_shape(info.shape, src)) * info.itemsize,
            between_bytes(tuple(src), tuple(dst), info.shape, info.itemsize))


def converting(passing: int, computing: int) -> int:
    """What an op's workspace adds for the conversions of its inputs, which run before it computes:
    their intermediate forms and staged copies (`passing`, the most of one conversion) are let go
    before the op makes its outputs and the rest of its workspace (`computing`), so the op's
    instant holds the larger of the two (the executor waits for gloo's worker to let each
    collective's tensors go, `remat.distributed.released`)."""
    return max(0, passing - computing)


def device_graph(g: OpGraph, sp: Split, optimizer_factor: float = 0.0, name: str = "") -> Graph:
    """One device's step under `sp` as a remat `Graph` (module docstring): its keep-everything
    peak is the partition's predicted peak per device; `remat.plan` can plan it further."""
    nbytes = {t: math.prod(sp.shapes[t]) * info.itemsize for t, info in g.tensors.items()}
    root = {t: t for t in g.tensors}
    producer: dict = {}
    compute = []
    for op in g.ops:
        if aliases(op) and op.inputs:
            for t in op.outputs:
                root[t] = root[op.inputs[0]]
                producer[t] = producer.get(root[op.inputs[0]])
            continue
        compute.append(op)
        for t in op.outputs:
            producer[t] = op.id
    loss_op = producer.get(root[g.loss])
    if loss_op is None:
        raise InvalidInputError("partition: the loss is not computed by any op")
    forward = [op for op in compute if op.id != loss_op]
    loss = next(op for op in compute if op.id == loss_op)
    nid = {}
    nodes: list = []
    edges: set = set()
    seen_param: set = set()
    kept: dict = {}
    converted: dict = {}       # op -> the inputs it reads converted (its backward reads the copies)
    transient: dict = {}       # op -> bytes of the parameters gathered for it (while it runs)
    back_transient: dict = {}  # op -> of those, (the bytes its backward gathers again, their most passing bytes)

    def add(kind, op, nbytes_, time, persistent=0, workspace=0, suffix=""):
        i = len(nodes)
        name = f"{op.module or op.op}:{op.op}#{op.id}" + (":bwd" if kind == "backward" else "") + suffix
        extra = {"op": op.id}
        if kind == "forward" and (suffix or not runs_locally(op, sp.strategy[op.id], sp.placement)):
            extra["always_saved"] = True   # (recomputing it would communicate: module docstring)
        nodes.append(Node(i, name, kind, time, int(nbytes_), int(workspace), extra, int(persistent)))
        return i

    for op in forward + [loss]:
        ins = [sp.used_shape(g, op, i) for i in range(len(op.inputs))]
        outs = [sp.shapes[t] for t in op.outputs]
        t_fwd = forward_time(g, op, ins, outs)
        # inputs gathered for the op: their gathered form (and its intermediate forms, while gathering)
        gathered = []
        for i, (s, t) in enumerate(zip(ins, op.inputs)):
            kind = g.tensors[t].kind
            # a converted copy: a gathered one, or any of an activation or of the batch (a slice
            # of a whole tensor is a copy too, which the op's backward keeps)
            if math.prod(s) > math.prod(sp.shapes[t]) or kind in ("activation", "input") and s != sp.shapes[t]:
                want = tuple(placed(x, "in", i) for x in sp.strategy[op.id])
                extra = passing_bytes(sp.placement[t], want, g.tensors[t].shape, g.tensors[t].itemsize)
                again = regathered(g, op, i, sp.strategy[op.id])
                gathered.append((math.prod(s) * g.tensors[t].itemsize, extra, kind, again))
                converted.setdefault(op.id, set()).add(t)
        copies = sum(b for b, _, kind, _ in gathered if kind in ("activation", "input"))
        # the parameters gathered for the op live while it runs; what a conversion passes through
        # (its intermediate forms, its staged copy) is gone before the op computes (`converting`)
        transient[op.id] = sum(b for b, _, kind, _ in gathered if kind == "parameter")
        passing = max((x for _, x, _, _ in gathered), default=0)
        back_transient[op.id] = (sum(b for b, _, kind, again in gathered if kind == "parameter" and again),
                                 max((x for _, x, kind, again in gathered if kind == "parameter" and again), default=0))
        out_b = sum(nbytes[t] for t in op.outputs if root[t] == t)
        # outputs made where they are not placed: the made form while it is converted
        made = [tuple(placed(x, "out", j) for x in sp.strategy[op.id]) for j in range(len(op.outputs))]
        after = sum(conversion_transient(m, sp.placement[t], g.tensors[t].shape, g.tensors[t].itemsize)
                    for m, t in zip(made, op.outputs))
        # what the backward keeps beside the op's output: converted copies of its inputs, max
        # pooling's indices, statistics (`kept_statistics`), what a random op keeps (`drawn_bytes`)
        for_backward = copies + kept_statistics(g, op, ins)
        if op.op in SAVES_INDICES:
            for_backward += sum(math.prod(sp.shapes[t]) * 8 for t in op.outputs)
        if any(s.sync for s in sp.strategy[op.id]):
            # synchronised statistics (`remat.distributed`): one temporary of the input's size
            # in the forward (the squares about the mean) and in the backward (the normalised input)
            after += math.prod(ins[0]) * g.tensors[op.inputs[0]].itemsize
        if draws(op):
            saved, whole = drawn_bytes(g, op, ins, sp)
            for_backward += saved
            if any(s is not REPLICATED for s in sp.strategy[op.id]):
                after += whole       # every device draws the whole tensor, keeps its part
        transient[op.id] += converting(passing, out_b + after) + after
        kind = "loss" if op is loss else "forward"
        makers = {nid[producer[root[t]]] for t in op.inputs if producer.get(root[t]) is not None}
        if for_backward:   # a node of their own, so that the op's outputs are let go after their
            # last reader while these wait for the backward
            kept[op.id] = add("forward", op, for_backward, 0.0, suffix=":saved")
            edges.update((m, kept[op.id]) for m in makers)
        nid[op.id] = add(kind, op, out_b, t_fwd * (3 if op is loss else 1), workspace=transient[op.id])
        edges.update((m, nid[op.id]) for m in makers)
        if for_backward:
            edges.add((kept[op.id], nid[op.id]))
    bwd, gather_in, convert_out, moved = {}, {}, {}, {}

    def form(t: int, where: tuple) -> int:
        return math.prod(local_shape(g.tensors[t].shape, list(where))) * g.tensors[t].itemsize

    for op in reversed(forward):
        strat = sp.strategy[op.id]
        # the outputs' gradients where the op's backward reads them otherwise than placed (whole
        # where it made partial sums): converted first, in a node of their own
        need = {t: tuple(REPLICATE if placed(x, "out", j) == PARTIAL else placed(x, "out", j) for x in strat)
                for j, t in enumerate(op.outputs) if root[t] == t}
        need = {t: w for t, w in need.items() if w != tuple(sp.placement[t])}
        if need:
            info = [(form(t, w), passing_bytes(sp.placement[t], w, g.tensors[t].shape, g.tensors[t].itemsize))
                    for t, w in need.items()]
            gather_in[op.id] = add("backward", op, sum(b for b, _ in info), 0.0, workspace=max(x for _, x in info),
                                   suffix=":gather")
        # the inputs' gradients it makes elsewhere than placed (partial sums where it read an
        # input whole): made in that form, then converted in a node of their own
        made_at = {t: tuple(grad_placement(x, placed(x, "in", i)) for x in strat) for i, t in enumerate(op.inputs)
                   if g.tensors[t].grad and g.tensors[root[t]].kind == "activation"}
        moved[op.id] = {t for t, w in made_at.items() if w != tuple(sp.placement[t])}
        grads = sum(form(t, made_at[t]) if t in moved[op.id] else nbytes[root[t]] for t in made_at)
        params = [t for t in set(op.inputs) if g.tensors[root[t]].kind == "parameter" and g.tensors[t].grad]
        first = [t for t in params if root[t] not in seen_param]
        seen_param.update(root[t] for t in params)
        reductions = {t: _arrival_bytes(g, sp, op, i) for i, t in enumerate(op.inputs) if t in first}
        in_place = sum(nbytes[root[t]] for t in first if reductions[t][0] == 0)
        reduced = sum(nbytes[root[t]] for t in first if reductions[t][0] > 0)
        arriving, between = sum(a for a, _ in reductions.values()), sum(b for _, b in reductions.values())
        # its workspace covers its persistent bytes while it runs (`remat.core.simulate`): the
        # gradients arrive beside the parameters gathered again (the ones that arrive in place
        # are the parameters' gradients at once)
        again, passing = back_transient[op.id]
        work = arriving + in_place
        if any(s.sync for s in sp.strategy[op.id]) or op.op in LOG_PROBS_INSIDE:
            work += math.prod(sp.used_shape(g, op, 0)) * g.tensors[op.inputs[0]].itemsize
        work += again + converting(passing, grads + work)
        i = add("backward", op, grads, 2 * nodes[nid[op.id]].time, in_place, work)
        bwd[op.id] = i
        if op.id in gather_in:
            edges.add((gather_in[op.id], i))
        if moved[op.id]:
            extra = max(passing_bytes(made_at[t], sp.placement[t], g.tensors[t].shape, g.tensors[t].itemsize)
                        for t in moved[op.id])
            convert_out[op.id] = add("backward", op, sum(nbytes[root[t]] for t in moved[op.id]), 0.0, workspace=extra,
                                     suffix=":convert")
            edges.add((i, convert_out[op.id]))
        if arriving:
            # then, once autograd has let the op's saved inputs go (the hook that reduces a
            # gradient runs after its accumulation), reduced beside their own arriving form
            r = add("backward", op, 0, 0.0, reduced, arriving + between + reduced, suffix=":reduce")
            edges.add((i, r))
        # what the backward reads: the forward's saved tensors, and its outputs' gradients
        for t in op.inputs if reads_inputs(op) else ():
            p = producer.get(root[t])
            if p is not None and g.tensors[root[t]].kind == "activation" and t not in converted.get(op.id, ()):
                edges.add((nid[p], i))
        if op.op in SAVES_OUTPUT and not noisy_attention(op):
            edges.add((nid[op.id], i))
        if op.id in kept:
            edges.add((kept[op.id], i))
    for op in forward + [loss]:
        for t in op.inputs:
            p = producer.get(root[t])
            if p is not None and p in bwd and g.tensors[t].grad:
                source = convert_out[op.id] if t in moved.get(op.id, ()) else bwd.get(op.id, nid[op.id])
                edges.add((source, gather_in.get(p, bwd[p])))
    # (a tensor no op reads, a tied parameter's other name, say, is not on the device)
    read = {t for op in g.ops for t in op.inputs}
    fixed = sum(nbytes[t] * (1 + (optimizer_factor if info.grad else 0)) for t, info in g.tensors.items()
                if info.kind == "parameter" and root[t] == t and t in read)
    fixed += sum(nbytes[t] for t, info in g.tensors.items() if info.kind == "input" and root[t] == t and t in read)
    meta = {"model": name or g.meta.get("model", "partition"), "granularity": "partition", "devices": sp.devices,
            "source": "remat.solvers.tofu.device_graph"}
    return Graph(nodes, sorted(edges), fixed, meta)


# ---- the baselines' restrictions ----------------------------------------------------------------
def roles(g: OpGraph) -> dict:
    """{tensor: {"batch": dim, "seq": dim}}: where the batch's dimensions 0 (examples) and 1 (a
    sequence's positions, for inputs of rank >= 2) went, followed through the ops' index letters
    from the batch inputs (a dimension merged into another keeps its role when it is the outer one)."""
    out: dict = {t: {} for t in g.tensors}
    for t, info in g.tensors.items():
        if info.kind == "input" and info.shape:
            out[t]["batch"] = 0
            if len(info.shape) >= 2:
                out[t]["seq"] = 1
    for op in g.ops:
        found: dict = {}
        for letters, t in zip(rule(g, op).inputs, op.inputs):
            for role, d in out[t].items():
                if d < len(letters):
                    found.setdefault(role, letters[d])
        for letters, t in zip(rule(g, op).outputs, op.outputs):
            for role, c in found.items():
                if c in letters:
                    out[t][role] = letters.index(c)
    return out


def role_letters(g: OpGraph, op: OpInfo, where: dict) -> dict:
    """{role: index letter} of `op` (from its tensors' roles)."""
    found: dict = {}
    r = rule(g, op)
    for letters, t in zip(r.inputs + r.outputs, op.inputs + op.outputs):
        for role, d in where[t].items():
            if d < len(letters):
                found.setdefault(role, letters[d])
    return found
