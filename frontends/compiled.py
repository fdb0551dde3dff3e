"""``torch.compile(model, backend=remat.compiler(budget))``: remat plans the AOTAutograd joint
graph of each compiled region and hands the plan to the partitioner as its own save / recompute
tags (``node.meta["recompute"]``, `torch.utils.checkpoint.CheckpointPolicy`), so the
partitioner builds, and the backend (inductor or aot_eager) compiles, the planned step.

Per region (one joint graph; a graph break makes several):

1. `joint_graph` turns the joint graph into a remat `Graph` from its fake tensors alone (nothing
   runs, so the first call never peaks above the plan): one node per op that allocates (views,
   ``getitem`` and other aliasing ops join the node that owns their storage; an op with several
   outputs read elsewhere is one node per output, its parts); kind ``backward`` for ops that
   depend on a tangent, ``forward`` for the rest (a backward formula's part that reads only
   forward values is a forward node, which may be recomputed); one ``loss`` node holding the
   tangents; the primals (parameters, buffers, inputs) are the fixed bytes; the region's outputs
   (its forward results and the gradients) stay to the step's end (persistent bytes).  Time:
   each op run alone on the device on made-up tensors of its shapes (`OpTimes`), or from its
   FLOP and byte counts (`FlopsModel`).
2. `remat.plan(graph, budget, executor="compiled")` solves it in the compiled class
   (`remat.core.compiled`): each forward node saved, or recomputed once in the backward before its
   first use; the prediction is the simulation of that program.
3. Every forward op gets ``MUST_RECOMPUTE`` (its node is in the plan's R) or ``MUST_SAVE``; the
   partitioner (``min_cut_rematerialization_partition``, whose free choices are then views
   only) cuts the graph, and replays the random ops it recomputes with the forward's RNG state
   (``functionalize_rng_ops``): recomputed dropout masks equal the forward's.

With inductor, what its code does beyond the partitioner's graphs is modelled where it is known:
the channels-last copies of a convolutional graph's inputs (`layout_copies`: nodes of the plan's
graph that no tag changes, live to their last use, in the plan as in the replay), no ATen
scratch for the ops it generates kernels for (`inductor_generates`), convolutions timed and
their scratch measured on channels-last tensors (`OpTimes`); with ``fused``, the ops it
generates kernels for are priced by the bytes a fused kernel moves for them; with ``buffers``
(`remat.compiler` option, off by default), two of its buffer rewrites: the backward's scatters
into zeros written in place (`inplace_source`), a matrix product folded into the sum that reads
it (`folds_into_addmm`).  Always with inductor: what its fused kernels store and where they
write.  A pointwise value it does not store (`inductor_inlines`: its lowering's store-or-inline
rules) is computed again inside each kernel that reads it, so what it reads lives to the last
of those kernels (a residual gradient's sum read by two kernels keeps its three inputs, not one
sum: 4 MiB over the op-by-op replay inside a ResNet-18's backward, over its budget); a stored
pointwise result is written into the buffer of an input its kernel reads last, of its layout
(`writes_into`: a batch norm's backward into the saved ReLU output).  Both in the replay, and in
the plan's class (`remat.core.compiled`: backward ops it does not store have no bytes and their
readers read what they read; recomputed forward ones are ``inline`` ops before each reader; an
in-place result follows an ``into`` op).  Not modelled here: its memory-aware reordering (an op
whose output only the caller reads, made from small inputs, run after the peak: torchvision
ResNet-50's classifier weight gradient: its steps measure 8.13 MB under the replay, 30 KB with
the reordering off) and its horizontal fusions (a ViT's saved q and k of every layer copied in
one kernel at the forward's end, keeping them all to there).  What inductor finally generates
is read by `remat.frontends.inductor_code`, and ``remat.compiler`` predicts the region from that
code (`remat.compiling`).

Limits, named: no swap (offload) plans yet; with graph breaks each region is planned within its
share of the budget, first come, first served (``remat.compiling``: the regions before it hold
part of the budget, the later ones' parameters and gradients are added to it when they are
compiled); a loss computed eagerly after the compiled region is not in its plan (the compiler
says so when a region's results are read outside the regions: `remat.compiling`).
"""
from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from remat.core.compiled import normal
from remat.core.graph import Graph, Node

from .measuring import storage_key
from .profile import FlopsModel

log = logging.getLogger("remat.compiled")

BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")
ALIASING = {"_unsafe_view", "alias", "detach", "lift_fresh"}


def _tensors(val: Any) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for x in val for t in _tensors(x)]
    return []


def _out_tensors(n: fx.Node) -> list:
    """The tensors of fx node `n`'s value, in order; where it has none of its own (a random-state
    wrapper in a partitioned graph, ``run_and_save_rng_state`` / ``run_with_rng_state``), its
    ``getitem`` readers' values, by index."""
    if n.meta.get("val") is not None:
        return _tensors(n.meta["val"])
    parts = sorted((u for u in n.users if u.target is operator.getitem), key=lambda u: u.args[1])
    return [t for u in parts for t in _tensors(u.meta.get("val"))]


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001  (a tensor without a storage: its elements)
        return int(t.numel() * t.element_size())


def is_alias(n: fx.Node) -> bool:
    """The op returns a view of (or the same storage as) its first input: it allocates nothing."""
    if n.target is operator.getitem:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return False
    if getattr(n.target, "__name__", "").split(".")[0] in ALIASING:
        return True
    rets = schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _inner_op(n: fx.Node) -> tuple[Any, tuple]:
    """(the op `n` runs, its arguments): a random-state wrapper (``run_with_rng_state(state, op,
    *args)``, ``run_and_save_rng_state(op, *args)``) runs the op among its arguments; (None, ())
    for a wrapper without one."""
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target, n.args
    k = next((i for i, a in enumerate(n.args) if isinstance(a, torch._ops.OpOverload)), None)
    return (None, ()) if k is None else (n.args[k], n.args[k + 1:])


def _scratch(n: fx.Node) -> int:
    """Bytes a kernel allocates inside itself beyond its outputs, where known, on the CPU:
    ``native_dropout`` multiplies by a float copy of its boolean mask (the input's size), also
    where a random-state wrapper (``run_with_rng_state``) runs it; a pointwise op copies each
    input (not a 0-d one) of another dtype than the inputs' common one to that dtype first
    (TensorIterator's input promotion on the CPU: decomposed dropout's ``mul`` of a boolean mask
    by a float tensor makes a float copy of the mask; a comparison's boolean result is no
    promotion).  A random-state wrapper's value is its ``getitem`` readers' where the partitioned
    graph gives the wrapper none (the generator's state a ``run_with_rng_state`` holds besides:
    `rng_state_bytes`, which `OpTimes.scratch` adds)."""
    op, args = _inner_op(n)
    op = op or n.target
    name = getattr(op, "__name__", "").split(".")[0]
    val = [t for t in _out_tensors(n) if t.dim() > 0]
    if not val or val[0].device.type != "cpu":
        return 0
    if name == "native_dropout":
        return val[0].numel() * val[0].element_size()
    if torch.Tag.pointwise in getattr(op, "tags", ()) and len(val) == 1:
        ins = [a.meta.get("val") for a in args[1 if name == "where" else 0:] if isinstance(a, fx.Node)]
        ins = [t for t in ins if isinstance(t, torch.Tensor) and t.dim() > 0]
        if not ins:
            return 0
        common = functools.reduce(torch.promote_types, [t.dtype for t in ins])
        size = torch.empty((), dtype=common).element_size()
        return sum(t.numel() * size for t in ins if t.dtype != common)
    return 0


def rng_state_bytes(n: fx.Node) -> int:
    """Bytes of the CPU generator's state that `n` holds while its op runs: a
    ``run_with_rng_state`` (it sets the state it is handed and restores the one it saved), not
    another op."""
    if n.op != "call_function" or n.target is not torch.ops.higher_order.run_with_rng_state:
        return 0
    return torch.get_rng_state().numel()


def _flops(n: fx.Node) -> int:
    from torch.utils.flop_counter import flop_registry
    fn = flop_registry.get(getattr(n.target, "overloadpacket", None))
    if fn is None:
        return 0
    val = lambda x: x.meta.get("val") if isinstance(x, fx.Node) else x  # noqa: E731
    try:
        return int(fn(*fx.node.map_aggregate(n.args, val), **fx.node.map_aggregate(n.kwargs, val),
                      out_val=n.meta.get("val")))
    except Exception:  # noqa: BLE001  (a formula that cannot read these arguments: no flops)
        return 0


def region_device(gm: fx.GraphModule) -> torch.device:
    """The device of the joint graph's first tensor input (the CPU where it has none)."""
    for n in gm.graph.nodes:
        for t in _tensors(n.meta.get("val")) if n.op == "placeholder" else ():
            return t.device
    return torch.device("cpu")


class OpTimes:
    """Seconds per fx op (``times(n)``) and the bytes its kernel allocates inside itself beyond
    its outputs (``times.scratch(n)``).

    ``measure=True``: the op run on `device` on real tensors of its shapes, dtypes and strides
    (floats drawn at random, integers and booleans zero; outside the fake mode, without
    autograd), the median of three runs after a warm-up, each distinct op and arguments once per
    process; a random-state wrapper (``run_with_rng_state``) is timed as the op it runs.  One
    op's inputs and outputs at a time, never more than the step holds while that op runs.  Its
    scratch: the peak of what the allocator held during one more run, above what it held before,
    less the op's new outputs (on the CPU the profiler's allocation events, `AllocationLog`: a
    convolution's unfolded input, a batch norm backward's temporaries, dropout's float mask; on
    CUDA ``max_memory_allocated``, outputs rounded to the allocator's blocks).  Otherwise, and for
    an op that cannot run alone, `FlopsModel`: its FLOP count and the bytes it reads and writes
    at the device's measured rates, and the scratch known by rule (`_scratch`).

    `limit_bytes` (the step's budget, where known): the ops are timed while the step's first call
    runs (a region is compiled at its first run, the regions before it holding what they hold),
    and an op's made-up inputs are copies, beside the real ones; on CUDA an op whose inputs,
    outputs and scratch would take the device over the limit is not run, and its model stands in
    (not cached: the op is timed when it fits), so the first call stays within the budget.  On a
    CPU there is no cheap figure of the live bytes, and every op is run.

    `codegen` (the backend is inductor): an op inductor writes its own kernel for
    (`inductor_generates`) has no scratch; what an ATen kernel allocates inside itself (a
    decomposed max pool's eager implementation: 28 MiB on a ResNet-18 batch) is not in the
    generated loop.  Convolutions, matrix products and inductor's fallbacks still run ATen's.
    `channels_last` (inductor runs the graph's 2-d convolutions channels-last, `layout_copies`):
    a convolution and its backward are run on channels-last made-up tensors, as they will run
    (their scratch differs: a weight gradient converted inside the backward's kernel).
    `fused` (with `codegen`): an op inductor writes its own kernel for is priced as part of a
    fused kernel (`fused_traffic`): the bytes it reads of tensors that an ATen kernel made or the
    graph was given, and the bytes it writes where an ATen kernel or the graph's output reads its
    result, at the device's elementwise rate, plus one operation per output element at its FLOP
    rate; a recomputed pointwise op inside the backward's kernel then costs about what
    inductor's code spends on it, not what the eager op does.  What saving such an op's value
    costs (its store, its loads in the backward) depends on the tags: `joint_graph` marks it on
    the op's node (`remat.core.compiled.boundary_time`)."""

    _cache: dict = {}

    def __init__(self, device: torch.device, measure: bool = True, flops_model: FlopsModel | None = None,
                 limit_bytes: int | None = None, codegen: bool = False, channels_last: bool = False,
                 fused: bool = False):
        self.device, self.measure = torch.device(device), measure
        self.fm = flops_model or FlopsModel.measured(self.device)
        self.limit_bytes = limit_bytes
        self.codegen, self.channels_last, self.fused = codegen, channels_last, fused and codegen

    @staticmethod
    def live_bytes(device: torch.device) -> int | None:
        """Bytes allocated on `device` now (CUDA's allocator), None where unknown (a CPU)."""
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else None

    def fits(self, n: fx.Node) -> bool:
        """Running `n` on made-up tensors keeps the device within `limit_bytes` (class docstring)."""
        live = self.live_bytes(self.device) if self.limit_bytes is not None else None
        if live is None:
            return True
        need = sum(_nbytes(t) for a in n.all_input_nodes for t in _tensors(a.meta.get("val")))
        return live + need + sum(_nbytes(t) for t in _tensors(n.meta.get("val"))) + _scratch(n) <= self.limit_bytes

    def modelled(self, n: fx.Node) -> float:
        read = sum(t.numel() * t.element_size() for a in n.all_input_nodes for t in _tensors(a.meta.get("val")))
        wrote = sum(_nbytes(t) for t in _tensors(n.meta.get("val")))
        return self.fm.time(_flops(n), read + wrote + _scratch(n))

    def __call__(self, n: fx.Node) -> float:
        if self.fused and n.op == "call_function" and not is_alias(n) and inductor_generates(n):
            elems = sum(t.numel() for t in _tensors(n.meta.get("val")))
            return self.fm.time(elems, fused_traffic(n))
        return self._measured(n)[0]

    def scratch(self, n: fx.Node) -> int:
        """Bytes `n`'s kernel allocates beyond its outputs while it runs (class docstring)."""
        if self.codegen and inductor_generates(n):
            return 0
        # (measured or modelled on the op alone, not through its random-state wrapper)
        return self._measured(n)[1] + rng_state_bytes(n)

    def _measured(self, n: fx.Node) -> tuple[float, int]:
        if n.op != "call_function" or is_alias(n):
            return 0.0, 0
        op, args = _inner_op(n)
        if not self.measure or op is None:
            return self.modelled(n), _scratch(n)
        val = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
        args, kwargs = fx.node.map_aggregate(args, val), fx.node.map_aggregate(n.kwargs, val)
        cl = self.channels_last and str(op).startswith(CONVOLUTIONS)
        key = (str(op), str(self.device), _signature(args), _signature(kwargs), cl)
        if key not in self._cache:
            if not self.fits(n):
                return self.modelled(n), _scratch(n)
            try:
                self._cache[key] = self._run(op, args, kwargs, cl)
            except Exception:  # noqa: BLE001  (an op that cannot run on made-up values: its model)
                self._cache[key] = (self.modelled(n), _scratch(n))
        return self._cache[key]

    def _run(self, op: Any, args: Any, kwargs: Any, channels_last: bool = False) -> tuple[float, int]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from .profile import Timer
        with unset_fake_temporarily(), torch.no_grad():
            real = lambda a: _real(a, self.device, channels_last) if isinstance(a, torch.Tensor) else a  # noqa: E731
            args, kwargs = fx.node.map_aggregate(args, real), fx.node.map_aggregate(kwargs, real)
            timer, out = Timer(self.device), []
            op(*args, **kwargs)
            for _ in range(3):
                t0 = timer.mark()
                op(*args, **kwargs)
                out.append(timer.seconds(t0, timer.mark()))
            scratch = _kernel_scratch(op, args, kwargs, self.device)
        return sorted(out)[1], scratch


# ops inductor lowers to a call of ATen's (or a library's) kernel, not to generated code
CONVOLUTIONS = ("aten.convolution.", "aten.convolution_backward.")
EXTERN = CONVOLUTIONS + ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._int_mm.")


def aten_op(n: fx.Node) -> str | None:
    """The name of the ATen op fx node `n` runs (``convolution_backward``), through a
    random-state wrapper too (``native_dropout`` of ``run_with_rng_state(state,
    aten.native_dropout, ...)``); None for a node that runs none."""
    op = _inner_op(n)[0]
    return op._opname if op is not None else None


def inductor_generates(n: fx.Node) -> bool:
    """Inductor compiles fx op `n` into a kernel of its own: the op has a lowering that is not a
    fallback to ATen and not a call of an external kernel (`EXTERN`).  A random op run through a
    random-state wrapper (``run_with_rng_state``) is the wrapper's: a fallback; one whose lowering
    falls back under ``torch._inductor.config.fallback_random`` (``native_dropout``) is ATen's
    there."""
    from torch._decomp.decompositions_for_rng import extra_random_decomps
    from torch._inductor import config
    from torch._inductor.lowering import fallbacks, lowerings
    if not isinstance(n.target, torch._ops.OpOverload) and n.target in fallbacks:
        return False
    op = _inner_op(n)[0] or n.target
    if config.fallback_random and op in extra_random_decomps:
        return False
    return op in lowerings and op not in fallbacks and not str(op).startswith(EXTERN)


def _source(n: fx.Node) -> fx.Node:
    """The node that made the storage `n` reads: through views and other aliases (not through a
    multi-output op's ``getitem``, whose op made it)."""
    while is_alias(n) and n.all_input_nodes and n.target is not operator.getitem:
        n = n.all_input_nodes[0]
    return n.all_input_nodes[0] if n.target is operator.getitem and n.all_input_nodes else n


def _kernel_made(n: fx.Node) -> bool:
    """`n`'s result is a buffer in memory for inductor's code: a graph input, or the result of an
    op inductor calls an ATen (or library) kernel for."""
    return n.op != "call_function" or not inductor_generates(n)


def _read_outside(n: fx.Node) -> bool:
    """Some reader of `n` (through aliases) is not inductor's generated code: an ATen kernel, or
    the graph's output (a saved or returned value)."""
    stack, seen = list(n.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op != "call_function":
            return True
        if is_alias(u):
            stack.extend(u.users)
        elif not inductor_generates(u):
            return True
    return False


def fused_traffic(n: fx.Node) -> int:
    """Bytes generated op `n` moves inside one of inductor's fused kernels (`OpTimes`, `fused`):
    its inputs that are buffers already (`_kernel_made`), each once, and its outputs where a
    reader outside generated code needs them in memory (`_read_outside`)."""
    read = sum(_nbytes(t) for a in {_source(a) for a in n.all_input_nodes} if _kernel_made(a)
               for t in _tensors(a.meta.get("val")))
    wrote = sum(_nbytes(t) for t in _tensors(n.meta.get("val"))) if _read_outside(n) else 0
    return read + wrote


# ops whose lowering writes into a copy of their first argument (inductor: ``clone`` then a
# scatter into it), which it makes in that argument's buffer where nothing else reads it
# (checked in its generated code: the zeros a max pool's and an embedding's backward scatter into)
WRITES_INTO_FIRST = ("aten.index_put.", "aten._unsafe_index_put.", "aten._unsafe_masked_index_put_accumulate.",
                     "aten.scatter.", "aten.scatter_add.", "aten.scatter_reduce.", "aten.index_add.")
# ops ATen does not tag pointwise that inductor lowers to a pointwise kernel over their result:
# a slice's or a select's scatter is ``where(inside the slice, src, x)`` (its lowerings of
# ``slice_scatter`` and ``select_scatter``), so the zeros it scatters into are a fill inlined into
# that kernel and the result a new buffer, made while what the kernel reads is alive (the logits'
# gradient of a shifted cross entropy: checked in inductor's generated code)
LOWERED_POINTWISE = ("aten.slice_scatter.", "aten.select_scatter.")


def lowered_pointwise(op: Any) -> bool:
    """Inductor lowers `op` (an ATen overload) to a pointwise kernel: tagged pointwise, or one of
    `LOWERED_POINTWISE`."""
    return torch.Tag.pointwise in getattr(op, "tags", ()) or str(op).startswith(LOWERED_POINTWISE)


def inplace_source(n: fx.Node, backward: set, made_here: set) -> fx.Node | None:
    """The argument whose buffer inductor writes backward op `n`'s result into, or None.
    Modelled only where it holds for every partition of the graph and in inductor's generated
    code: `n` is a backward op (in `backward`: it reads a tangent) whose lowering writes into a
    copy of its first argument (`WRITES_INTO_FIRST`: a scatter into zeros, as an embedding's
    backward), that argument an op of the backward graph (in `backward`, or a forward op in
    `made_here`: one the backward graph always computes itself), not an alias, read by `n` alone,
    with `n`'s shape, strides and dtype.  Its buffer is then `n`'s: `n` allocates nothing and the
    buffer lives to `n`'s last reader.  (Not modelled: a pointwise kernel written into a dying
    argument's buffer, which inductor does only where its fusions and its ``mm + add`` to
    ``addmm`` rewrite leave that buffer standing.)"""
    if n.op != "call_function" or n not in backward or not inductor_generates(n):
        return None
    out = n.meta.get("val")
    if not isinstance(out, torch.Tensor) or not str(_inner_op(n)[0] or n.target).startswith(WRITES_INTO_FIRST):
        return None
    a = n.args[0] if n.args else None
    if not isinstance(a, fx.Node) or a.op != "call_function" or is_alias(a) or len(a.users) != 1:
        return None
    if a not in backward and a not in made_here:
        return None
    t = a.meta.get("val")
    if (isinstance(t, torch.Tensor) and t.dtype == out.dtype and tuple(t.shape) == tuple(out.shape)
            and t.stride() == out.stride() and _nbytes(t) == t.numel() * t.element_size()):
        return a
    return None


# inductor's store-or-inline thresholds (``torch._inductor.config``; CPU, GPU)
REALIZE_READS = 4                    # realize_reads_threshold: a value read by several kernels
REALIZE_OPS = {"cpu": 50, "gpu": 30}  # realize_cpu_opcount_threshold, the default opcount threshold
REALIZE_ACC_READS = {"cpu": 12, "gpu": 8}   # realize_cpu_acc_reads_threshold, the default
HEAVY = ("exp", "exp2", "expm1", "log", "log10", "log1p", "log2", "sigmoid", "tanh")   # (realized on reuse on a CPU)
REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "var_mean",
              "std", "any", "all", "logsumexp", "norm", "linalg_vector_norm")


def inductor_inlines(gm: fx.GraphModule, stored: Any = ()) -> dict:
    """The pointwise ops of `gm` whose results inductor never stores (it computes them again
    inside every kernel that reads them), each with the ops whose stored results that
    computation reads.  Inductor's lowering keeps an op's value unstored (``StorageBox`` not
    realized) until something forces it: a reader that is an ATen or library kernel
    (`inductor_generates` false for it), a non-pointwise reader other than a reduction
    (`REDUCTIONS`; a scatter, a concatenation...), the graph's output, several readers with more
    than `REALIZE_READS` stored inputs or a heavy op (`HEAVY`, on a CPU) or a large body
    (`REALIZE_OPS` ops), or more than `REALIZE_ACC_READS` stored inputs at all.  Random ops,
    fills read outside a pointwise kernel and every non-pointwise op are stored.  Memory: an
    unstored op allocates nothing, and what it reads lives to the last kernel that computes it
    (a residual gradient's sum read by two kernels keeps its three inputs, not one sum).  The
    body's size is counted in fx ops (one each, and one per stored input), inductor's in its loop
    body's operations: a bound, not its exact count.  `stored`: ops known to be stored (a sum
    that inductor's ``addmm`` rewrite makes an ATen kernel's output)."""
    device = "cpu" if region_device(gm).type == "cpu" else "gpu"
    expr: dict = {}   # unstored op -> (the stored ops it reads, body ops, heavy)

    def source(a: fx.Node) -> tuple:
        return expr.get(a, (frozenset({a}), 1, False))

    def name(n: fx.Node) -> str:
        return getattr(n.target, "__name__", "").split(".")[0]

    def forced(n: fx.Node) -> bool:   # (a reader that needs `n` stored)
        for u in n.users:
            if u.op != "call_function":
                return True
            if is_alias(u):
                if forced(u):
                    return True
                continue
            if not inductor_generates(u) or (not lowered_pointwise(u.target) and name(u) not in REDUCTIONS):
                return True
        return False

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_alias(n):
            base = n.all_input_nodes[0] if n.all_input_nodes else None
            if base in expr and n.target is not operator.getitem:
                expr[n] = expr[base]
            continue
        op = _inner_op(n)[0] or n.target
        nm = name(n)
        pointwise = lowered_pointwise(op) or not n.all_input_nodes
        if n in stored or not pointwise or not inductor_generates(n) or any(r in str(op) for r in ("rand", "bernoulli", "dropout", "rng")):
            continue
        reads, ops, heavy = set(), 1, nm in HEAVY
        for a in n.all_input_nodes:
            r, o, h = source(a)
            reads |= r
            ops += o
            heavy |= h
        users = len(n.users)
        if (forced(n) or len(reads) > REALIZE_ACC_READS[device] or ops > REALIZE_OPS[device]
                or (users > 1 and (len(reads) > REALIZE_READS or (heavy and device == "cpu")))):
            continue
        expr[n] = (frozenset(reads), ops, heavy)
    return {n: e[0] for n, e in expr.items()}


def folds_into_addmm(n: fx.Node) -> fx.Node | None:
    """The ``add`` that inductor's post-grad pass folds matrix product `n` into (``add(mm(a, b),
    c)`` becomes ``addmm(c, a, b)``, run where the ``add`` is: the product's result is never a
    buffer of its own and its inputs are read there), or None: `n` is an ``aten.mm`` read by one
    ``aten.add.Tensor`` alone (alpha 1), whose other argument is a tensor of the product's dtype
    that broadcasts to its shape; on a GPU not where every reader of the sum is pointwise (there
    inductor keeps the sum apart, to fuse it with them)."""
    from torch._prims_common import is_expandable_to
    if n.op != "call_function" or n.target is not torch.ops.aten.mm.default or len(n.users) != 1:
        return None
    [u] = n.users
    if u.target is not torch.ops.aten.add.Tensor or u.kwargs.get("alpha", 1) != 1 or len(u.args) != 2:
        return None
    others = [a for a in u.args if a is not n]
    if len(others) != 1 or not isinstance(others[0], fx.Node):
        return None
    c, out = others[0].meta.get("val"), n.meta.get("val")
    if not isinstance(c, torch.Tensor) or not isinstance(out, torch.Tensor) or c.dtype != out.dtype:
        return None
    if any(a.meta.get("val") is None or a.meta["val"].dtype != out.dtype for a in n.args[:2] if isinstance(a, fx.Node)):
        return None
    if not is_expandable_to(tuple(c.shape), tuple(out.shape)):
        return None
    if out.device.type == "cuda" and all(w.op == "call_function" and lowered_pointwise(w.target)
                                         for w in u.users):
        return None
    return u


def _kernel_scratch(op: Any, args: Any, kwargs: Any, device: torch.device) -> int:
    """Peak bytes the allocator held while `op` ran once, above what it held before, less its new
    outputs' storages (`OpTimes`)."""
    from .measuring import AllocationLog, block_bytes
    ins = {storage_key(t) for t in _tensors(list(args) + list(kwargs.values()))}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = op(*args, **kwargs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        with AllocationLog() as log:
            result = op(*args, **kwargs)
        peak = log.peaks()[None]
    made, seen = 0, set(ins)
    for t in _tensors(result):
        if storage_key(t) not in seen:
            seen.add(storage_key(t))
            made += block_bytes(_nbytes(t), device)
    return max(0, int(peak) - made)


def _signature(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{tuple(x.stride())}{x.dtype}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_signature(a) for a in x) + ")"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_signature(v)}" for k, v in sorted(x.items())) + "}"
    return repr(x)


def _real(t: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """A real tensor of `t`'s shape, strides and dtype on `device` (floats random, others zero);
    with `channels_last`, a 4-d one in that memory order."""
    if channels_last and t.dim() == 4:
        out = torch.empty(tuple(t.shape), dtype=t.dtype, device=device, memory_format=torch.channels_last)
    else:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out.normal_() if t.dtype.is_floating_point else out.zero_()


@dataclass
class JointGraph:
    """A region's remat graph and, per graph node, the fx nodes it stands for."""
    graph: Graph
    members: list = field(default_factory=list)

    @property
    def made_here(self) -> set[str]:
        """The fx ops the partitioner's backward graph always computes itself: those of the
        forward nodes the region's results do not need (``extra["unclaimed"]``)."""
        return {n.name for v, ms in zip(self.graph.nodes, self.members) if v.extra.get("unclaimed") for n in ms}


def layout_copies(gm: fx.GraphModule, channels_last: bool | None = None) -> dict[int, int]:
    """The inputs of graph `gm` that inductor's layout optimization copies to channels-last
    memory order when it compiles `gm`: storage key -> bytes.

    Inductor decides per graph (``GraphLowering.decide_layout_opt``; on a CPU with oneDNN, every
    graph with a 2-d convolution) to run its 2-d convolutions channels-last, and then requires
    each convolution's input and weight in that order: a graph input (a parameter, the batch)
    that is not channels-last already is copied, once, at the graph's start, and where the
    partitioner saves that input for the backward, inductor hands the backward the copy.  The
    copies are as large as the inputs: a convolutional network's weights once more, and its
    batch (the zoo ResNet-18 at 128 px: 4.2 MiB over a 16.6 MiB replay).  A 1x1 weight is in
    both orders at once: no copy.  `channels_last`: inductor's decision for `gm`
    (`inductor_channels_last`), where the caller has it already."""
    if not (inductor_channels_last(gm) if channels_last is None else channels_last):
        return {}
    copies: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.convolution.default:
            continue
        for a in n.args[:2]:
            t = a.meta.get("val") if isinstance(a, fx.Node) and a.op == "placeholder" else None
            if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last):
                copies[storage_key(t)] = _nbytes(t)
    return copies


def inductor_channels_last(gm: fx.GraphModule) -> bool:
    """Inductor's own decision (``GraphLowering.decide_layout_opt``) to run graph `gm`'s 2-d
    convolutions channels-last (`layout_copies`)."""
    if not any(n.target is torch.ops.aten.convolution.default for n in gm.graph.nodes):
        return False
    from torch._inductor.graph import GraphLowering
    return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))


def joint_graph(gm: fx.GraphModule, num_fwd_outputs: int, name: str = "region",
                times: OpTimes | None = None, copies: dict | None = None, buffers: bool = False,
                keep_outputs: bool = True) -> JointGraph:
    """The remat graph of AOTAutograd joint graph `gm` (module docstring, step 1); node times
    from `times` (default: measured on the region's device).  `copies` (storage key -> bytes:
    the backend's copies of the graph's inputs, `layout_copies`): each is a forward node of its
    own at the forward's start (``extra["always_saved"]``: no tag changes it), read by every op
    that reads its input, so it lives to its last use, in the forward or, saved, in the
    backward, as the backend's copy does.  With `buffers` (inductor's buffer rewrites): a
    backward op that writes into an argument's buffer (`inplace_source`) allocates nothing (a
    returned one: its gradient's bytes are that buffer) and the argument's node lives to its last
    reader; a matrix product inductor folds into the sum that reads it (`folds_into_addmm`) is a
    member of the sum's node.  With `keep_outputs` (the default) the region's forward results
    stay to the step's end, as a caller that holds them through ``backward()`` keeps them
    (``out = model(x); loss_fn(out, y).backward()``); without, they live to the loss node (the
    backward's start) or their last reader in the backward: the caller drops them once its loss
    is computed (``loss_fn(model(x), y).backward()``).  Either way they are never recomputed."""
    times = times or OpTimes(region_device(gm))
    fx_nodes = list(gm.graph.nodes)
    STATIC, LOSS = -1, -2
    group: dict = {}
    groups: list[dict] = []   # {"members", "kind", "bytes", "ws", "flops", "lead", "index"}
    fixed, tangent_bytes, root_bytes, seen = 0, 0, 0, set()
    tangent_dep: set = set()
    folded: dict = {}   # a sum -> the matrix product it absorbs (`folds_into_addmm`)
    sums: set = set()   # (the sums that absorbed one)
    last_back = None   # the latest backward group (a forward op after it "follows" it)

    def new_group(n: fx.Node, back: bool) -> int:
        val = n.meta.get("val")
        tensors = _tensors(val)
        multi = isinstance(val, (list, tuple))
        groups.append({"members": [n], "kind": "backward" if back else "forward",
                       "bytes": 0 if multi else sum(_nbytes(t) for t in tensors), "ws": 0,
                       "flops": _flops(n), "lead": None, "multi": multi, "parts": {},
                       "alloc": sum(_nbytes(t) for t in tensors), "scratch": times.scratch(n),
                       "follows": None if back else last_back})
        group[n] = len(groups) - 1
        return len(groups) - 1

    for n in fx_nodes:
        if n.op in ("placeholder", "get_attr"):
            tensors = _tensors(n.meta.get("val"))
            if n.op == "placeholder" and n.name.startswith("tangents"):
                group[n] = LOSS
                tangent_dep.add(n)
                tangent_bytes += sum(_nbytes(t) for t in tensors)
                # (a scalar's gradient, a loss's: ``backward()`` holds it to the backward's end)
                root_bytes += sum(_nbytes(t) for t in tensors if t.numel() == 1)
            else:
                group[n] = STATIC
                for t in tensors:
                    if storage_key(t) not in seen:   # (each storage once: tied parameters share one)
                        seen.add(storage_key(t))
                        fixed += _nbytes(t)
                copied = [storage_key(t) for t in tensors if storage_key(t) in (copies or {})]
                if copied:   # (the backend's copy of this input: a node of its own)
                    group[n] = len(groups)
                    groups.append({"members": [], "kind": "forward", "bytes": copies[copied[0]], "ws": 0, "flops": 0,
                                   "lead": None, "multi": False, "parts": {}, "alloc": copies[copied[0]],
                                   "scratch": 0, "follows": None, "copy_of": n.name})
            continue
        if n.op != "call_function":
            continue
        ins = n.all_input_nodes
        back = any(i in tangent_dep for i in ins)
        if back:
            tangent_dep.add(n)
        if is_alias(n) and ins:
            src = group[ins[0]]
            if src >= 0 and "copy_of" in groups[src]:   # (a view of a copied input reads the input)
                group[n] = STATIC
                continue
            if n.target is operator.getitem and src >= 0 and groups[src]["multi"]:
                k = n.args[1]
                lead = groups[src]
                part = lead["parts"].get(k)
                if part is None:
                    t = _tensors(n.meta.get("val"))
                    part = len(groups)
                    groups.append({"members": [n], "kind": lead["kind"], "bytes": sum(_nbytes(x) for x in t),
                                   "ws": 0, "flops": 0, "lead": src, "multi": False, "parts": {}})
                    lead["parts"][k] = part
                else:
                    groups[part]["members"].append(n)
                group[n] = part
                continue
            group[n] = src
            if src >= 0:
                groups[src]["members"].append(n)
            continue
        into = folds_into_addmm(n) if buffers else None
        if into is not None:
            folded[into] = n   # (made by its sum's node, if of the same kind: below)
            continue
        m = folded.pop(n, None)
        if m is not None and (m in tangent_dep) != back:   # (a forward product, a backward sum: apart)
            new_group(m, False)
            m = None
        g = new_group(n, back)
        if m is not None:   # (the matrix product the sum absorbs: `folds_into_addmm`)
            sums.add(n)
            groups[g]["members"].append(m)
            groups[g]["flops"] += _flops(m)
            group[m] = g
        if back:
            last_back = g
    # outputs of the region: to the step's end
    out_node = next(n for n in fx_nodes if n.op == "output")
    flat = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    returned = set()
    for x in flat:
        if isinstance(x, fx.Node) and group.get(x, STATIC) >= 0:
            returned.add(group[x])
    # a multi-output op: parts whose outputs others read; the first becomes the leader's bytes
    for g, d in enumerate(groups):
        if not d["multi"]:
            continue
        parts = sorted(d["parts"].items())
        total = d.pop("alloc")
        if parts:
            _, p0 = parts[0]
            d["bytes"] = groups[p0]["bytes"]
            d["members"].extend(groups[p0]["members"])
            for n in groups[p0]["members"]:
                group[n] = g
            groups[p0]["dead"] = True
            if p0 in returned:
                returned.discard(p0)
                returned.add(g)
            used = sum(groups[p]["bytes"] for _, p in parts)
            d["ws"] = max(0, total - used) + used - d["bytes"]
        else:
            d["ws"] = total
    for d in groups:
        d.pop("alloc", None)
        d["ws"] += d.pop("scratch", 0)
    live = [g for g, d in enumerate(groups) if not d.get("dead")]
    # ids: forward (fx order, parts after their leader), the loss, backward
    order, placed = [], set()
    for kind in ("forward", "backward"):
        if kind == "backward":
            order.append(LOSS)
        for g in live:
            if groups[g]["kind"] == kind and groups[g]["lead"] is None and g not in placed:
                order.append(g)
                placed.add(g)
                order.extend(p for _, p in sorted(groups[g]["parts"].items()) if not groups[p].get("dead"))
                placed.update(groups[g]["parts"].values())
    new_id = {g: i for i, g in enumerate(order)}
    edges = set()
    for g in live:
        for n in groups[g]["members"]:
            for i in n.all_input_nodes:
                src = group.get(i, STATIC)
                if src == STATIC or src == g:
                    continue
                edges.add((new_id[src], new_id[g]))
    fwd_out = {group[x] for x in flat[:num_fwd_outputs] if isinstance(x, fx.Node) and group.get(x, STATIC) >= 0}
    for g in fwd_out:
        edges.add((new_id[g], new_id[LOSS]))
    dropped = set() if keep_outputs else fwd_out   # (results the caller lets go at the loss node)
    # the forward nodes the region's results need (the partitioner's forward); the others are
    # backward-only (`remat.core.compiled.backward_only`)
    preds: dict = {}
    for a, b in edges:
        preds.setdefault(b, set()).add(a)
    claimed, stack = set(), [new_id[g] for g in fwd_out]
    while stack:
        v = stack.pop()
        if v not in claimed:
            claimed.add(v)
            stack.extend(preds.get(v, ()))
    # inductor's in-place kernels: node -> the node whose buffer it writes into (through chains)
    owner: dict[int, int] = {}
    if buffers:
        made_here = {n for i, g in enumerate(order) if g != LOSS and groups[g]["kind"] == "forward"
                     and groups[g]["lead"] is None and i not in claimed for n in groups[g]["members"]}
        for i, g in enumerate(order):
            d = groups[g] if g != LOSS else None
            if d is None or d["lead"] is not None or d["multi"] or "copy_of" in d or not d["members"]:
                continue
            a = inplace_source(d["members"][0], tangent_dep, made_here)
            src = groups[group[a]] if a is not None and group.get(a, STATIC) >= 0 else None
            if src is None or src["members"][0] is not a or src["multi"] or src["lead"] is not None:
                continue
            owner[i] = owner.get(new_id[group[a]], new_id[group[a]])
    # inductor's backward ops that it never stores (`inductor_inlines`; the forward's are stored
    # here, as a saved value is): node -> the nodes whose stored values its readers read instead
    inlined: dict[int, set[int]] = {}
    inline_forward: set[int] = set()
    def heads(n: fx.Node) -> bool:   # (`n` is its node's one op, not part of a multi-output op)
        g = group.get(n, STATIC)
        return g >= 0 and groups[g]["members"][0] is n and not groups[g]["multi"] and groups[g]["lead"] is None
    if times.codegen:
        forward_ops = {n for n in fx_nodes if n.op == "call_function" and n not in tangent_dep}
        for n, srcs in inductor_inlines(gm, forward_ops | sums).items():
            if n in tangent_dep and heads(n):
                inlined[new_id[group[n]]] = {new_id[group[r]] for r in srcs if group.get(r, STATIC) != STATIC}
        # (a forward op inductor would not store where it is not saved: `compiled_schedule`)
        inline_forward = {new_id[group[n]] for n in inductor_inlines(gm, sums) if n not in tangent_dep and heads(n)}
    nodes, members = [], []
    for i, g in enumerate(order):
        if g == LOSS:
            nodes.append(Node(i, "loss", "loss", 0.0, int(tangent_bytes - root_bytes), 0, {"tangents": True},
                              persistent_bytes=int(root_bytes)))
            members.append([])
            continue
        d = groups[g]
        if "copy_of" in d:
            nodes.append(Node(i, f"{d['copy_of']}_copy", "forward", times.fm.time(0, 2 * d["bytes"]), int(d["bytes"]), 0,
                              {"ops": [], "op": "layout_copy", "copy_of": d["copy_of"], "always_saved": True}))
            members.append([])
            continue
        head = d["members"][0]
        extra: dict = {"ops": [n.name for n in d["members"]], "op": str(getattr(head.target, "__name__", head.target))}
        out = _tensors(head.meta.get("val"))
        if times.codegen and len(out) == 1:   # (what an in-place kernel of inductor's matches: `writes_into`)
            extra["layout"] = [list(out[0].shape), list(out[0].stride()), str(out[0].dtype)]
            if i not in inlined and head not in sums and may_write_in_place(head):
                extra["in_place"] = True
        lead = d["lead"]
        if lead is not None:
            b = int(d["bytes"])
            if g in returned:   # (its leader holds its bytes to the step's end: a part has no persistent bytes)
                extra["returned"] = True
                if g in dropped:
                    extra["dropped"] = True
                else:
                    b = 0
            nodes.append(Node(i, head.name, d["kind"], 0.0, b, 0, extra, part_of=new_id[lead]))
            members.append(d["members"])
            continue
        b, own, made = int(d["bytes"]), 0, int(d["bytes"])
        if g in returned:
            extra["returned"] = True
            if g in dropped:
                extra["dropped"] = True
            else:   # (a gradient, or a result its caller holds)
                b, own = 0, int(d["bytes"])
        if i in owner:   # (written into its owner's buffer: nothing of its own)
            extra["inplace_of"] = owner[i]
            b, made = 0, 0
        if i in inlined:   # (computed inside its readers' kernels: no buffer)
            extra["inlined"] = True
            b, made = 0, 0
        if i in inline_forward:
            extra["inlined"] = True
        # a returned part (a gradient of a convolution's or batch norm's backward): made while the
        # op runs (its bytes are in the op's workspace already) and kept to the step's end
        # (a dead part, the first, merged into its leader: its place in `returned` went to the leader)
        parts_kept = sum(groups[p]["bytes"] for p in d["parts"].values() if p in returned)
        persistent = own + int(parts_kept)
        if d["kind"] == "forward" and i not in claimed:
            extra["unclaimed"] = True
        if any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in d["members"]):
            extra["random"] = True
        if d["kind"] == "forward" and d.get("follows") is not None:   # (among the backward ops)
            extra["follows"] = new_id[d["follows"]]
        extra["flops"] = d["flops"]
        ops = [n for n in d["members"] if n.op == "call_function" and not is_alias(n)]
        if (times.fused and d["kind"] == "forward" and not d["multi"] and ops and all(map(inductor_generates, ops))
                and not extra.get("random")):
            # (what saving it costs where inductor's kernels would otherwise not store it: the
            # store in the forward, unless a kernel outside generated code reads it there anyway,
            # and a load in each generated kernel that reads it in the backward: `boundary_time`;
            # not for a random op, whose draw -- inductor's seeds -- is made once and saved)
            mine = set(d["members"])
            extra["loads"] = sorted({new_id[group[u]] for n in d["members"] for u in n.users
                                     if u not in mine and group.get(u, STATIC) >= 0 and u.op == "call_function"
                                     and not is_alias(u) and inductor_generates(u)})
            extra["load_s"] = times.fm.time(0, int(d["bytes"]))
            extra["store_s"] = 0.0 if _read_outside(head) else extra["load_s"]
        t = sum(times(n) for n in d["members"])
        # (a returned tensor is made while the op runs: its bytes are in the op's workspace too)
        nodes.append(Node(i, head.name, d["kind"], float(t), b, int(d["ws"]) + (own if made else 0), extra,
                          persistent_bytes=persistent))
        members.append(d["members"])
    for v, o in owner.items():   # (the owner's buffer lives to the last reader of what is written into it)
        edges.update((o, w) for a, w in list(edges) if a == v)
    readers: dict = {}
    for a, w in edges:
        readers.setdefault(a, set()).add(w)
    for v, srcs in inlined.items():   # (what an unstored op reads lives to its readers)
        edges.update((r, w) for w in readers.get(v, ()) for r in srcs if r != w)
    graph = Graph(nodes, sorted(edges), fixed, {"granularity": "compiled", "name": name, "backward_edges": "saved",
                                                "capture": "torch.compile (AOTAutograd joint graph)"})
    return JointGraph(graph, members)


@dataclass
class Program:
    """What the partitioned forward and backward graphs hold when run op by op (`program`)."""
    peak_bytes: int       # fixed bytes included
    time: float           # seconds, the ops' `FlopsModel` times
    fixed_bytes: int      # the primals (parameters, buffers, inputs)
    saved_bytes: int      # what the forward hands the backward
    forward_peak_bytes: int
    backward_peak_bytes: int
    recomputed_ops: int   # ops of the backward graph that the forward graph runs too


def may_write_in_place(n: fx.Node) -> bool:
    """`n` is a kernel inductor's scheduler may write into an input's buffer
    (``decide_inplace_update``): a pointwise op it generates code for, not an alias, not random."""
    tags = getattr(n.target, "tags", ())
    return (n.op == "call_function" and not is_alias(n) and inductor_generates(n) and lowered_pointwise(n.target)
            and torch.Tag.nondeterministic_seeded not in tags)


def writes_into(nodes: list, keys: dict, reads: Any, last: dict, pinned: set, skip: set) -> tuple[dict, dict]:
    """Inductor's in-place kernels over a graph's ops `nodes` (in order; `keys`: node -> its
    storage keys, `reads(a)`: the stored storages a reader of `a` reads, `last`: storage -> the
    index of its last reader): a stored pointwise result that inductor generates a kernel for
    (`inductor_generates`; not in `skip`, the unstored and folded ops) is written into a storage
    its kernel reads whose last reader it is, of its shape, strides and dtype, not in `pinned`
    (the graph's inputs that stay, its outputs; nor is a result in `pinned` written into another's)
    -- the first such in its arguments' order, as its
    scheduler's ``decide_inplace_update`` does (a batch norm's backward into the saved ReLU
    output it reads last).  Returns (storage -> the storage it is written into; storage written
    into -> the index of its new last reader)."""
    layout: dict = {}
    for n in nodes:
        if n.op == "placeholder" or (n.op == "call_function" and not is_alias(n)):
            for t in _tensors(n.meta.get("val")):
                layout.setdefault(storage_key(t), (tuple(t.shape), tuple(t.stride()), t.dtype, _nbytes(t)))
    into: dict = {}
    until: dict = {}
    for i, n in enumerate(nodes):
        if n in skip or len(keys[n]) != 1 or not may_write_in_place(n):
            continue
        k = keys[n][0]
        if k in pinned:   # (a returned or saved result: left in a buffer of its own)
            continue
        for a in n.all_input_nodes:
            s = next((s for s in reads(a) if s in layout and layout[s] == layout.get(k) and s not in pinned
                      and until.get(into.get(s, s), last.get(s)) == i), None)
            if s is not None:
                into[k] = into.get(s, s)
                until[into[k]] = last.get(k, i)
                break
    return into, until


def _replay(gm: fx.GraphModule, live: dict, fixed: set, times: OpTimes, buffers: bool = False,
            made_here: set | None = None) -> tuple[int, float, dict]:
    """Run `gm`'s ops over the storages `live` (key -> bytes; storages in `fixed` are not
    counted): each op allocates its outputs' new storages (and its scratch while it runs), each
    storage is freed after the last op reading a tensor on it (the boxed calling convention: the
    graph's inputs too), the outputs' storages stay.  With `buffers` (inductor's buffer
    rewrites): a matrix product folded into the sum that reads it (`folds_into_addmm`, both
    reading a tangent or neither) makes no storage and reads its inputs where the sum runs; in a
    backward graph, `made_here` (the names of the forward ops it always computes itself) given,
    an op that writes into an argument's buffer (`inplace_source`) takes that storage.  Returns
    (the peak of the live bytes, the ops' time, what is live at the end)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    keys: dict = {}
    for n in nodes:
        keys[n] = [storage_key(t) for t in _tensors(n.meta.get("val"))]
    backward: set = set()   # (the ops that read a tangent: only the buffer rewrites ask)
    for n in nodes if buffers else ():
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    fold: dict = {}   # a folded matrix product -> the sum it is made by
    if buffers:
        for n in nodes:
            u = folds_into_addmm(n)
            if u is not None and (n in backward) == (u in backward):
                fold[n] = u
    # (inductor's code stores no result of these: what they read lives to their readers)
    inl = inductor_inlines(gm, set(fold.values())) if times.codegen else {}
    same: dict = {}   # storage key -> the storage it is written into
    if buffers and made_here is not None:
        here = {n for n in nodes if n.name in made_here}
        for n in nodes:
            a = inplace_source(n, backward, here)
            if a is not None:
                same[keys[n][0]] = same.get(keys[a][0], keys[a][0])
        for n in nodes:
            keys[n] = [same.get(k, k) for k in keys[n]]
    def reads(a: fx.Node) -> list:
        return [k for r in inl[a] for k in keys.get(r, ())] if a in inl else keys.get(a, ())
    last: dict = {}
    for i, n in enumerate(nodes):
        at = index[fold[n]] if n in fold else i
        for k in keys[n] if n not in inl else ():
            last[k] = max(last.get(k, at), at)
        for a in n.all_input_nodes:
            for k in reads(a):
                last[k] = max(last.get(k, at), at)
    out = next(n for n in nodes if n.op == "output")
    kept = {k for a in out.all_input_nodes for k in keys.get(a, ())}
    # (inductor's in-place kernels, `writes_into`: storage key -> the storage it is written into)
    into, until = (writes_into(nodes, keys, reads, last, set(kept) | set(fixed), set(inl) | set(fold) | set(fold.values()))
                   if times.codegen else ({}, {}))
    live, peak, total = dict(live), sum(live.values()), 0.0
    free_at: dict = {}
    for k, i in last.items():
        if k not in kept and k not in fixed and k not in into:
            free_at.setdefault(until.get(k, i), []).append(k)
    for i, n in enumerate(nodes):
        if n in fold or n in inl:   # (made where its sum runs, into the sum's storage; or
            total += times(n)       # computed inside its readers' kernels)
        elif n.op == "call_function" and not is_alias(n):
            new = {}
            for t in _out_tensors(n):
                k = same.get(storage_key(t), storage_key(t))
                k = into.get(k, k)
                if k not in live and k not in fixed:
                    new[k] = _nbytes(t)
            live.update(new)
            peak = max(peak, sum(live.values()) + times.scratch(n))
            total += times(n)
        for k in free_at.get(i, ()):
            live.pop(k, None)
    return peak, total, live


def program(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
            times: OpTimes | None = None, copies: dict | None = None, buffers: bool = False,
            made_here: set | None = None, keep_outputs: bool = True) -> Program:
    """The peak and time of the partitioner's forward and backward graphs, replayed op by op
    (`_replay`): the primals are fixed bytes; the region's results stay through the backward
    (the caller holds them; with `keep_outputs` false it drops them at the backward's start, where
    the tangents arrive: `joint_graph`'s loss node),
    the saved values from the forward to their last use in the backward;
    the tangents from the backward's start; the gradients to the step's end.  Exact for the
    aot_eager backends, which run these graphs' ops as they are; for inductor, whose kernels and
    buffers are its own (module docstring), `copies` (`layout_copies` of `fw`) are the forward's
    inputs it copies at its start: each copy lives to its last use in the forward or, saved in
    its input's place, to its last use in the backward; `buffers` (with `made_here`, the names of
    the forward ops the backward always computes: `JointGraph.made_here`) follows its buffer
    rewrites (`_replay`)."""
    times = times or OpTimes(region_device(fw))
    copies = copies or {}
    fixed: dict = {}   # the forward's inputs: parameters, buffers, the batch
    for n in fw.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            for t in _tensors(n.meta.get("val")):
                fixed.setdefault(storage_key(t), _nbytes(t))
    fixed_bytes = sum(fixed.values())
    as_is = set(fixed) - set(copies)   # (the inputs the graphs read as they are)
    f_peak, f_time, _ = _replay(fw, dict(copies), as_is, times, buffers)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    results = out.args[0][:num_fwd_outputs]
    result_bytes = {storage_key(t): _nbytes(t) for a in results if isinstance(a, fx.Node)
                    for t in _tensors(a.meta.get("val")) if storage_key(t) not in fixed}
    held = dict(result_bytes) if keep_outputs else {}
    start: dict = {}
    tangents = 0
    for n in bw.graph.nodes:
        if n.op == "placeholder":
            for t in _tensors(n.meta.get("val")):
                k = storage_key(t)
                if n.name.startswith("tangents") and t.numel() == 1 and k not in fixed:
                    held[k] = _nbytes(t)   # (a scalar's gradient: ``backward()`` holds it to its end)
                    continue
                if k in copies or (k not in fixed and k not in held and k not in start):
                    start[k] = _nbytes(t)
                    tangents += _nbytes(t) if n.name.startswith("tangents") else 0
    # what the forward hands the backward: the backward's inputs but the tangents (a recomputed
    # random op's generator state among them: 5,056 bytes on a CPU)
    saved = sum(start.values()) - tangents
    b_peak, b_time, _ = _replay(bw, start, as_is | set(held), times, buffers, made_here)
    b_peak += sum(held.values())
    if not keep_outputs:   # (the loss's instant: the results the caller drops, with the tangents)
        b_peak = max(b_peak, sum(start.values()) + sum(held.values())
                     + sum(b for k, b in result_bytes.items() if k not in start))
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    again = sum(1 for n in bw.graph.nodes if n.op == "call_function" and n.name in fw_ops and not is_alias(n))
    return Program(max(f_peak, b_peak) + fixed_bytes, f_time + b_time, fixed_bytes, saved,
                   f_peak + fixed_bytes, b_peak + fixed_bytes, again)


def knapsack_sets(gm: fx.GraphModule, joint_inputs: Any, jg: JointGraph, budgets: tuple,
                  **kwargs: Any) -> list[set[int]]:
    """What PyTorch's own partitioner recomputes at each ``activation_memory_budget`` in
    `budgets`: for each, the nodes of `jg` (forward) whose fx ops the backward graph of
    ``min_cut_rematerialization_partition`` runs again (the partitioner copies a node under its
    name); at 1 the knapsack is off and the set is its default min cut's.  `gm` is the joint
    graph `jg` was made of, untagged (its graph is put back after each cut); `kwargs` are the
    partitioner's (``num_fwd_outputs``...).  A budget whose cut fails is
    left out.  These are starts for `remat.core.compiled.fit`: the knapsack recomputes cheap
    pointwise ops whose kernels inductor fuses into the backward's, a set the planner's own
    search may not reach."""
    import torch._functorch.config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    # (a node of `jg` is recomputed where the backward runs its ops again, its views aside: the
    # backward re-takes a view of a saved value -- a matrix product's reshape -- under the view's
    # name, which does not recompute the product the node is made of)
    ops = [(v.id, [n.name for n in members if not is_alias(n)] or [n.name for n in members])
           for v, members in zip(jg.graph.nodes, jg.members) if v.kind == "forward"]
    graph, sets = gm.graph, []
    for b in budgets:
        try:
            with functorch_config.patch(activation_memory_budget=b):
                _, bw = min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)
        except Exception as e:  # noqa: BLE001  (a start the search does without)
            log.info("remat.compiler: the partitioner's knapsack at %g failed (%s: %s)", b, type(e).__name__, e)
            continue
        finally:
            gm.graph = graph
        again = {n.name for n in bw.graph.nodes if n.op == "call_function"}
        sets.append({v for v, names in ops if names and all(k in again for k in names)})
    return sets


def tag(jg: JointGraph, recompute: set[int]) -> None:
    """Every forward fx op of `jg`: MUST_RECOMPUTE when its node is in `recompute` (or is
    backward-only: `remat.core.compiled.normal`), else MUST_SAVE."""
    from torch.utils.checkpoint import CheckpointPolicy
    recompute = normal(jg.graph, recompute)
    for v, members in zip(jg.graph.nodes, jg.members):
        if v.kind != "forward":
            continue
        policy = CheckpointPolicy.MUST_RECOMPUTE if v.id in recompute else CheckpointPolicy.MUST_SAVE
        for n in members:
            n.meta["recompute"] = policy


__all__ = ["joint_graph", "JointGraph", "layout_copies", "inductor_channels_last", "inductor_generates", "tag",
           "knapsack_sets", "program", "Program", "OpTimes", "is_alias", "BACKENDS"]
