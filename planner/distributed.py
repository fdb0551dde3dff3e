"""Running a partition plan on torch.distributed: each op of the step as the plan splits it.

`PartitionedStep(capture, plan, mesh)` replays the captured step (`frontends.partitioning.
capture_step`) on every rank of a process group whose ranks form the plan's ``(2, ..., 2)``
device mesh, with PyTorch's DTensor as the engine:

* every tensor of the step is a `DTensor` with the plan's placements (`Shard(d)` / `Replicate()`
  per mesh dimension); parameters and the batch are distributed from each rank's full copy
  (`distribute_tensor`: every rank holds the same values);
* an op with strategy s (one per mesh dimension) has each input redistributed to what s reads
  (`DTensor.redistribute`: all-gather, reduce-scatter, all-reduce, all-to-all), runs on the local
  shards as the unsharded ATen op (`to_local`, with the gradient placements the search assumed:
  partial sums where the op read an input whole under a split; an input read as summands, a bias
  under a summed split, is the input on the devices at coordinate 0 and zeros elsewhere), and its
  output is wrapped as s made it (`DTensor.from_local`, `Partial` for partial sums; a mean's parts
  halved per split) and redistributed to the output's own placement;
* a parameter gathered for an op is not kept for its backward: saved-tensor hooks keep the
  parameter's shard and gather it again when the backward reads it (FSDP's mechanism), as the
  cost model counts;
* an op the plan recomputes (``search["recompute"]["ops"]``: the compiled class's program of the
  per-device graph, `remat.core.compiled`; only ops that `tofu.runs_locally`) is not kept for the
  backward: saved-tensor hooks keep a note of which op made what the backward reads, and the
  backward's first read of it runs the op again on the parts its inputs were (kept from the
  forward, or recomputed in turn), as ``torch.utils.checkpoint`` rebuilds what it dropped; the
  rebuilt value goes after its last read, the inputs kept for it after its rebuild;
* the backward is autograd through those functions: DTensor's own backward of each
  redistribution and of `from_local`/`to_local` makes the gradients' communication; each
  parameter's gradient is redistributed to its parameter's placement as soon as it is complete
  (a post-accumulate-grad hook: a partial gradient all-reduced or reduce-scattered, as FSDP and
  DDP do), as the cost model counts.

`CommCounter` counts the bytes each rank sends in the collectives it runs (ring algorithms over a
mesh dimension of 2: an all-gather sends its input, a reduce-scatter half its input, an
all-reduce its input, an all-to-all half its input), the measure the plan's ``comm_bytes``
predicts (summed over ranks, `tofu.mesh_comm`); on a CPU it also holds the step after each wait
until gloo's worker has let go of the collective's output (`released`), so what the step frees is
freed there and not when that thread next gets the interpreter's lock.

A training batch norm split along its batch (or space) runs with its statistics synchronised
(`synced_batch_norm`, SyncBatchNorm's arithmetic: the per-channel sums all-reduced along the mesh
dimensions that split it, twice in the forward and once in the backward), so every device
normalises by the whole batch's statistics and updates the running ones as one process does.

Ops whose shape arguments describe the whole tensor (``view``, ``reshape``, ``expand``) get
their local shape; in-place ops run out of place (`out_of_place`).  A random op split across the devices (dropout, attention with dropout:
`tofu.draws`) draws what one process draws: each device draws the whole tensor of random
numbers from the same generator state as one process's op would, keeps its part and frees the
rest (a transient the per-device graph counts), so with every rank seeded alike the step's loss
and gradients are one process's (ATen's CPU kernels; CUDA's fused attention kernels draw their
own way, and a CUDA step with attention dropout differs from one process's).
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from remat.core.errors import InvalidInputError
from remat.solvers import tofu
from remat.solvers.partition import REPLICATE, Placement, strategies
from remat.solvers.partition import Shard as PShard

from .partitioning import PartitionPlan

RESHAPING = {"view", "reshape", "_unsafe_view", "expand"}
MEANS = {"mean"}
LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_forward"}
log = logging.getLogger("remat.distributed")


def parse_placement(text: str) -> Placement:
    """``"Shard(1)"`` / ``"Replicate"`` (a plan file's placements) as a `Placement`."""
    if text == "Replicate":
        return REPLICATE
    if text.startswith("Shard(") and text.endswith(")"):
        return PShard(int(text[6:-1]))
    raise InvalidInputError(f"partition plan: unknown placement {text!r}; expected Shard(d) or Replicate")


def _dt(p: Placement):
    if p.kind == "shard":
        return Shard(p.dim)
    if p.kind == "partial":
        return Partial()
    return Replicate()


def _strategy(rule, letter: str):
    if letter == "replicated":
        return tofu.REPLICATED
    for s in strategies(rule):
        if s.index == letter:
            return s
    raise InvalidInputError(f"partition plan: strategy {letter!r} is not a split of {rule.spec!r}")


def _averages(op) -> bool:
    """Whether `op`'s partial results are means (each device's over its part: halved per split,
    they sum to the mean)."""
    if op.op in MEANS:
        return True
    if op.op in LOSSES:
        reduction = op.args[3] if len(op.args) > 3 and op.args[3] is not None else 1
        return reduction == 1
    return False


RELEASE_WAIT_S = 0.02    # the longest a waited collective's output is waited for (`released`)


def owners(t: torch.Tensor) -> tuple[int, int]:
    """(references to `t`, references to its storage): a storage is also held by views of it."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def released(t: torch.Tensor, callers: tuple[int, int], limit_s: float = RELEASE_WAIT_S) -> bool:
    """Yield this thread until no more than `callers` (`owners`' two counts) hold `t`, a
    functional collective's output whose ``wait_tensor`` has returned; True once so, False after
    `limit_s`.

    gloo marks a collective's work complete before its worker thread drops the work, which holds
    the output and views of it: ``wait_tensor`` returns, and for a moment (tens to hundreds of
    microseconds, longer on a loaded machine) the output's storage lives on whatever its caller
    does.  Where the caller lets go of a buffer first (the staging copy of a gather along a
    dimension other than the first, once its chunks are concatenated), the worker's drop is the
    last one and frees it only when that thread gets the interpreter's lock, at this thread's next
    blocking call (the next collective): one full-size tensor more than the plan holds over the
    ops between, in some runs and not others (a 4-linear MLP 17.8 % over its prediction in about
    a third of its runs).  Waiting here (``sleep(0)`` lets the lock go) frees each such buffer
    where the plan does."""
    deadline = None
    while any(n > most for n, most in zip(owners(t), callers)):
        now = time.perf_counter()
        deadline = deadline or now + limit_s
        if now > deadline:
            return False
        time.sleep(0)
    return True


class CommCounter(TorchDispatchMode):
    """Bytes this rank sends in the functional collectives run under it (module docstring).  On
    a CPU (gloo) each waited collective's output is let go by gloo's worker before the step goes
    on (`released`): its owners then are the caller's, as many as a tensor no work holds has when
    waited the same way (counted once as the counter is entered: `callers`).  A wait that gives
    up (`released` false: the output still held after `RELEASE_WAIT_S`) is counted in
    `lingering` and said once, as a warning: that rank may then measure above its prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls: dict = {}
        self.callers: tuple[int, int] | None = None
        self.lingering = 0

    def __enter__(self) -> "CommCounter":
        super().__enter__()
        if self.callers is None:    # a wait on a tensor of no collective: the references of the call itself
            probe = torch.empty(0)
            torch.ops._c10d_functional.wait_tensor(probe)
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
        if func.namespace == "_c10d_functional" and args and isinstance(args[0], torch.Tensor):
            n = args[0].numel() * args[0].element_size()
            sent = {"all_gather_into_tensor": n, "reduce_scatter_tensor": n // 2, "all_reduce": n,
                    "all_to_all_single": n // 2}.get(name)
            if sent is not None:
                self.bytes += sent
                self.calls[name] = self.calls.get(name, 0) + 1
            if name == "wait_tensor" and args[0].device.type == "cpu":
                out = func(*args, **(kwargs or {}))
                if self.callers is None:
                    self.callers = owners(args[0])
                elif not released(args[0], self.callers):
                    self.lingering += 1
                    if self.lingering == 1:
                        log.warning("remat.distributed: a collective's output (%d bytes) was still held %g s after its "
                                    "wait (gloo's worker thread did not let go of it): this rank's measured peak may "
                                    "be above its prediction", n, RELEASE_WAIT_S)
                return out
        return func(*args, **(kwargs or {}))


def _all_reduce(t: torch.Tensor, mesh: Any, dims: list) -> torch.Tensor:
    """The sum of `t` over the devices along mesh dimensions `dims` (functional collectives,
    which `CommCounter` sees)."""
    from torch.distributed import _functional_collectives as funcol
    for d in dims:
        t = funcol.wait_tensor(funcol.all_reduce(t, "sum", (mesh, d)))
    return t


def _whole_count(x: torch.Tensor, dims: list) -> int:
    """Values per channel of the whole batch whose part `x` is (split in halves along `dims`)."""
    return x.numel() // x.shape[1] * 2 ** len(dims)


class _SyncedBatchNorm(torch.autograd.Function):
    """Training batch norm of a part of the batch with the statistics of the whole (the sums
    all-reduced along `dims`): returns (output, mean, biased variance); its backward all-reduces
    the sums of the output's gradient and of its product with the normalised input, and gives the
    weight's and bias's gradients as this device's summands."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, mesh, dims):
        over = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = _whole_count(x, dims)
        mean = _all_reduce(x.sum(over), mesh, dims) / count
        out = x - mean.view(shape)                   # (one temporary beside it: the squares)
        var = _all_reduce(out.square().sum(over), mesh, dims) / count
        invstd = torch.rsqrt(var + eps)
        out.mul_(invstd.view(shape))
        if weight is not None:
            out.mul_(weight.view(shape))
        if bias is not None:
            out.add_(bias.view(shape))
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.mesh, ctx.dims, ctx.count, ctx.has_bias = mesh, dims, count, bias is not None
        return out, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, mean, invstd = ctx.saved_tensors
        over = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)).mul_(invstd.view(shape))   # (one temporary beside dx)
        sum_dy, sum_dy_xhat = dy.sum(over), (dy * xhat).sum(over)
        dx = None
        if ctx.needs_input_grad[0]:
            both = _all_reduce(torch.stack([sum_dy, sum_dy_xhat]), ctx.mesh, ctx.dims) / ctx.count
            scale = invstd if weight is None else invstd * weight
            dx = dy - xhat.mul_(both[1].view(shape))
            dx.sub_(both[0].view(shape)).mul_(scale.view(shape))
        dw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def _bind(target: Any, args: tuple, kwargs: dict) -> dict:
    """{argument name: value} of an ATen op's call (its schema's defaults where not given)."""
    schema = target._schema.arguments
    bound = list(args) + [kwargs.get(a.name, a.default_value if a.has_default_value() else None)
                          for a in schema[len(args):]]
    return dict(zip((a.name for a in schema), bound))


def synced_batch_norm(target: Any, args: tuple, kwargs: dict, mesh: Any, dims: list) -> Any:
    """ATen's training batch norm `target` (``batch_norm``, ``native_batch_norm``,
    ``_native_batch_norm_legit[_functional]``) on this device's part of the batch, with the whole
    batch's statistics (`_SyncedBatchNorm`): the op's own outputs, the running statistics updated
    in place (returned, for the functional form) with the whole batch's mean and unbiased variance."""
    values = _bind(target, args, kwargs)
    x, weight, bias = values["input"], values.get("weight"), values.get("bias")
    rm, rv = values.get("running_mean"), values.get("running_var")
    momentum, eps = values["momentum"], values["eps"]
    out, mean, var = _SyncedBatchNorm.apply(x, weight, bias, eps, mesh, dims)
    n = _whole_count(x, dims)
    name = target._overloadpacket.__name__
    new = []
    if rm is not None:
        with torch.no_grad():
            new = [rm * (1 - momentum) + mean * momentum, rv * (1 - momentum) + var * (n / max(n - 1, 1)) * momentum]
            if name != "_native_batch_norm_legit_functional":
                rm.copy_(new[0])
                rv.copy_(new[1])
    if name == "batch_norm":
        return out
    stats = (mean.detach(), torch.rsqrt(var.detach() + eps))
    return (out, *stats, *new) if name == "_native_batch_norm_legit_functional" else (out, *stats)


def out_of_place(target: Any) -> Any:
    """The out-of-place overload of an in-place ATen op (``relu_`` -> ``relu``, ``add_.Tensor``
    -> ``add.Tensor``); `target` itself for every other op.  The step is replayed on tensors
    that DTensor's ``to_local`` returns as views made inside its autograd functions, which
    autograd does not let an op modify; each op's output is its own tensor in the graph, so the
    out-of-place op computes the same values."""
    schema = getattr(target, "_schema", None)
    first = schema.arguments[0] if schema is not None and schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write or schema.name.endswith("_out"):
        return target
    packet = getattr(torch.ops.aten, target._overloadpacket.__name__.rstrip("_"), None)
    return getattr(packet, target._overloadname, target) if packet is not None else target


def _part(full: torch.Tensor, placements: tuple, mesh: Any) -> torch.Tensor:
    """This device's part (a copy) of `full`, a tensor the same on every device, placed
    `placements` (DTensor placements, one per mesh dimension)."""
    coord = mesh.get_coordinate()
    for p, c in zip(placements, coord):
        if isinstance(p, Shard):
            full = full.chunk(2, dim=p.dim)[c]
    return full.clone()


def dropout_factors(shape: tuple, p: float, like: torch.Tensor) -> torch.Tensor:
    """What ATen's training dropout multiplies a tensor of `shape` (dtype and device of `like`)
    by: 0 or 1 / (1 - p), drawn from the generator as dropout draws them (on the CPU a Bernoulli
    draw of the whole tensor, divided in place; elsewhere the fused kernel's mask, scaled)."""
    if like.device.type == "cpu":
        return torch.empty(shape, dtype=like.dtype).bernoulli_(1 - p).div_(1 - p)
    out, keep = torch.ops.aten.native_dropout(torch.ones(shape, dtype=like.dtype, device=like.device), p, True)
    return out


def attention_with_noise(q, k, v, mask, is_causal: bool, scale, noise: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention as ATen's math path computes it (q and k each scaled by the
    square root of the scale, a causal or given mask, softmax), its probabilities multiplied by
    `noise` (dropout's kept-and-rescaled factors, drawn elsewhere)."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    root = math.sqrt(scale)
    attn = (q * root) @ (k.transpose(-2, -1) * root)
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(keep.logical_not(), float("-inf"))
    if mask is not None:
        attn = attn.masked_fill(mask.logical_not(), float("-inf")) if mask.dtype == torch.bool else attn + mask
    return (torch.softmax(attn, -1) * noise) @ v


class _Note:
    """What a saved-tensor hook keeps in place of a part an op the plan recomputes made: the op,
    which output, and the saved tensor's view of it."""
    __slots__ = ("op", "out", "size", "stride", "offset")

    def __init__(self, op: int, out: int, t: torch.Tensor):
        self.op, self.out = op, out
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class Rebuilder:
    """The recomputation of a `PartitionedStep` (module docstring).  In the forward, the storages
    of the parts the ops of the plan's R made are known (`made`); a tensor autograd saves that
    lies in one is kept as a `_Note`, and so are an R op's inputs that lie in one (the others it
    holds).  In the backward, a note read (`unpack`) runs its op again (`PartitionedStep.run_again`)
    on its inputs, notes among them rebuilt first; the value stays while notes of it are unread
    (each is read once), and the op's inputs go once it has run."""

    def __init__(self, step: "PartitionedStep"):
        self.step = step
        self.reset()

    def reset(self) -> None:
        self.owner: dict = {}      # storage address -> (op, output index), while the storage lives
        self.inputs: dict = {}     # op of R -> {tensor id: its part, or a note}, until it runs again
        self.values: dict = {}     # op of R -> its outputs computed again, while notes of it are unread
        self.unread: dict = {}     # op of R -> notes of it not yet read
        self.fresh: "list | None" = None   # while an op of R runs, what the hooks saved: [holder]

    def note(self, t: torch.Tensor) -> "_Note | None":
        made = self.owner.get(t.untyped_storage().data_ptr())
        if made is None:
            return None
        self.unread[made[0]] = self.unread.get(made[0], 0) + 1
        return _Note(made[0], made[1], t)

    def begin(self) -> None:
        """An op of R is about to run: what it saves is held in holders until `made` sees its outputs."""
        self.fresh = []

    def pack(self, t: torch.Tensor) -> Any:
        n = self.note(t)
        if n is not None or self.fresh is None:
            return n if n is not None else t
        holder = [t]
        self.fresh.append(holder)
        return holder

    def made(self, op: Any, outs: list, local: dict) -> None:
        """Op `op` of R ran in the forward: its outputs' storages are noted, what it saved of them
        becomes notes, its inputs are kept (as notes where another op of R made them)."""
        for j, value in enumerate(outs):
            key = value.untyped_storage().data_ptr()
            self.owner[key] = (op.id, j)
            weakref.finalize(value.untyped_storage(), self.owner.pop, key, None)   # (addresses are reused)
        for holder in self.fresh:
            holder[0] = self.note(holder[0]) or holder[0]
        self.fresh = None
        self.inputs[op.id] = {t: self.note(x) or x.detach() for t, x in local.items()}

    def forward_done(self) -> None:
        """The forward has run: an op of R no note of which was saved is never run again, so the
        inputs kept for it go (the latest first: the notes among them are then never read)."""
        for v in sorted(self.inputs, reverse=True):
            if self.unread.get(v, 0) <= 0:
                for x in self.inputs.pop(v).values():
                    if isinstance(x, _Note):
                        self.unread[x.op] -= 1

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, list):
            saved = saved[0]
        return self.read(saved) if isinstance(saved, _Note) else saved

    def read(self, n: _Note) -> torch.Tensor:
        if n.op not in self.values:
            if n.op not in self.inputs:
                raise NotImplementedError("a second backward through a partitioned step whose devices recompute "
                                          "(retain_graph=True) is not supported: its inputs went after the first")
            local = {t: self.read(x) if isinstance(x, _Note) else x for t, x in self.inputs.pop(n.op).items()}
            self.values[n.op] = self.step.run_again(n.op, local)
        value = self.values[n.op][n.out]
        self.unread[n.op] -= 1
        if self.unread[n.op] <= 0:
            self.values.pop(n.op)
        return value.as_strided(n.size, n.stride, n.offset)


class PartitionedStep:
    """One step of a captured model run as `plan` splits it, on this rank (module docstring)."""

    def __init__(self, capture: Any, plan: PartitionPlan, mesh: Any):
        g = capture.graph
        plan.check_runnable()
        if plan.devices != mesh.size():
            raise InvalidInputError(f"the partition plan is for {plan.devices} devices; this process group has "
                                    f"{mesh.size()}: launch {plan.devices} processes")
        if len(plan.ops) != len(g.ops) or len(plan.tensors) != len(g.tensors):
            raise InvalidInputError("the partition plan was made for another graph (its ops or tensors differ from "
                                    "this model's capture): partition the model again")
        self.capture, self.plan, self.mesh, self.graph = capture, plan, mesh, g
        rules = tofu.describe(g)
        self.strategies = [[_strategy(r, letter) for letter in o["strategy"]] for r, o in zip(rules, plan.ops)]
        self.placement = {t: tuple(parse_placement(p) for p in plan.tensors[t]["placements"]) for t in g.tensors}
        self.recompute = set(plan.search.get("recompute", {}).get("ops", ()))
        for v in sorted(self.recompute):
            if not (0 <= v < len(g.ops) and tofu.runs_locally(g.ops[v], tuple(self.strategies[v]), self.placement)):
                raise InvalidInputError(f"the partition plan recomputes op {v}, which does not run on its devices' own "
                                        "parts (recomputing it would communicate): partition the model again")
        self._rebuild = Rebuilder(self)

    def distribute(self, values: dict) -> dict:
        """{tensor id: DTensor} for the parameters and the batch from `values` (tensor id -> the
        full tensor, the same on every rank); parameters that train are leaves requiring grad."""
        out = {}
        read = tofu.last_reader(self.graph)
        for t, v in values.items():
            if t not in read:      # (a tied parameter's other name: nothing reads it, it is not placed)
                continue
            d = distribute_tensor(v.detach(), self.mesh, [_dt(p) for p in self.placement[t]])
            info = self.graph.tensors[t]
            if info.kind == "parameter" and info.grad:
                d.requires_grad_(True)
            out[t] = d
        return out

    def _input(self, t: int, want: tuple, grads: tuple, local: dict, gathered: dict) -> None:
        """Input `t` as the op reads it (`want`), its gradient placed `grads`, into `local`."""
        g = self.graph
        x = self.env[t]
        grads = grads if g.tensors[t].grad else None
        if any(isinstance(w, Partial) for w in want):
            # an input given as summands (a bias under a summed split): the devices at
            # coordinate 0 of those mesh dimensions hold it, the others zeros
            whole = tuple(Replicate() if isinstance(w, Partial) else w for w in want)
            x = x.redistribute(self.mesh, whole) if tuple(x.placements) != whole else x
            coord = self.mesh.get_coordinate()
            keep = all(c == 0 for c, w in zip(coord, want) if isinstance(w, Partial))
            value = x.to_local(grad_placements=grads)
            local[t] = value if keep else value * 0
            return
        if tuple(x.placements) == want:
            local[t] = x.to_local(grad_placements=grads)
            return
        local[t] = x.redistribute(self.mesh, want).to_local(grad_placements=grads)
        if g.tensors[t].kind == "parameter":       # gathered again for the backward, not kept
            storage = local[t].untyped_storage()
            key = storage.data_ptr()
            gathered[key] = (self.env[t], want)
            weakref.finalize(storage, gathered.pop, key, None)   # (addresses are reused)

    def _drawn(self, op: Any, target: Any, args: tuple, kwargs: dict, strats: list) -> Any:
        """A random op (`tofu.draws`) split across the devices, drawing what one process draws:
        every device draws the whole tensor of random numbers from the same generator state, as
        one process's op would (`dropout_factors` at the global shape), and uses its own part."""
        g = self.graph
        made = tuple(_dt(tofu.placed(s, "out", 0)) for s in strats)
        values = _bind(target, args, kwargs)
        if op.op == "dropout":
            x = values["input"]
            return x * _part(dropout_factors(g.tensors[op.outputs[0]].shape, values["p"], x), made, self.mesh)
        if op.op == "native_dropout":
            x, p = values["input"], values["p"]
            keep = _part(dropout_factors(g.tensors[op.outputs[0]].shape, p, x) != 0, made, self.mesh)
            return x * keep * (1.0 / (1.0 - p)), keep
        if values.get("enable_gqa"):
            raise NotImplementedError("partition: attention with dropout and grouped query heads (enable_gqa) "
                                      "split across devices")
        q, k = values["query"], values["key"]
        q_shape, k_shape = g.tensors[op.inputs[0]].shape, g.tensors[op.inputs[1]].shape
        rank = len(q_shape)
        noise = dropout_factors(tuple(q_shape[:-1]) + (k_shape[-2],), values["dropout_p"], q)
        # the output's split dimensions are the probabilities' but for the last (the values' width)
        along = tuple(Replicate() if isinstance(m, Shard) and m.dim == rank - 1 else m for m in made)
        return attention_with_noise(q, k, values["value"], values.get("attn_mask"), bool(values["is_causal"]),
                                    values.get("scale"), _part(noise, along, self.mesh))

    def arguments(self, op: Any, node: Any, strats: list, local: dict) -> tuple[tuple, dict]:
        """The fx node's arguments with `local` (tensor id -> the part the op reads) in place of
        its input nodes; a reshaping op's shape made its local one."""
        by_node = {self.capture.tensor_nodes[t]: v for t, v in local.items()}
        args = tree_map(lambda a: by_node.get(a, a) if isinstance(a, torch.fx.Node) else a, node.args)
        kwargs = tree_map(lambda a: by_node.get(a, a) if isinstance(a, torch.fx.Node) else a, node.kwargs)
        if op.op in RESHAPING and len(args) > 1:
            shape = list(self.graph.tensors[op.outputs[0]].shape)
            for s in strats:
                made = tofu.placed(s, "out", 0)
                if made.kind == "shard":
                    shape[made.dim] //= 2
            args = (args[0], shape) + tuple(args[2:])
        return args, kwargs

    def output(self, out: Any, t: int) -> torch.Tensor:
        """Output tensor `t` of an op that returned `out`."""
        return out[self.capture.tensor_nodes[t].args[1]] if isinstance(out, (list, tuple)) else out

    def run_again(self, v: int, local: dict) -> list:
        """Op v's outputs computed again from `local` (its inputs' parts), without autograd."""
        op, node = self.graph.ops[v], self.capture.op_nodes[v]
        args, kwargs = self.arguments(op, node, self.strategies[v], local)
        with torch.no_grad():
            out = out_of_place(node.target)(*args, **kwargs)
        return [self.output(out, t) for t in op.outputs]

    def __call__(self, leaves: dict) -> DTensor:
        """Run the forward and the loss from `leaves` (`distribute`); returns the loss as a
        replicated DTensor (``.to_local().backward()`` runs the backward)."""
        g, cap = self.graph, self.capture
        self.env = dict(leaves)
        last = tofu.last_reader(g)
        gathered: dict = {}            # storage of a gathered parameter -> (its DTensor, placements)

        rebuild = self._rebuild
        rebuild.reset()

        def pack(t: torch.Tensor):
            key = t.untyped_storage().data_ptr()
            if key in gathered:
                src, want = gathered[key]
                return ("gather", src, want, t.size(), t.stride(), t.storage_offset())
            return rebuild.pack(t)

        def unpack(saved):
            if isinstance(saved, tuple) and saved and saved[0] == "gather":
                _, src, want, size, stride, offset = saved
                full = src.detach().redistribute(self.mesh, want).to_local()
                return full.as_strided(size, stride, offset)
            return rebuild.unpack(saved)

        for op, node, strats in zip(g.ops, cap.op_nodes, self.strategies):
            local: dict = {}
            for i, t in enumerate(op.inputs):
                if t in local:
                    continue
                placed = [tofu.placed(s, "in", i) for s in strats]
                want = tuple(_dt(p) for p in placed)
                grads = tuple(_dt(tofu.grad_placement(s, p)) for s, p in zip(strats, placed))
                self._input(t, want, grads, local, gathered)
            args, kwargs = self.arguments(op, node, strats, local)
            synced = [d for d, s in enumerate(strats) if s.sync]
            recomputed = op.id in self.recompute
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                if recomputed:
                    rebuild.begin()
                if synced:
                    out = synced_batch_norm(node.target, args, kwargs, self.mesh, synced)
                elif tofu.draws(op) and any(s is not tofu.REPLICATED for s in strats):
                    out = self._drawn(op, node.target, args, kwargs, strats)
                else:
                    out = out_of_place(node.target)(*args, **kwargs)
            if recomputed:
                rebuild.made(op, [self.output(out, t) for t in op.outputs], local)
            for j, t in enumerate(op.outputs):
                value = self.output(out, t)
                made = tuple(_dt(tofu.placed(s, "out", j)) for s in strats)
                if _averages(op):      # partial means: halved per split, their sum is the mean
                    halves = sum(isinstance(m, Partial) for m in made)
                    value = value * (0.5 ** halves) if halves else value
                d = DTensor.from_local(value, self.mesh, made, run_check=False)
                target = tuple(_dt(p) for p in self.placement[t])
                self.env[t] = d.redistribute(self.mesh, target) if tuple(d.placements) != target else d
            # each value let go after its last reader, as eager autograd lets it go (what the
            # backward reads stays with autograd)
            for t in set(op.inputs) | set(op.outputs):
                if t != g.loss and last.get(t, op.id) <= op.id and t not in leaves:
                    self.env.pop(t, None)
        rebuild.forward_done()
        loss = self.env[g.loss]
        self.env = {}
        whole = tuple(Replicate() for _ in loss.placements)
        return loss.redistribute(self.mesh, whole) if tuple(loss.placements) != whole else loss


def leaf_values(capture: Any, model: torch.nn.Module, batch: tuple) -> dict:
    """{tensor id: full tensor} for the captured step's parameters, buffers, batch and constants."""
    cap = capture.captured
    params = dict(model.named_parameters(remove_duplicate=False))   # (a tied parameter by any of its names)
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    flat_batch = [b for b in batch if isinstance(b, torch.Tensor)]
    out = {}
    for t, node in capture.tensor_nodes.items():
        if node.op != "placeholder":
            continue
        kind, target = cap.kinds.get(node), cap.targets.get(node)
        if kind in ("parameter", "buffer"):
            name = str(target).removeprefix("model.")
            if name not in params:
                raise InvalidInputError(f"partition: the captured parameter {target!r} is not the model's")
            out[t] = params[name]
        elif kind == "input":
            out[t] = flat_batch[int(target)] if isinstance(target, int) else cap.values[node]
        else:
            out[t] = cap.values[node]
    return out


def train_step(model: torch.nn.Module, batch: tuple, plan: PartitionPlan, mesh: Any,
               loss_fn: Callable | None = None, capture: Any = None, meter: bool = False,
               model_inputs: int | None = None) -> dict:
    """One planned step on this rank: {"loss": float, "grads": {name: full gradient},
    "comm_bytes": bytes this rank sent, "calls": collectives by name, "peak_bytes": the storage
    accounting's peak on this rank (with `meter`)}."""
    from remat.frontends.partitioning import capture_step
    capture = capture or capture_step(model, batch, loss_fn, model_inputs)
    step = PartitionedStep(capture, plan, mesh)
    leaves = step.distribute(leaf_values(capture, model, batch))
    counter = CommCounter()
    box: dict = {}

    def reduce(param: DTensor) -> None:   # a gradient to its parameter's placement once complete
        if tuple(param.grad.placements) != tuple(param.placements):
            param.grad = param.grad.redistribute(mesh, param.placements)
    for d in leaves.values():
        if isinstance(d, DTensor) and d.requires_grad:
            d.register_post_accumulate_grad_hook(reduce)

    def run() -> None:
        with counter:
            loss = step(leaves)
            local = loss.to_local()
            local.backward()
        box["loss"] = float(local.detach())
    if meter:   # the storage accounting on the CPU; on CUDA max_memory_allocated
        from remat.frontends.measuring import measure_peak
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else None
        box["peak_bytes"] = measure_peak(run, resident=[d.to_local() for d in leaves.values()], device=device)
    else:
        run()
    aliases: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    by_name = dict(model.named_parameters(remove_duplicate=False))
    grads = {}
    for t, d in leaves.items():
        if isinstance(d, DTensor) and d.grad is not None:
            name = str(capture.captured.targets.get(capture.tensor_nodes[t])).removeprefix("model.")
            full = d.grad.full_tensor()
            for alias in aliases.get(id(by_name.get(name)), [name]):   # every name of a tied parameter
                grads[alias] = full
    return {"loss": box["loss"], "grads": grads, "comm_bytes": counter.bytes, "calls": counter.calls,
            "peak_bytes": box.get("peak_bytes")}


class DistributedStep:
    """``remat.apply(model, partition_plan, example_inputs, loss_fn)`` in each rank of an
    initialised process group of ``plan.devices`` ranks: ``loss = step(*batch)`` runs one
    training step as the plan says (a split plan: `train_step` on DTensor; a layer placement
    with micro-batches: `remat.pipelining.PipelinedStep`) and leaves the model's parameters'
    ``.grad`` set to the step's full gradients on every rank (gathered after the step, beyond the
    plan's bytes), so ``optimizer.step()`` on the model works as in one process; the loss is a
    float (the step is forward and backward together).  ``last`` holds the step's record (bytes
    sent by this rank, and for a split plan per-collective counts)."""

    def __init__(self, model: torch.nn.Module, plan: PartitionPlan, example_inputs: Any,
                 loss_fn: Callable | None = None, model_inputs: int | None = None):
        import torch.distributed as dist
        plan.check_runnable()
        if not dist.is_initialized():
            raise InvalidInputError("remat.apply: a partition plan runs in a process group; call "
                                    "torch.distributed.init_process_group first (or use remat.distributed.launch)")
        self.model, self.plan, self.loss_fn, self.count = model, plan, loss_fn, model_inputs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != plan.devices:
            raise InvalidInputError(f"the partition plan is for {plan.devices} devices; this process group has "
                                    f"{self.world}: launch {plan.devices} processes")
        batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.last: dict = {}
        from .pipelining import canonical_names
        self.names = canonical_names(model)
        if plan.search.get("pipeline"):
            from .pipelining import PipelinedStep
            self.pipe = PipelinedStep(model, batch, plan, self.rank, self.world, device, loss_fn, model_inputs)
        else:
            from remat.frontends.partitioning import capture_step
            self.pipe = None
            self.capture = capture_step(model, batch, loss_fn, model_inputs)
            self.mesh = mesh_for(self.world, device.type)

    def __call__(self, *batch: Any) -> float:
        if self.pipe is None:
            got = train_step(self.model, batch, self.plan, self.mesh, self.loss_fn, capture=self.capture,
                             model_inputs=self.count)
            grads, loss = got["grads"], got["loss"]
            self.last = {"comm_bytes": got["comm_bytes"], "calls": got["calls"]}
        else:
            sent = self.pipe.counter.bytes
            grads, loss = self.pipe.gathered(self.pipe.step(batch))
            self.last = {"comm_bytes": self.pipe.counter.bytes - sent}
        for name, p in self.model.named_parameters():
            g = grads.get(self.names.get(name, name), grads.get(name))
            p.grad = None if g is None else g.to(p.device, p.dtype)
        return float(loss)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(plan: PartitionPlan, make: Callable[[], tuple], *, steps: int = 3, lr: float = 1e-3,
           device_type: str = "cpu", reference: bool = True, timeout_s: float = 600.0) -> list:
    """Train `steps` steps of a partition plan in ``plan.devices`` processes of this machine
    (`torch.multiprocessing.spawn`; gloo on the CPU, NCCL on CUDA with one GPU a rank) and return
    one row per step and rank: {"step", "rank", "loss", "reference_loss" (one process's loss on
    the same parameters and batch, rank 0, with `reference`), "random" (the step draws random
    numbers: each rank its own, module docstring), "peak_bytes" (the storage
    accounting on the CPU, ``max_memory_allocated`` on CUDA), "comm_bytes" (sent by the rank at
    the collectives), "seconds"}.

    `make()` -> (model, example inputs, ...) builds the model in each process (a picklable
    callable: a module-level function or a `functools.partial` of one); every process seeds
    its RNG with 0 first, and `distribute_tensor` scatters rank 0's values.  Each step draws a
    random batch shaped like the example (the same on every rank), runs `train_step` and applies
    SGD at `lr` to the full gradients.  An error in any rank raises `InvalidInputError` with that
    rank's one-line message."""
    import json
    import tempfile

    import torch.multiprocessing as mp
    plan.check_runnable()
    if device_type == "cuda" and torch.cuda.device_count() < plan.devices:
        raise InvalidInputError(f"the partition plan is for {plan.devices} devices; this machine has "
                                f"{torch.cuda.device_count()} GPUs")
    with tempfile.TemporaryDirectory(prefix="remat-launch-") as tmp:
        try:
            mp.spawn(_rank_main, args=(plan.devices, _free_port(), plan.to_dict(), make, steps, lr, device_type,
                                       reference, timeout_s, tmp), nprocs=plan.devices, join=True)
        except mp.ProcessExitedException as e:
            # (gloo can abort a process as the group is torn down, after every rank's rows came back)
            if not (Path(tmp) / "rows.json").is_file():
                raise InvalidInputError(f"a process of the partitioned run exited ({e}); see its output above") from None
        except mp.ProcessRaisedException:
            errors = sorted(Path(tmp).glob("error-*.txt"))
            if errors:
                raise InvalidInputError(errors[0].read_text().strip()) from None
            raise
        return json.loads((Path(tmp) / "rows.json").read_text())


def _rank_main(rank: int, world: int, port: int, plan_dict: dict, make: Callable[[], tuple], steps: int,
               lr: float, device_type: str, reference: bool, timeout_s: float, tmp: str) -> None:
    """One process of `launch`."""
    import datetime
    import json
    import logging
    import os

    import torch.distributed as dist

    from remat.core.errors import RematError
    from remat.frontends.partitioning import capture_step
    from remat.frontends.profile import is_random
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # (DTensor warns on every two-level gather of a (2, 2) mesh, which the plan chose and costed)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        torch.manual_seed(0)
        made = make()
        model = made[0].to(device)
        example = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, made[1])
        plan = PartitionPlan.from_dict(plan_dict)
        capture = capture_step(model, example)
        random = any(is_random(n) for n in capture.op_nodes)
        if plan.search.get("pipeline"):
            from .pipelining import PipelinedStep
            pipe = PipelinedStep(model, example, plan, rank, world, device)
            run, params = pipe.measured, pipe.trained(model)
        else:
            mesh = mesh_for(world, device_type)
            run = lambda batch: train_step(model, batch, plan, mesh, capture=capture, meter=True)  # noqa: E731
            params = [(p, name) for name, p in model.named_parameters()]
        rows = _train(model, example, device, steps, lr, reference, rank, run, params)
        for r in rows:
            r["random"] = random
        every = [None] * world if rank == 0 else None
        dist.gather_object(rows, every, dst=0)
        if rank == 0:
            (Path(tmp) / "rows.json").write_text(json.dumps([r for part in every for r in part]))
        dist.barrier()  # every rank tears gloo down together: one that leaves early can abort at exit
    except RematError as e:
        (Path(tmp) / f"error-{rank}.txt").write_text(f"rank {rank}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def _train(model: torch.nn.Module, example: tuple, device: torch.device, steps: int, lr: float, reference: bool,
           rank: int, run: Callable[[tuple], dict], params: list) -> list:
    """`launch`'s steps on this rank: each on a random batch shaped like `example` (the same on
    every rank), one process's loss beside it (rank 0, with `reference`), ``run(batch)`` (the
    planned step: {"loss", "grads" (full, by the model's names), "peak_bytes", "comm_bytes", and a
    pipeline's "predicted_peak"}), then SGD at `lr` on `params` ([(parameter, its name in
    "grads")])."""
    from remat.frontends.base import default_loss, step_loss
    from remat.frontends.run import random_batch
    gen = torch.Generator().manual_seed(1)
    rows = []
    for k in range(steps):
        batch = random_batch(example, gen, device)
        ref = None
        if reference and rank == 0:
            # (from the generator state every rank's step then draws from: one process's numbers)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                ref = float(step_loss(model, default_loss, batch))
        t0 = time.perf_counter()
        got = run(batch)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            for p, name in params:
                if name in got["grads"]:
                    p -= lr * got["grads"][name].to(p.device)
        rows.append({"step": k, "rank": rank, "loss": got["loss"], "reference_loss": ref,
                     "peak_bytes": got["peak_bytes"], "comm_bytes": got["comm_bytes"], "seconds": seconds,
                     **({"predicted_peak": got["predicted_peak"]} if "predicted_peak" in got else {})})
    return rows


def mesh_for(devices: int, device_type: str = "cpu") -> Any:
    """The ``(2, ..., 2)`` device mesh of a plan over `devices` ranks (the process group must be
    initialised with that many)."""
    from torch.distributed.device_mesh import init_device_mesh
    m = tofu.levels_of(devices)
    return init_device_mesh(device_type, (2,) * m if m else (1,))
