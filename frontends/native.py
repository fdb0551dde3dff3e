r"""Native eager execution of a module-level plan: the model itself follows the plan, in the
user's own loop (``out = model(x); loss = loss_fn(out, y); loss.backward()``).

`NativeExecution` installs hooks on the model; nothing of the model's code is replayed.  The
user's modules run their own ``forward``; *keep* is plain autograd; *recompute* and *swap* act on
what autograd saved, through saved-tensor hooks (the mechanism of `torch.utils.checkpoint`'s
non-reentrant mode), at the points the schedule names:

* **Entries.**  While the model's forward runs, every tensor autograd saves is packed as a
  reference (`_Ref`) into the *entries* of the forward node it was made in: the first storage
  a node's code makes that autograd saves, or that the node returns, is entry 0 of that node, the
  next entry 1, and so on; a later node saving a view of it refers to the same entry.
  Parameters, buffers and the model's inputs are saved as they are.  So a node's entries are
  what the module graph counts as its bytes (its outputs and what autograd saved inside it), and
  the entries are the only references autograd's graph holds to them.
* **Where the plan's ops run.**  A forward node begins at the forward pre-hook of its first
  group-module call (a glue node: after the previous node ends) and ends at the forward hook of
  its last; the plan's ops after a forward node's compute (``free``, ``swap_out``) run when it
  ends.  A backward node b_v begins when autograd is about to run the first of v's output
  functions (a pre-hook on their ``grad_fn``: the engine runs a graph's functions in reverse
  creation order, so b_v begins when every later node's backward has run); the plan's ops
  before ``compute b_v`` (recomputations, ``swap_in``, ``free``) run then, those after the last
  backward node when the engine finishes (`queue_callback`).
* **free v** drops v's entries; **recompute v** calls v's modules again on the entries of its
  inputs (detached, requiring grad as in the first run) under hooks that fill v's entries anew,
  in the same order, with the first run's RNG state and autocast state and with its modules'
  buffers restored afterwards (BatchNorm's running statistics move once a step); the
  recomputation's own graph is dropped.  **swap_out v** copies v's entries to host buffers (`transfer.Transfers`: pinned, a side
  stream on CUDA), **swap_in v** copies them back.  During b_v, an entry of v's own that only v's
  backward reads goes as soon as its last saved reference is unpacked, as plain autograd frees
  a saved tensor after the function that uses it.

Which plans run this way is `remat.core.native` (the native class: no recomputation during the
forward, backward nodes in the reverse of the forward, recomputed nodes runs of module calls),
and so is what the simulator must count for them: the model's returned outputs live as long as
the loop holds them (``out``, to the step's end); a storage the model's code holds in a local
variable past the plan's ``free`` (a container's loop holds a block's input through the block)
stays until the code drops it, which the execution observes at the next event and hands to the
prediction (`NativeExecution.held`).  A plan outside the class whose only obstacle is a
recomputation the class forbids runs with that node kept resident instead (`native.nativize`),
and says so when that takes it over its budget.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from remat.core.errors import InvalidInputError
from remat.core.graph import Graph
from remat.core.plan import Plan
from remat.core.schedule import Schedule
from remat.core import native
from remat.core.simulate import simulate

from .base import default_loss, step_loss
from .measuring import storage_key
from .segments import group_modules
from .transfer import StorageSet, Transfers

log = logging.getLogger(__name__)


# ---- the plan, seen from the model ---------------------------------------------------------
@dataclass
class _NodeSpec:
    """A forward node: its group-module calls (paths, in order) and whether glue ops come
    before the first or after the last of them (a glue node has no calls)."""
    id: int
    name: str
    calls: list
    glue_first: bool
    glue_last: bool
    random: bool


def _parts(name: str, groups: dict) -> list:
    """The parts of a stage name (``a+b``, a ``#k`` suffix for repeats): a group module's path,
    or None for glue."""
    base = name.split("#", 1)[0] if "#" in name and "+" not in name.split("#", 1)[1] else name
    out = []
    for p in base.split("+"):
        p = p.split("#", 1)[0]
        out.append(p if p in groups else None)
    return out


def node_specs(model: torch.nn.Module, graph: Graph) -> list[_NodeSpec]:
    depth = graph.meta.get("depth") or 1
    groups = group_modules(model, depth if isinstance(depth, int) else 1)
    specs = []
    for v in graph.nodes:
        if v.kind != "forward":
            continue
        parts = _parts(v.name, groups)
        calls = [p for p in parts if p is not None]
        specs.append(_NodeSpec(v.id, v.name, calls, parts[0] is None, parts[-1] is None,
                               bool(v.extra.get("random"))))
    return specs


def native_obstacle(graph: Graph, schedule: Schedule, specs: list) -> str | None:
    """Why `schedule` cannot run natively on the model whose `node_specs` are `specs` (None when
    it can): `remat.core.native.obstacle`, and a forward whose nodes are no module calls at all."""
    why = native.obstacle(graph, schedule)
    if why is None and not any(sp.calls for sp in specs):
        return "no forward node is a module call"
    return why


# ---- one step --------------------------------------------------------------------------------
class _Ref:
    """A saved tensor: the `idx`-th entry of node `node`, seen through its own size, stride,
    offset and dtype."""
    __slots__ = ("node", "idx", "size", "stride", "offset", "dtype", "own")

    def __init__(self, node: int, idx: int, t: torch.Tensor, own: bool):
        self.node, self.idx, self.own = node, idx, own
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype


@dataclass
class _Call:
    """A group-module call of the step's forward: its module and its arguments (tensors as
    `_ArgRef`s: an entry's `_Ref` or the tensor itself, and whether it required grad)."""
    module: torch.nn.Module
    args: tuple
    kwargs: dict


class _Step:
    """The state of one training step under the plan."""

    def __init__(self, ex: "NativeExecution", static: list, device: torch.device):
        self.ex = ex
        self._static_tensors = static   # parameters, buffers, the step's inputs
        self._static: set | None = None
        self.device = device
        m = len(ex.specs)
        self.entries: list[list] = [[] for _ in range(m)]     # node -> [detached tensor | None]
        self.keys: list[list] = [[] for _ in range(m)]        # node -> [storage key | None]
        self.pending_unpacks: list[dict] = [{} for _ in range(m)]  # node -> {idx: own refs not yet unpacked}
        self.owner: dict[int, tuple] = {}                     # storage key -> (node, idx)
        self.calls: list[list[_Call]] = [[] for _ in range(m)]
        self.rng: dict[int, tuple] = {}
        self.autocast: dict[int, tuple] = {}   # node -> the autocast state of its first run
        self.host: dict[int, list] = {}      # node -> chunks of its host copy: (buffers, [(entry, layout)])
        self.pending: dict[int, Any] = {}
        self.current: int | None = None
        self.ended = -1
        self.call_pos = 0
        self.bwd_pos = 0
        self.in_backward: int | None = None
        self.replay: int | None = None
        self.replay_idx = 0
        self.replay_live: dict[int, torch.Tensor] = {}   # entry -> the recomputation's own tensor
        self.to_check: list = []
        self.finishing = False
        self.hooks: list = []      # the saved-tensor hooks' context while a non-plain node runs
        self.hooked_fns: set = set()   # ids of the autograd functions with a backward pre-hook
        self.foreign: dict = {}        # storage key -> weak ref: untracked nodes' outputs (saved as they are)
        self.in_forward = False
        self.callback_queued = False

    @property
    def static(self) -> set:
        """Storage keys of the parameters, buffers and the step's inputs (saved as they are)."""
        if self._static is None:
            self._static = {storage_key(t) for t in self._static_tensors}
        return self._static

    # entries
    def add_entry(self, v: int, t: torch.Tensor) -> int:
        """A new entry of v.  A glue node's outputs become entries only when a later call takes
        them as arguments: one that appears after v was swapped out joins v's host copy now
        (its value has not changed since)."""
        key = storage_key(t)
        idx = len(self.entries[v])
        self.entries[v].append(t.detach())
        self.keys[v].append(key)
        self.owner[key] = (v, idx)
        if v in self.host:
            self.swap_out(v, only=[idx])
        return idx

    def ref_of(self, t: torch.Tensor, new_for: int | None) -> Any:
        """`t` as a saved reference: static tensors as they are; a tensor of an entry as a
        `_Ref`; a new storage as a new entry of `new_for` (as it is when None)."""
        key = storage_key(t)
        if key in self.static:
            return t
        foreign = self.foreign.get(key)
        if foreign is not None and not foreign.expired():   # (a dead one's address may be reused)
            return t
        hit = self.owner.get(key)
        if hit is None:
            if new_for is None:
                return t
            hit = (new_for, self.add_entry(new_for, t))
        return _Ref(hit[0], hit[1], t, own=hit[0] == new_for)

    def resolve(self, r: Any) -> Any:
        if not isinstance(r, _Ref):
            return r
        v = r.node
        self.wait(v)
        base = self.entries[v][r.idx] if r.idx < len(self.entries[v]) else None
        if base is None:
            raise RuntimeError(f"remat.apply(native): a tensor of {self.ex.specs[v].name} is needed but the plan "
                               "freed it and did not recompute or swap it in: the plan does not match what "
                               "autograd saved; re-trace and re-plan")
        if base.dtype == r.dtype and base.size() == r.size and base.stride() == r.stride \
                and base.storage_offset() == r.offset:
            return base
        return torch.empty(0, dtype=r.dtype, device=base.device).set_(base.untyped_storage(), r.offset, r.size,
                                                                      r.stride)

    # saved-tensor hooks of the forward
    def saving(self, on: bool) -> None:
        """Saved tensors go through `pack` (on) or are saved by autograd as they are (off: a plain
        node's, `NativeExecution.plain`)."""
        if on and not self.hooks:
            ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            ctx.__enter__()
            self.hooks.append(ctx)
        elif not on and self.hooks:
            self.hooks.pop().__exit__(None, None, None)

    def pack(self, t: torch.Tensor) -> Any:
        cur = self.current
        r = self.ref_of(t, cur)
        if isinstance(r, _Ref) and r.own:
            counts = self.pending_unpacks[cur]
            counts[r.idx] = counts.get(r.idx, 0) + 1
        return r

    def unpack(self, r: Any) -> torch.Tensor:
        if not isinstance(r, _Ref):
            return r
        t = self.resolve(r)
        v = r.node
        if r.own and self.in_backward == v:
            counts = self.pending_unpacks[v]
            left = counts.get(r.idx, 0) - 1
            counts[r.idx] = left
            if left <= 0 and self._internal(v, r.idx):
                self.drop(v, r.idx)
        return t

    def _internal(self, v: int, idx: int) -> bool:
        """Entry idx of v is not one of v's outputs (only v's own backward reads it)."""
        return idx not in self.ex.output_idx.get(v, ())

    def drop(self, v: int, idx: int) -> None:
        t = self.entries[v][idx]
        if t is None:
            return
        key = self.keys[v][idx]
        if self.owner.get(key) == (v, idx):
            del self.owner[key]
        self.entries[v][idx] = None
        self.keys[v][idx] = None

    # the plan's ops
    def wait(self, v: int) -> None:
        """The compute stream waits for v's last transfer (``wait v``, or before a use of v)."""
        if v in self.pending:
            self.ex.transfers.wait(self.pending.pop(v))

    def run_ops(self, ops: list) -> None:
        for o in ops:
            if o.op == "free":
                self.free(o.node)
            elif o.op == "compute":
                self.recompute(o.node)
            elif o.op == "swap_out":
                self.swap_out(o.node)
            elif o.op == "swap_in":
                self.swap_in(o.node)
            elif o.op == "wait":
                self.wait(o.node)

    def free(self, v: int) -> None:
        """Drop v's entries (those of a node whose outputs the model returns stay to the step's
        end, as the loop's ``out`` holds them: `native_peak`)."""
        keep = self.ex.output_idx.get(v, ()) if v in self.ex.pinned and not self.finishing else ()
        checked = self.in_backward is None and not self.finishing
        for idx, t in enumerate(self.entries[v]):
            if t is not None and idx not in keep:
                if checked:
                    self.to_check.append((v, StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
                self.drop(v, idx)

    def check_frees(self, through: int) -> None:
        """Storages freed during the forward, at earlier events, that something outside the plan
        still holds (the model's code: a tensor in a local variable of a container's loop, a skip
        connection; a cache it returns): each such node is recorded as held, with those bytes,
        through forward node `through` (`NativeExecution.held`), and checked again at the next
        event."""
        still, alive = [], {}
        for v, ref, nbytes in self.to_check:
            if not ref.expired():
                still.append((v, ref, nbytes))
                alive[v] = alive.get(v, 0) + nbytes
        held = self.ex.held
        for v, nbytes in alive.items():
            j, b = held.get(v, (-1, 0))
            held[v] = (max(j, through), max(b, nbytes))
        self.to_check = still

    def recompute(self, v: int) -> None:
        spec = self.ex.specs[v]
        if not self.calls[v]:
            raise RuntimeError(f"remat.apply(native): {spec.name} is recomputed before it ran")
        snapshot = [(b, b.detach().clone()) for call in self.calls[v] for b in call.module.buffers()]
        cuda = [self.device] if self.device.type == "cuda" else []
        self.replay, self.replay_idx, self.replay_live = v, 0, {}
        try:
            with torch.random.fork_rng(devices=cuda, device_type="cuda", enabled=spec.random):
                if spec.random:
                    torch.set_rng_state(self.rng[v][0])
                    for d, state in zip(cuda, self.rng[v][1:]):
                        torch.cuda.set_rng_state(state, d)
                with torch.enable_grad(), as_autocast(self.autocast.get(v, ())), \
                        torch.autograd.graph.saved_tensors_hooks(self.replay_pack, _never):
                    for call in self.calls[v]:
                        args = tree_map(self.replay_arg, call.args)
                        kwargs = tree_map(self.replay_arg, call.kwargs)
                        out = call.module(*args, **kwargs)
                        for t in tree_flatten(out)[0]:
                            if isinstance(t, torch.Tensor):
                                self.replay_pack(t)
                        del out, args, kwargs
        finally:
            self.replay, self.replay_live = None, {}
            with torch.no_grad():
                for b, saved in snapshot:
                    b.copy_(saved)
        if self.replay_idx != len(self.entries[v]):
            raise RuntimeError(f"remat.apply(native): recomputing {spec.name} made {self.replay_idx} tensors where "
                               f"its first run made {len(self.entries[v])} (data-dependent control flow?): run this "
                               "plan with executor='interpreter'")

    def replay_arg(self, a: Any) -> Any:
        """An argument of a recomputed call: a tensor the recomputation made itself (a merged
        node's later calls) as it is, with its graph; any other detached, requiring grad
        where the first run's did."""
        if not isinstance(a, _ArgRef):
            return a
        r = a.ref
        if isinstance(r, _Ref) and r.node == self.replay and r.idx in self.replay_live:
            t = self.replay_live[r.idx]
            if t.size() == r.size and t.stride() == r.stride and t.storage_offset() == r.offset:
                return t
            return t.as_strided(r.size, r.stride, r.offset)
        t = self.resolve(r).detach()
        return t.requires_grad_(True) if a.requires_grad else t

    def replay_pack(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key in self.static or key in self.owner:
            return None
        v, idx = self.replay, self.replay_idx
        if idx >= len(self.entries[v]):
            self.replay_idx += 1
            return None
        self.replay_idx += 1
        self.replay_live[idx] = t
        if self.entries[v][idx] is None:
            self.entries[v][idx] = t.detach()
            self.keys[v][idx] = key
            self.owner[key] = (v, idx)
        return None

    def swap_out(self, v: int, only: "list[int] | None" = None) -> None:
        """Copy v's entries (or those in `only`) to host buffers: one more chunk of v's host copy."""
        moved = StorageSet()
        idxs = [i for i, t in enumerate(self.entries[v]) if t is not None and (only is None or i in only)]
        layouts = [moved.add(self.entries[v][i]) for i in idxs]
        self.wait(v)
        buffers, event = self.ex.transfers.to_host(moved.storages)
        chunks = self.host.setdefault(v, [])
        if only is None:
            chunks.clear()
        chunks.append((buffers, list(zip(idxs, layouts))))
        self.pending[v] = event

    def swap_in(self, v: int) -> None:
        if v not in self.host:
            raise RuntimeError(f"remat.apply(native): swap_in of {self.ex.specs[v].name}, which has no host copy")
        events = []
        for buffers, layouts in self.host[v]:
            storages, event = self.ex.transfers.to_device(buffers)
            events.append(event)
            for idx, lay in layouts:
                if self.entries[v][idx] is None:
                    t = StorageSet.view(storages, lay, self.device)
                    self.entries[v][idx] = t
                    self.keys[v][idx] = storage_key(t)
                    self.owner[storage_key(t)] = (v, idx)
        self.pending[v] = events[-1] if events else None


AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """(device type, enabled, dtype) per device type: what a recomputation must run under (the
    backward runs outside the forward's ``torch.autocast``)."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
                 if d != "cuda" or torch.cuda.is_available())


def as_autocast(state: tuple) -> contextlib.ExitStack:
    """A context that restores an `autocast_state` (nothing for an empty one)."""
    stack = contextlib.ExitStack()
    for device, enabled, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
    return stack


# argument types a module call may take besides tensors and containers, for a recomputation
PLAIN_ARGS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
              torch.memory_format, torch.layout, slice, type(Ellipsis))


@dataclass
class _ArgRef:
    ref: Any
    requires_grad: bool


def _never(_: Any) -> torch.Tensor:
    raise RuntimeError("remat.apply(native): a recomputation's own graph was used")


class NativeExecution:
    """`plan` followed by `model` itself (module docstring); ``remove()`` takes the hooks off.

    `schedule`: what runs (the plan's, or `native.nativize`'s where it kept nodes resident:
    `kept`); `predicted`: the simulator's figures for it (`native.native_peak`), updated after a
    step in which something held a freed storage past the plan's free; `held`: {forward node:
    (the forward node through which its storages were held, their bytes)} (empty when every free
    took effect at once); `idle`: the plan asks nothing of the model (every node plain, no op to
    run), which then runs as plain autograd with no hooks on its modules."""

    def __init__(self, model: torch.nn.Module, plan: Plan, loss_fn: Any = None):
        graph = plan.graph
        self.model, self.plan = model, plan
        self.loss_fn = loss_fn or default_loss
        self.specs = node_specs(model, graph) if graph.meta.get("granularity", "module") == "module" else []
        self.kept: list[str] = []
        schedule = plan.schedule
        why = native_obstacle(graph, schedule, self.specs)
        if why is not None and self.specs:
            sched, self.kept = native.nativize(graph, schedule)
            if self.kept and simulate(graph, sched).valid:
                why = native_obstacle(graph, sched, self.specs)
                if why is None:
                    schedule = sched
        if why is not None:
            raise InvalidInputError(f"remat.apply: this plan cannot run natively: {why}; apply it with "
                                    "executor='interpreter' (or executor='auto')")
        self.schedule = schedule
        self.slots, _ = native.events(graph, schedule)
        self.plain = native.plain_nodes(graph, schedule)
        self.recomputed = {o.node for ops in list(self.slots.before_backward.values()) + [self.slots.tail]
                           for o in ops if o.op == "compute"}
        self.pinned = native.returned_nodes(plan.graph)
        self._track(graph)
        self.held: dict[int, tuple] = {}
        self._held_predicted: dict[int, tuple] = {}
        self._predict()
        over = self.predicted["peak_bytes"] > plan.budget_bytes
        if self.kept or over:
            msg = f"remat.apply(native): predicted peak {self.predicted['peak_bytes']:,} bytes"
            if self.kept:
                msg += (f" ({', '.join(self.kept)} kept resident where the plan recomputes them: glue ops have no "
                        "module to call again, and the forward runs the model's own code)")
            if over:
                log.warning("%s, above the budget of %s bytes (natively the model's returned outputs also live to "
                            "the step's end, and autograd's engine sums a shared parameter's gradients out of "
                            "place): plan with remat.plan(..., executor='native') or apply with "
                            "executor='interpreter'", msg, f"{plan.budget_bytes:,}")
            else:
                log.info("%s, within the budget", msg)
        self.output_idx: dict[int, set] = {}   # node -> entries that are its outputs (seen so far)
        self.transfers: Transfers | None = None
        self.step: _Step | None = None
        # called with ("forward", j) when forward node j has ended and the plan's ops after it
        # ran, and ("backward", v) when the plan's ops before b_v ran: a probe for tests and
        # tools that follow a step event by event; None in normal use
        self.on_event = None
        # True: the model runs as plain autograd (the hooks stay, doing nothing), for a plain
        # step timed in turns with planned ones (`remat.run_plan`)
        self.paused = False
        # the expected sequence of group-module calls: (path, node, first in node, last in node)
        self.expected = [(p, sp.id, k == 0, k == len(sp.calls) - 1) for sp in self.specs for k, p in enumerate(sp.calls)]
        self._handles = [model.register_forward_pre_hook(self._root_pre, with_kwargs=True),
                         model.register_forward_hook(self._root_post, always_call=True)]
        self._modules_called = [model.get_submodule(p) for p, *_ in self.expected]
        self._static = list(model.parameters()) + list(model.buffers())
        self._saved_static = self._static_seen(model)
        ev = self.slots
        # a plan that asks nothing of the model (every node plain, no op of its own to run: the
        # 1.0x plan of a model whose forward frees nothing early) runs as plain autograd, with no
        # hooks on its modules: there is nothing to follow, and no path to check
        # (a recomputation is an op of the plan's, so a recomputing plan is never idle)
        self.idle = not self.tracked and not (
            ev.start or ev.tail or any(ev.after_forward.values()) or any(ev.before_backward.values()))
        for path in dict.fromkeys(p for p, *_ in self.expected) if not self.idle else ():
            mod = model.get_submodule(path)
            self._handles.append(mod.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post))

    def _track(self, graph: Graph) -> None:
        """What the execution must follow, so that plain nodes cost (almost) nothing:
        `tracked`, the nodes whose storages it holds as entries (those not `plain`, and the
        producers of recomputed nodes' inputs); the plan's ops that act on them (a free of an
        untracked node is autograd's own); `hooked`, the nodes whose backward begins with ops
        to run or whose own saved tensors the execution holds (and the first backward node, whose
        hook ends the step); `glue_preds`, for
        each node, its glue producers whose outputs are tracked or hooked."""
        fwd = [v.id for v in graph.nodes if v.kind == "forward"]
        succ: dict[int, list] = {}
        for u, w in graph.edges:
            if graph.nodes[u].kind == "forward" and graph.nodes[w].kind == "forward":
                succ.setdefault(u, []).append(w)
        self.tracked = {v for v in fwd if v not in self.plain or any(w in self.recomputed for w in succ.get(v, ()))}
        ev = self.slots

        def acting(ops: list) -> list:
            return [o for o in ops if not (o.op == "free" and o.node not in self.tracked)]
        ev.start, ev.tail = acting(ev.start), acting(ev.tail)
        ev.after_forward = {j: acting(ops) for j, ops in ev.after_forward.items()}
        ev.before_backward = {j: acting(ops) for j, ops in ev.before_backward.items()}
        # (a node with entries of its own needs its begin too: its saved tensors go as they are unpacked)
        self.hooked = {v for v, ops in ev.before_backward.items() if ops} | set(ev.order[:1]) | \
            {v for v in fwd if v not in self.plain}
        self.glue_preds: dict[int, list] = {}
        for u, ws in succ.items():
            if not self.specs[u].calls and (u in self.tracked or u in self.hooked):
                for w in ws:
                    self.glue_preds.setdefault(w, []).append(u)
        for w in self.glue_preds:
            self.glue_preds[w].sort()
        # untracked nodes feeding a node that takes glue outputs: their outputs are marked as
        # theirs (foreign), or that node's call would take them for the glue node's
        self.marks_outputs = {u for u, ws in succ.items() if u not in self.tracked and u not in self.hooked
                              and self.specs[u].calls and any(w in self.glue_preds for w in ws)}

    def _static_seen(self, model: torch.nn.Module) -> list:
        """The parameters and buffers whose storages a step must know as static (saved as they
        are, never a node's entry): those of the modules that the nodes the execution follows
        (`tracked`, `hooked`) call; all of the model's when one of those nodes runs glue code,
        which may read any of them.  (Each step takes their storage keys anew: on a CPU the 320
        of a ResNet-50 cost a quarter of a millisecond.)  A tensor missed here would become an
        entry of the node that saves it, a second reference to the parameter, dropped and
        filled again as the plan says: the step stays correct."""
        followed = [self.specs[v] for v in sorted(self.tracked | self.hooked)]
        if any(not sp.calls or sp.glue_first or sp.glue_last for sp in followed):
            return self._static
        seen, out = set(), []
        for path in dict.fromkeys(p for sp in followed for p in sp.calls):
            mod = model.get_submodule(path)
            for t in list(mod.parameters()) + list(mod.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def _predict(self) -> None:
        self.predicted = native.native_prediction(self.plan.graph, self.schedule, self.held)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``loss_fn(model(*args, **kwargs), *args)``: one step's loss, for loops written for the
        interpreter's ``planned(*inputs)``."""
        return step_loss(self.model, self.loss_fn, args, kwargs, self.plan.graph.meta.get("model_inputs"))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- forward events ----------------------------------------------------------------------
    def _root_pre(self, model, args, kwargs):
        if self.paused or self.idle or not (torch.is_grad_enabled() and model.training):
            self.step = None
            return None
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        params = self._static   # (their storages are read each step: ``model.to`` changes them in place)
        device = params[0].device if params else (flat[0].device if flat else torch.device("cpu"))
        if self.transfers is None or self.transfers.device != device:
            self.transfers = Transfers(device)
        self.transfers.pool.reset_peak()
        st = _Step(self, self._saved_static + flat, device)
        self.step = st
        st.in_forward = True
        st.run_ops(self.slots.start)
        if self.specs[0].glue_first:
            self._begin(st, 0)
        return None

    def _root_post(self, model, args, out):
        st = self.step
        if st is None or not st.in_forward:
            return None
        if st.current is not None and st.current == st.ended + 1 and self.specs[st.current].glue_last \
                and (st.current in self.tracked or st.current in self.hooked):
            self._register_outputs(st, st.current, out)
        for j in range(st.ended + 1, len(self.specs)):
            if j != st.current:
                self._begin(st, j)
            self._end(st, j)
        st.in_forward = False
        st.saving(False)
        if st.call_pos != len(self.expected):
            raise RuntimeError(f"remat.apply(native): the forward made {st.call_pos} group-module calls, the plan "
                               f"expects {len(self.expected)}: the model took another path than when traced")
        return None

    def _pre(self, module, args, kwargs):
        try:
            return self._pre_call(module, args, kwargs)
        except BaseException:
            self._abort()
            raise

    def _post(self, module, args, out):
        try:
            return self._post_call(module, args, out)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """A failed forward: the step is dropped (the root's hook, which runs anyway, says nothing)."""
        st = self.step
        if st is not None:
            st.saving(False)
            st.in_forward = False
        self.step = None

    def _pre_call(self, module, args, kwargs):
        st = self.step
        if st is None or st.replay is not None or not st.in_forward:
            return None
        if st.call_pos >= len(self.expected):
            raise RuntimeError("remat.apply(native): the forward makes more group-module calls than the plan has")
        path, j, first, _ = self.expected[st.call_pos]
        if self._modules_called[st.call_pos] is not module:
            raise RuntimeError(f"remat.apply(native): call #{st.call_pos} of the forward is not {path}, as when traced: "
                               "the model took another path")
        st.call_pos += 1
        if first:
            for k in range(st.ended + 1, j):
                if k != st.current:
                    self._begin(st, k)
                self._end(st, k)
            if st.current != j:
                self._begin(st, j)
            st.check_frees(j)  # (freed before this event and still alive: held through j at least)
        if j in self.recomputed:
            st.calls[j].append(_Call(module, *self._arg_refs(st, j, args, kwargs)))
        elif j in self.glue_preds or j not in self.plain:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor):
                    self._glue_output(st, j, a)
        if j not in self.plain:
            # an argument that is still no entry is an untracked (plain) node's output, which
            # stays until that node's backward anyway: saved as it is, not as j's own
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor) and storage_key(a) not in st.owner:
                    st.foreign[storage_key(a)] = StorageWeakRef(a.untyped_storage())
        return None

    def _post_call(self, module, args, out):
        st = self.step
        if st is None or st.replay is not None or not st.in_forward:
            return None
        _, j, _, last = self.expected[st.call_pos - 1]
        if j in self.tracked or j in self.hooked:
            self._register_outputs(st, j, out)
        elif j in self.marks_outputs:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st.foreign[storage_key(t)] = StorageWeakRef(t.untyped_storage())
        if last:
            self._end(st, j)
            if j + 1 < len(self.specs) and self.specs[j + 1].glue_first:
                self._begin(st, j + 1)
        return None

    def _arg_refs(self, st: _Step, j: int, args, kwargs) -> tuple:
        """A call's arguments for its recomputation.  A tensor of no entry yet is an output of
        glue code: of the latest glue node among j's producers (graph edges) that has run; with
        none, it is held as it is (a constant of the model's code)."""
        recomputed = j in self.recomputed

        def ref(a):
            if not isinstance(a, torch.Tensor):
                if recomputed and not isinstance(a, PLAIN_ARGS):
                    raise InvalidInputError(
                        f"remat.apply(native): the plan recomputes {self.specs[j].name}, whose module is called with a "
                        f"{type(a).__name__} argument, which a recomputation would use and change again (a "
                        "transformers cache, say): call the model without it (use_cache=False), or apply the plan "
                        "with executor='interpreter'")
                return a
            self._glue_output(st, j, a)
            return _ArgRef(st.ref_of(a, None), a.requires_grad)
        return tree_map(ref, args), tree_map(ref, kwargs)

    def _glue_output(self, st: _Step, j: int, a: torch.Tensor) -> None:
        """An argument of node j's call that is no entry yet, nor an untracked node's output
        (`marks_outputs`), is an output of glue code: of the latest glue node among j's
        producers (graph edges) that has run."""
        glue = [g for g in self.glue_preds.get(j, ()) if g <= st.ended or g == st.current]
        key = storage_key(a)
        if glue and key not in st.owner and key not in st.static:
            foreign = st.foreign.get(key)
            if foreign is None or foreign.expired():   # (an untracked node's output is not the glue's)
                self._register_outputs(st, glue[-1], a)

    def _register_outputs(self, st: _Step, j: int, out) -> None:
        """Node j's outputs: entries when j is tracked; a pre-hook on their autograd functions
        when j is hooked (`_track`)."""
        outs = self.output_idx.setdefault(j, set())
        tracked, hooked = j in self.tracked, j in self.hooked
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if tracked:
                r = st.ref_of(t, j)
                if not (isinstance(r, _Ref) and r.node == j):
                    continue
                outs.add(r.idx)
            if hooked and t.grad_fn is not None and id(t.grad_fn) not in st.hooked_fns:
                st.hooked_fns.add(id(t.grad_fn))
                t.grad_fn.register_prehook(self._bwd_hook(st, j))

    def _begin(self, st: _Step, j: int) -> None:
        st.current = j
        st.saving(j not in self.plain)
        if j in self.recomputed:
            st.autocast[j] = autocast_state()
            if self.specs[j].random:
                cuda = [st.device] if st.device.type == "cuda" else []
                st.rng[j] = (torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda))

    def _end(self, st: _Step, j: int) -> None:
        st.ended = j
        st.current = None
        st.saving(False)
        st.run_ops(self.slots.after_forward.get(j, []))
        if self.on_event is not None:
            self.on_event("forward", j)

    # ---- backward events ---------------------------------------------------------------------
    def _bwd_hook(self, st: _Step, v: int):
        def hook(grad_outputs):
            if st.in_backward is not None and st.in_backward <= v:
                return None
            self._begin_backward(st, v)
            return None
        return hook

    def _begin_backward(self, st: _Step, v: int) -> None:
        if not st.callback_queued:
            st.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(st))
        if st.to_check:  # (freed in the forward and alive after it: held to the step's end)
            st.check_frees(len(self.specs) + 1)
            st.to_check = []
        order = self.slots.order
        while st.bwd_pos < len(order):
            k = order[st.bwd_pos]
            if k < v:
                break
            st.bwd_pos += 1
            st.in_backward = k
            st.run_ops(self.slots.before_backward.get(k, []))
            if self.on_event is not None:
                self.on_event("backward", k)
            if k == v:
                break
        st.in_backward = v

    def _end_backward(self, st: _Step) -> None:
        order = self.slots.order
        while st.bwd_pos < len(order):
            k = order[st.bwd_pos]
            st.bwd_pos += 1
            st.in_backward = k
            st.run_ops(self.slots.before_backward.get(k, []))
        st.run_ops(self.slots.tail)
        st.finishing = True
        for v in self.pinned:
            st.free(v)
        if self.held != self._held_predicted:
            self._held_predicted = dict(self.held)
            before = self.predicted["peak_bytes"]
            self._predict()
            names = ", ".join(self.specs[v].name for v in sorted(self.held))
            msg = (f"remat.apply(native): the model's code holds the outputs of {names} past the plan's frees "
                   f"(local variables of its forward); predicted peak now {self.predicted['peak_bytes']:,} bytes")
            if self.predicted["peak_bytes"] > max(before, self.plan.budget_bytes):
                log.warning("%s, above the budget of %s bytes: apply the plan with executor='interpreter', or "
                            "trace at a depth whose modules hold their own inputs", msg, f"{self.plan.budget_bytes:,}")
            else:
                log.info("%s, within the budget", msg)
        if self.transfers is not None:
            self.transfers.end_step()
        if self.step is st:
            self.step = None

    @property
    def host_peak_bytes(self) -> int:
        return self.transfers.pool.peak if self.transfers is not None else 0


__all__ = ["NativeExecution", "native_obstacle", "node_specs"]
