"""``granularity="joint"``: one graph node per allocating ATen op of the joint forward+backward graph.

`trace_joint(model, example_inputs, loss_fn)` captures ``loss = loss_fn(model(*inputs), *inputs)``
and its gradient w.r.t. the trainable parameters as ONE functional ATen graph
(``torch._functorch.aot_autograd.aot_export_module(..., trace_joint=True)``), so backward ops
and the tensors they read from the forward ("saved tensors") are explicit fx nodes and edges.

Nodes (`JointProgram.groups`; graph node i = group i):

* one node per fx op that allocates a new storage ("head"), found by running the graph once
  on real tensors under `StorageTracker`; ops that allocate nothing (views, ``getitem``,
  ``detach``, ``_unsafe_view``...) are merged into the node that owns the storage they alias,
  so bytes belong to storages (docs/design.md) and a view never keeps a base alive on its own;
  views of parameters, buffers and inputs are *static* (no node: evaluated once per step).
  A non-allocating op that reads values of two nodes becomes a node of its own (0 bytes; a
  warning is logged: the simulator cannot see that it holds its base's storage);
* kind ``forward``: the node does not depend (transitively) on the loss; ``loss``: the node
  that produces the loss value, with the gradient seed folded into it (``ones_like(loss)`` and
  its views: its bytes are the loss and the seed); ``backward``: everything that depends on the
  loss (gradient ops).  Backward formulas' parts that read only forward values (no gradient)
  are ``forward`` nodes, which the solvers may recompute.  Ids: forward nodes (fx order, each
  such part right after its latest input: `forward_order`), the loss, backward nodes (fx
  order): a topological order;
* edges: data dependencies between nodes (a backward op reading a forward value is a
  "saved tensor" edge);
* an op whose outputs that other ops read lie in several storages (batch norm's output and
  statistics, dropout's output and mask) is one node per storage, its *parts*
  (`remat.core.graph`, `split_outputs`): the leader has the allocating op and the first storage,
  each later part the ``getitem`` (and views) of its storage; the leader's run executes the whole
  op (`JointProgram.run`) and hands each part its values (`take_parts`);
* ``bytes``: storages the node allocates that another node reads (an unused output, e.g. of
  ``native_batch_norm_backward``, is workspace; a leader's workspace includes its later parts'
  bytes);
  ``workspace_bytes``: the rest of its peak while it runs: storages the op returns but nobody
  keeps, and what its kernels allocate inside themselves (a dropout's float draws, a CPU
  convolution's unfolded input), which no storage shows: the allocator's own figure over the
  node (on the CPU its events, `AllocationLog`; on CUDA `AllocatorWindow`) above the storages'.
  That part is also ``extra["scratch_bytes"]``: the storage accounting (`measure_peak`) does not
  see it, and `remat.core.plan.Plan.storage_peak_bytes` is the peak without it;
* parameter gradients: the node producing one is a backward node whose value goes into
  ``param.grad`` at once.  With ``grads="accumulated"`` (PyTorch's default loop,
  ``zero_grad(set_to_none=True)``) it is the parameter's first gradient of the step: the new
  ``.grad`` is that node's *persistent bytes* (the value itself when `steals_gradient`, as
  autograd does, else a copy); with ``grads="resident"`` the gradients are fixed bytes
  (`base.fixed_bytes`) and the value, added in place, is the node's *workspace*. Either way it
  is not its bytes (unless another node also reads it);
* buffer mutations (BatchNorm running statistics, ``num_batches_tracked``) are extra outputs
  of the functional graph: the executor copies them into the buffers once, at the first
  compute of the node producing them (a recomputation leaves the buffers alone); like
  parameter gradients, a value only written to a buffer is workspace;
* random ops (``native_dropout``, ``bernoulli``...; ATen's ``nondeterministic_seeded`` tag):
  ``extra["random"]=True``; the executor records the RNG state before the first compute and
  replays it on a recomputation, so the mask is the same;
* ``time``: ``profile="flops"``: `FlopsModel` (flops / flops_per_s + allocated bytes /
  bytes_per_s); ``profile="measure"``: median of `repeats` timed runs of the node's ops after
  `warmup` runs (perf_counter, or CUDA events on a GPU).

The graph's ``meta`` has trace.py's keys (granularity ``"joint"``) plus ``meta["joint"]``:
the static views and the loss/seed fx names; each node's ``extra["ops"]`` lists its fx nodes'
names.  `remat.apply` re-captures the model and rebuilds the same nodes from those names
(nothing is pickled); see `joint_executor`.

Three runs of the graph happen while tracing: grouping (fx order), profiling (node order,
each value freed after its last consumer: the checkpoint-all schedule) and, with
``profile="measure"``, timing.  The model's buffers and the RNG state are restored afterwards.
"""
from __future__ import annotations

import logging
import statistics
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from remat.core.errors import InvalidInputError
from remat.core.graph import Graph, Node

from .base import Frontend, TraceContext, prepare, step_loss, trace_with
from .capture import CaptureError, quiet_torch_logs, traced_like_export
from .kernels import kernel
from .measuring import AllocationLog, AllocatorWindow, StorageTracker, on_autograd_thread, storage_bytes, storage_key, unique_bytes
from .profile import FlopsModel, Timer, is_random

log = logging.getLogger(__name__)

STATIC = -1            # group id of placeholders and views of them
CAPTURE_METHOD = "aot_export_module(trace_joint=True)"
WRAPPER_PREFIX = "model."


# ---- capture ----------------------------------------------------------------------------------
@dataclass
class JointCapture:
    """The functional joint graph and what its placeholders and outputs mean."""
    gm: fx.GraphModule
    placeholders: dict        # fx node -> ("parameter" | "buffer", FQN) | ("input", flat tensor index)
                              # | ("constant", attribute of gm): a tensor the trace lifted as a constant
    loss: fx.Node             # the user output (the loss value)
    param_grads: dict         # fx node -> [parameter FQN, ...]: its value is that parameter's gradient
    buffer_updates: dict      # fx node -> [buffer FQN, ...]: its value is the buffer's new value
    nodes_by_name: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)   # how it was captured, where not the plain way


class _LossModule(torch.nn.Module):
    """``(loss_fn(model(*args, **kwargs), *args),)``: what aot_export_module differentiates (inputs
    the model does not take are the loss's: `base.model_inputs`)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, count: int | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.count = count

    def forward(self, *args: Any, **kwargs: Any):
        loss = step_loss(self.model, self.loss_fn, args, kwargs, self.count)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidInputError("loss_fn must return a scalar tensor, got "
                                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        if not loss.requires_grad:
            raise InvalidInputError("the loss does not depend on a trainable parameter (it does not require grad); "
                                    "nothing to train")
        return (loss.reshape(()),)


def capture_joint(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable,
                  model_inputs: int | None = None) -> JointCapture:
    """Capture the joint graph of one training step (see the module docstring).  Raises
    `InvalidInputError` for a bad loss and `CaptureError` naming the reason when
    aot_export_module cannot capture the model."""
    from torch._functorch.aot_autograd import aot_export_module

    wrapper = _LossModule(model, loss_fn, model_inputs)
    args = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, args)
    kwargs = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, kwargs)
    snapshot = [(b, b.detach().clone()) for b in model.buffers()]
    frozen: list = []
    untied: list = []

    def plain_export():
        return aot_export_module(wrapper, args, trace_joint=True, output_loss_index=0, kwargs=kwargs or None)

    def export():
        # a model that reads a tensor's value while it is traced (transformers' GPT-2 without a
        # cache checks for packed sequences) is traced again as torch.export traces it, where
        # libraries skip such checks; not by default, since there they may also build the step
        # differently (transformers then materialises a causal mask eager attention never makes)
        try:
            return plain_export()
        except Exception as e:  # noqa: BLE001
            if "DataDependent" not in type(e).__name__ and "data-dependent" not in str(e).lower():
                raise
            notes.append(f"captured as torch.export runs the model (the plain capture read a tensor's value: "
                         f"{type(e).__name__})")
            with traced_like_export():
                return plain_export()
    notes: list = []
    try:
        with torch.random.fork_rng(devices=[]), quiet_torch_logs():
            try:
                gm, sig = export()
            except AssertionError as e:
                if "did not receive a gradient" not in str(e):
                    raise
                # a trainable parameter the loss does not reach (a pooler a masked-LM head
                # skips), or one name of a tied parameter that the forward never uses (BERT's
                # ``cls.predictions.bias``, used as ``decoder.bias``): aot_export_module makes one
                # input per name.  Plain autograd leaves such a .grad alone; so does the joint
                # graph once each name is its own tensor and the unused ones do not require grad
                untied = _untie(model)
                frozen = unused_parameters(model, lambda: wrapper(*args, **kwargs)[0])
                for p in frozen:
                    p.requires_grad_(False)
                gm, sig = export()
    except InvalidInputError:
        raise
    except Exception as e:  # noqa: BLE001
        inner = e
        while isinstance(inner.__cause__, InvalidInputError) or isinstance(inner.__context__, InvalidInputError):
            inner = inner.__cause__ or inner.__context__
            if isinstance(inner, InvalidInputError):
                raise inner from None
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise CaptureError(f"joint capture of {type(model).__name__} failed ({CAPTURE_METHOD}): {type(e).__name__}: "
                           f"{first[:300]}; use granularity 'op-stages' or 'module', which fall back to an "
                           "eager recording") from e
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for mod, attr, param in reversed(untied):
            setattr(mod, attr, param)
        with torch.no_grad():
            for b, saved in snapshot:
                b.copy_(saved)
    by_name = {n.name: n for n in gm.graph.nodes}
    ph = {n: ("constant", n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, fqn in sig.inputs_to_parameters.items():
        ph[by_name[name]] = ("parameter", _strip(fqn))
    for name, fqn in sig.inputs_to_buffers.items():
        ph[by_name[name]] = ("buffer", _strip(fqn))
    flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if len(sig.user_inputs) != len(flat):
        raise CaptureError(f"joint capture: {len(sig.user_inputs)} input placeholders for {len(flat)} input tensors; "
                           "non-tensor inputs that change the graph are not supported by granularity 'joint'")
    for k, name in enumerate(sig.user_inputs):
        ph[by_name[name]] = ("input", k)
    if sig.user_inputs_to_mutate:
        raise CaptureError("joint capture: the model writes its inputs in place "
                           f"({sorted(sig.user_inputs_to_mutate.values())}); not supported by granularity 'joint'")
    if getattr(sig, "parameters_to_mutate", None):
        raise CaptureError("joint capture: the model writes its parameters in place; not supported")
    if len(sig.user_outputs) != 1:
        raise CaptureError(f"joint capture: expected one user output (the loss), got {len(sig.user_outputs)}")
    loss = by_name[sig.user_outputs[0]]
    grads: dict = {}
    for name, fqn in sig.backward_signature.gradients_to_parameters.items():
        grads.setdefault(by_name[name], []).append(_strip(fqn))
    updates: dict = {}
    for name, fqn in sig.buffers_to_mutate.items():
        updates.setdefault(by_name[name], []).append(_strip(fqn))
    for node in list(grads) + list(updates) + [loss]:
        if node.op != "call_function":
            raise CaptureError(f"joint capture: output {node.name} is a {node.op}, not an op's value "
                               "(a parameter whose gradient is an input?); not supported")
    return JointCapture(gm, ph, loss, grads, updates, by_name, notes)


def unused_parameters(model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> list:
    """The trainable parameters of `model` that the loss `loss()` does not depend on: one
    forward on the real inputs (no backward), walking its autograd graph to the leaves."""
    with torch.random.fork_rng(devices=[]):
        out = loss()
    reached, todo, seen = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
        todo.extend(f for f, _ in fn.next_functions)
    del out
    return [p for p in model.parameters() if p.requires_grad and id(p) not in reached]


def _untie(model: torch.nn.Module) -> list:
    """Give every second and later name of a tied parameter a Parameter of its own on the same
    storage (in place, until undone); returns ``(module, attribute, the tied parameter)`` to undo."""
    seen, undo = set(), []
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            owner, _, attr = fqn.rpartition(".")
            mod = model.get_submodule(owner)
            setattr(mod, attr, torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad))
            undo.append((mod, attr, p))
        seen.add(id(p))
    return undo


def _strip(fqn: str) -> str:
    return fqn[len(WRAPPER_PREFIX):] if fqn.startswith(WRAPPER_PREFIX) else fqn


def model_state(model: torch.nn.Module) -> dict:
    """{name: tensor} of every parameter and buffer, tied ones under each of their names (one walk
    of the module tree; `get_parameter` per name walks the path each time)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def placeholder_values(cap: JointCapture, model: torch.nn.Module, flat_inputs: list, state: dict | None = None) -> dict:
    """fx placeholder -> the real tensor: the model's parameters and buffers, the call's inputs,
    the graph's lifted constants.  `state`: `model_state(model)` where the caller has it."""
    out = {}
    state = model_state(model) if state is None else state
    for n, (kind, what) in cap.placeholders.items():
        if kind in ("parameter", "buffer"):
            out[n] = state[what]
        elif kind == "constant":
            out[n] = getattr(cap.gm, what)
        else:
            out[n] = flat_inputs[what]
    return out


# ---- the program: nodes as groups of fx ops ---------------------------------------------------
@dataclass
class JointProgram:
    """Graph node i = ``groups[i]`` (fx nodes in fx order; the first allocates).  What running
    a node needs and leaves: ``keep[i]`` values other nodes read (held until ``free i``),
    ``sinks[i]`` values that go to a parameter's ``.grad`` or a buffer ("grad" | "buffer", FQN)."""
    cap: JointCapture
    groups: list
    static: list              # fx nodes evaluated once per step (views of placeholders)
    kinds: list
    group_of: dict            # fx node -> group id (STATIC for placeholders and static views)
    preds: list
    keep: list
    sinks: list
    release: list             # per group: {member: [members to drop right after it]}
    random: list
    seed: "fx.Node | None"
    seed_members: list        # members of the loss group computed from the seed (rerun for a grad != 1)
    part_of: list = field(default_factory=list)  # per group: its op's leader group when a later part, else None
    parts: list = field(default_factory=list)    # per group: the later parts of its op (leaders only)
    op_members: list = field(default_factory=list)  # per group: the fx nodes its op runs (leader and parts)

    @cached_property
    def loss_id(self) -> int:
        return self.kinds.index("loss")

    def run_static(self, const: dict) -> None:
        """Add the static views to `const` (placeholder values)."""
        get = const.__getitem__
        for n in self.static:
            const[n] = kernel(n.target)(*fx.node.map_arg(n.args, get), **fx.node.map_arg(n.kwargs, get))

    def run(self, g: int, lookup: Callable[[fx.Node], Any], start: dict | None = None,
            members: list | None = None) -> dict:
        """Run node g's ops (or only `members`) on values from `lookup` (other nodes' kept values,
        statics); members already in `start` are not run.  Returns {fx node: value} for
        ``keep[g]`` and the sink values; everything else is dropped as soon as it is not needed.
        For the leader of an op with parts it runs the whole op: `take_parts` then moves the
        parts' values out."""
        local: dict = dict(start or {})
        rel = self.release[g]

        def get(x: fx.Node) -> Any:
            return local[x] if x in local else lookup(x)
        for n in (self.op_members[g] if members is None else members):
            if n in local:
                continue
            local[n] = kernel(n.target)(*fx.node.map_arg(n.args, get), **fx.node.map_arg(n.kwargs, get))
            for d in rel.get(n, ()):
                local.pop(d, None)
        return local


    def op_keep(self, g: int) -> set:
        """The values leader g's run keeps: its own and its parts' (`keep`)."""
        return set(self.keep[g]).union(*(self.keep[p] for p in self.parts[g]))

    def take_parts(self, g: int, local: dict) -> dict:
        """{later part: its kept values}, popped from `local` (what `run` returned for leader g)."""
        return {p: {x: local.pop(x) for x in self.keep[p] if x in local} for p in self.parts[g]}


def build_program(cap: JointCapture, groups: list, static: list, order_kinds: list | None = None,
                  part_of: list | None = None) -> JointProgram:
    """The `JointProgram` of `groups` (fx nodes per graph node, in node order) and `static`;
    `part_of[g]`: the leader group of a later part of an op with several outputs, else None."""
    part_of = list(part_of) if part_of is not None else [None] * len(groups)
    op_of = [g if l is None else l for g, l in enumerate(part_of)]
    parts: list = [[] for _ in groups]
    for g, l in enumerate(part_of):
        if l is not None:
            parts[l].append(g)
    order = {n: i for i, n in enumerate(cap.gm.graph.nodes)}
    op_members = [sorted(m + [n for p in parts[g] for n in groups[p]], key=order.__getitem__) if l is None else list(m)
                  for g, (m, l) in enumerate(zip(groups, part_of))]
    group_of: dict = {n: STATIC for n in cap.placeholders}
    for n in static:
        group_of[n] = STATIC
    for g, members in enumerate(groups):
        for n in members:
            group_of[n] = g
    missing = [n.name for n in cap.gm.graph.nodes if n.op == "call_function" and n not in group_of]
    if missing:
        raise InvalidInputError(f"joint graph: ops {missing[:5]} belong to no node; re-trace the model")
    preds, keep, sinks, release, random = [], [], [], [], []
    for g, members in enumerate(groups):
        mine = set(members)
        ps = []
        for n in members:
            for i in n.all_input_nodes:
                p = group_of[i]
                if p != STATIC and p != g and p not in ps:
                    ps.append(p)
                if p != STATIC and p > g and i not in mine and op_of[p] != g:
                    raise InvalidInputError(f"joint graph: node {g} reads {i.name} of a later node {p}; re-trace")
        preds.append(sorted(ps))
        # kept: read by another op (a leader's value its own parts read is not kept: the op runs whole)
        kept = [n for n in members if n is cap.loss or any(op_of[group_of[u]] != op_of[g]
                                                          for u in n.users if u.op != "output")]
        sink = [(n, "grad", fqn) for n in members for fqn in cap.param_grads.get(n, [])]
        sink += [(n, "buffer", fqn) for n in members for fqn in cap.buffer_updates.get(n, [])]
        keep.append(kept)
        sinks.append(sink)
    for g, l in enumerate(part_of):  # (the leader's run applies its op's sinks)
        if l is not None:
            sinks[l] = sinks[l] + sinks[g]
            sinks[g] = []
    for g, members in enumerate(op_members):
        if part_of[g] is not None:
            release.append({})
            random.append(False)
            continue
        mine = set(members)
        held = {n for h in [g] + parts[g] for n in keep[h]} | {n for n, _, _ in sinks[g]}
        last: dict = {}
        for n in members:
            for i in n.all_input_nodes:
                if i in mine:
                    last[i] = n
        rel: dict = {}
        for n in members:
            if n not in held:
                rel.setdefault(last.get(n, n), []).append(n)
        release.append(rel)
        random.append(any(_random(n) for n in members))
    kinds = order_kinds or _kinds(cap, groups, group_of, preds)
    loss_g = kinds.index("loss")
    seed = next((n for n in groups[loss_g] if n.op == "call_function" and n is not cap.loss
                 and _is_seed(n, cap.loss)), None)
    seed_members: list = []
    if seed is not None:
        dep = {seed}
        for n in groups[loss_g]:
            if n is seed or any(i in dep for i in n.all_input_nodes):
                dep.add(n)
                seed_members.append(n)
    return JointProgram(cap, groups, list(static), kinds, group_of, preds, keep, sinks, release, random, seed,
                        seed_members, part_of, parts, op_members)


def _is_seed(n: fx.Node, loss: fx.Node) -> bool:
    name = getattr(n.target, "__name__", str(n.target))
    return name.startswith(("ones_like", "full_like")) and n.args and n.args[0] is loss


def _random(n: fx.Node) -> bool:
    if is_random(n):
        return True
    name = getattr(n.target, "__name__", "")
    return ("dropout" in name and "backward" not in name) or "bernoulli" in name


def _kinds(cap: JointCapture, groups: list, group_of: dict, preds: list) -> list:
    loss_g = group_of[cap.loss]
    after_loss = set()
    for g in range(len(groups)):
        if g == loss_g or any(p in after_loss or p == loss_g for p in preds[g]):
            after_loss.add(g)
    return ["loss" if g == loss_g else "backward" if g in after_loss else "forward" for g in range(len(groups))]


# ---- pass 1: which ops allocate, which alias ----------------------------------------------------
def discover_groups(cap: JointCapture, const: dict) -> tuple[list, list, list]:
    """Run the joint graph once in fx order on real tensors; return (groups in node order,
    static fx nodes, kinds in node order).  See the module docstring for the rules."""
    nodes = list(cap.gm.graph.nodes)
    last_use = {}
    for n in nodes:
        for i in n.all_input_nodes:
            last_use[i] = n
    tracker = StorageTracker()
    tracker.ignore(const.values())
    env = dict(const)
    group_of: dict = {n: STATIC for n in const}
    owner: dict = {}              # storage uid -> group
    storage_of: dict = {}         # a non-allocating op whose tensors are views of one storage -> its uid
    groups: list = []             # in fx order of their first op
    static: list = []
    with torch.no_grad(), tracker:
        for n in nodes:
            if n.op != "call_function":
                continue
            before = tracker.next_uid
            get = env.__getitem__
            out = kernel(n.target)(*fx.node.map_arg(n.args, get), **fx.node.map_arg(n.kwargs, get))
            env[n] = out
            new = range(before, tracker.next_uid)
            ins = {group_of[i] for i in n.all_input_nodes} - {STATIC}
            if len(new):
                g = len(groups)
                groups.append([n])
                for uid in new:
                    owner[uid] = g
            else:
                tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                uids = {tracker.uid(t) for t in tensors}
                if len(uids) == 1 and None not in uids:
                    storage_of[n] = next(iter(uids))
                owners = {owner.get(tracker.uid(t), STATIC) for t in tensors} - {STATIC}
                if not owners and not ins:
                    g = STATIC
                    static.append(n)
                elif len(owners | ins) == 1:
                    g = next(iter(owners | ins))
                    groups[g].append(n)
                else:
                    g = len(groups)
                    groups.append([n])
                    log.warning("joint graph: %s (%s) allocates nothing but reads values of nodes %s; it becomes a "
                                "0-byte node of its own, which keeps its base's storage alive unseen by the plan",
                                n.name, n.target, sorted(owners | ins))
            group_of[n] = g
            for i in n.all_input_nodes:
                if last_use.get(i) is n and i not in const:
                    env.pop(i, None)
            if n not in last_use and n is not cap.loss:
                env.pop(n, None)
    del env
    # the gradient seed (ones_like(loss) and its views) folds into the loss node
    loss_g = group_of[cap.loss]
    for g in range(loss_g + 1, len(groups)):
        if groups[g] and _is_seed(groups[g][0], cap.loss):
            groups[loss_g].extend(groups[g])
            for n in groups[g]:
                group_of[n] = loss_g
            groups[g] = []
    keep = [g for g in range(len(groups)) if groups[g]]
    groups = [groups[g] for g in keep]
    for g, members in enumerate(groups):
        members.sort(key=nodes.index)
        for n in members:
            group_of[n] = g
    preds = [sorted({group_of[i] for n in m for i in n.all_input_nodes} - {STATIC, g}) for g, m in enumerate(groups)]
    kinds = _kinds(cap, groups, group_of, preds)
    order = forward_order(kinds, preds) + [kinds.index("loss")] + [g for g, k in enumerate(kinds) if k == "backward"]
    out_groups, out_kinds, part_of = [], [], []
    for g in order:
        lead = len(out_groups)
        parts = split_outputs(groups[g], group_of, storage_of) if kinds[g] != "loss" else [groups[g]]
        for j, members in enumerate(parts):
            out_groups.append(members)
            out_kinds.append(kinds[g])
            part_of.append(lead if j else None)
    return out_groups, static, out_kinds, part_of


def forward_order(kinds: list, preds: list) -> list:
    """The forward groups in node order: fx order, except that a backward formula's part that
    reads only forward values (``pow(x, 2)`` of a tanh-GELU's derivative, traced after the loss)
    comes right after its latest input rather than at the end of the forward.  There it is made
    while its input exists anyway, and a schedule keeps it or recomputes it before its reader;
    at the end of the forward, at the loss's instant (where a language model's logits make the
    step's peak), every block's input of it would have to be resident or recomputed at once."""
    loss = kinds.index("loss")
    order: list = []
    for g, k in enumerate(kinds):
        if k != "forward":
            continue
        if g < loss or not preds[g]:
            order.append(g)   # (one that reads no value of the step stays where it was traced)
        else:   # (a forward group's inputs are forward groups traced before it: placed already)
            order.insert(max(order.index(p) for p in preds[g]) + 1, g)
    return order


def split_outputs(members: list, group_of: dict, storage_of: dict) -> list:
    """A node's fx ops cut into the parts of an op with several outputs (`remat.core.graph`): one
    part per storage that other nodes read, the first with the allocating op (the leader).  A
    member goes to a part when its value is a view of that one storage and it reads only the
    leader's ops or its part's; everything else (and storages nobody else reads) stays with the
    leader.  One storage read elsewhere: no parts."""
    g = group_of[members[0]]
    outside = {n for n in members if any(group_of.get(u) != g for u in n.users if u.op != "output")}
    buckets: dict = {}
    for n in members[1:]:
        uid = storage_of.get(n)
        if uid is not None:
            buckets.setdefault(uid, []).append(n)
    read = [uid for uid, ms in buckets.items() if any(n in outside for n in ms)]
    if len(read) < 2:
        return [members]
    moved = {n: uid for uid in read[1:] for n in buckets[uid]}
    for n, uid in list(moved.items()):
        if any(i in moved and moved[i] != uid or (i not in moved and group_of.get(i) == g and i is not members[0])
               for i in n.all_input_nodes if group_of.get(i) == g):
            return [members]  # (a part would read another part, or a leader op other than the allocating one)
    return [[n for n in members if n not in moved]] + [[n for n in buckets[uid]] for uid in read[1:]]


# ---- pass 2 and 3: bytes, workspace, flops, time --------------------------------------------------
@dataclass
class NodeProfile:
    bytes: int = 0
    workspace: int = 0
    grad_bytes: int = 0      # parameter gradients it makes: the bytes each becomes as a fresh ``.grad``
    grad_stolen: int = 0     # of those, the bytes a fresh ``.grad`` takes over from its value (`steals_gradient`)
    alloc_bytes: int = 0
    flops: int = 0
    time: float = 0.0
    scratch: int = 0         # of the workspace, what the kernels allocate inside themselves (no storage shows it)


def _last_consumer(prog: JointProgram) -> list:
    last = list(range(len(prog.groups)))
    for g, ps in enumerate(prog.preds):
        for p in ps:
            last[p] = max(last[p], g)
    return last


def steals_gradient(value: torch.Tensor, param: torch.Tensor, stealable: bool) -> bool:
    """Whether `value`, a parameter's first gradient of the step, becomes ``param.grad`` as it is
    (autograd's AccumulateGrad does the same: a gradient nobody else holds, laid out like the
    parameter, in a storage of its own); else ``.grad`` is a fresh copy."""
    return (stealable and value.stride() == param.stride() and value.storage_offset() == 0
            and value.untyped_storage().nbytes() == value.numel() * value.element_size())


def profile_program(prog: JointProgram, const: dict, flops: bool, measure_time: bool, device: torch.device,
                    warmup: int, repeats: int) -> list[NodeProfile]:
    """Run the program in node order (checkpoint-all: each value freed after its last consumer)
    under `StorageTracker`; per node its bytes, workspace, flops; then, with `measure_time`, a
    second run timing each node."""
    from torch.utils.flop_counter import FlopCounterMode

    n = len(prog.groups)
    profs = [NodeProfile() for _ in range(n)]
    last = _last_consumer(prog)
    frees: list = [[] for _ in range(n)]
    for g in range(n):
        frees[last[g]].append(g)
    tracker = StorageTracker(record_events=True)
    tracker.ignore(const.values())
    values: dict = {}
    params = {fqn: const[x] for x, (kind, fqn) in prog.cap.placeholders.items() if kind == "parameter"}
    accumulated: set = set()  # parameters (storage keys) whose gradient an earlier node made

    def lookup(x: fx.Node) -> Any:
        g = prog.group_of[x]
        return const[x] if g == STATIC else values[g][x]

    stash: dict = {}  # later parts' values, made by their op's leader

    def run_node(g: int) -> dict:
        if prog.part_of[g] is not None:
            return stash.pop(g)
        local = prog.run(g, lookup)
        stash.update(prog.take_parts(g, local))
        return local

    def run_groups(groups: range) -> None:
        for g in groups:
            values[g] = run_node(g)
            for f in frees[g]:
                values.pop(f, None)
    if device.type == "cuda":
        # a first pass on the threads the executor uses (the backward nodes on autograd's
        # device thread) makes what the CUDA libraries keep: cuBLAS workspaces, not any node's
        split = prog.kinds.index("loss") + 1
        with torch.no_grad():
            run_groups(range(split))
        on_autograd_thread(lambda: run_groups(range(split, n)), device)
        values.clear()
    # on the CPU the allocator's own events (`AllocationLog`, a window per node) show what a
    # kernel allocates inside itself (a dropout's float draws, a convolution's unfolded input),
    # which the storage accounting does not see; on CUDA `AllocatorWindow` does
    log = AllocationLog() if device.type == "cpu" else None
    visible_of: dict = {}
    with torch.no_grad(), tracker, (log or nullcontext()):
        for g in range(n):
            if prog.part_of[g] is not None:  # (its op ran at the leader; its bytes are its tensors')
                values[g] = run_node(g)
                profs[g].bytes = unique_bytes(values[g].values())
                for f in frees[g]:
                    values.pop(f, None)
                continue
            m0 = tracker.mark()
            counter = FlopCounterMode(display=False) if flops else None
            with (counter or nullcontext()), AllocatorWindow(device) as alloc, (log.window(g) if log else nullcontext()):
                local = prog.run(g, lookup)
                stash.update(prog.take_parts(g, local))
            stolen: dict = {}
            op_keep = prog.op_keep(g)
            for node, what, fqn in prog.sinks[g]:  # to .grad or a buffer at once (not applied here)
                if what == "grad" and storage_key(params[fqn]) not in accumulated:
                    # (a parameter's first gradient; a tied one's later gradients add into it)
                    value, param = local[node], params[fqn]
                    accumulated.add(storage_key(param))
                    p = profs[g]
                    p.grad_bytes += storage_bytes(param)
                    if steals_gradient(value, param, node not in op_keep) and tracker.uid(value) is not None:
                        stolen[storage_key(value)] = storage_bytes(value)
                    del value  # (held here, it would count as the node's bytes)
                if node not in op_keep:
                    local.pop(node, None)
            profs[g].grad_stolen = sum(stolen.values())
            values[g] = local
            kept = sum(tracker.new_live(m0).values())
            p = profs[g]
            p.bytes = kept - sum(unique_bytes(stash[q].values()) for q in prog.parts[g])
            # on CUDA also what kernels allocate internally (cuDNN's workspaces, say)
            visible = tracker.peak_between(m0)
            p.scratch = alloc.hidden(tracker, m0)
            p.workspace = max(0, visible - p.bytes) + p.scratch  # (with its later parts' bytes)
            # (the log counts a free only for a block allocated in its window: the same peak)
            visible_of[g] = tracker.peak_between(m0, own_frees_only=True)
            p.alloc_bytes = sum(d for _, d in tracker.events[m0:] if d > 0)
            p.flops = counter.get_total_flops() if counter is not None else 0
            del local
            for f in frees[g]:
                values.pop(f, None)
    values.clear()
    if log is not None:
        for g, visible in visible_of.items():
            profs[g].scratch = max(0, log.peak(g) - visible)
            profs[g].workspace += profs[g].scratch
    if measure_time:
        timer = Timer(device)
        with torch.no_grad():
            for g in range(n):
                if prog.part_of[g] is not None:  # (nothing to time: its op ran at the leader)
                    values[g] = run_node(g)
                    for f in frees[g]:
                        values.pop(f, None)
                    continue
                for _ in range(warmup):
                    prog.run(g, lookup)
                times = []
                for _ in range(repeats):
                    a = timer.mark()
                    prog.run(g, lookup)
                    times.append(timer.seconds(a, timer.mark()))
                values[g] = run_node(g)
                profs[g].time = statistics.median(times)
                for f in frees[g]:
                    values.pop(f, None)
        values.clear()
    return profs


# ---- the frontend -------------------------------------------------------------------------------------
class JointFrontend(Frontend):
    """``granularity="joint"``: one node per allocating op of the joint forward+backward graph
    (module docstring)."""
    granularity = "joint"
    min_warmup = 0
    need_grad = True

    def capture(self, ctx: TraceContext) -> None:
        ctx.state["cap"] = capture_joint(ctx.model, ctx.args, ctx.kwargs, ctx.loss_fn, ctx.model_inputs)

    def cut(self, ctx: TraceContext) -> None:
        cap = ctx.state["cap"]
        flat = [t for t in tree_flatten((ctx.args, ctx.kwargs))[0] if isinstance(t, torch.Tensor)]
        with self.reported(ctx):
            const = ctx.state["const"] = placeholder_values(cap, ctx.model, flat)
            groups, static, kinds, part_of = discover_groups(cap, const)
            prog = ctx.state["program"] = build_program(cap, groups, static, kinds, part_of)
            prog.run_static(const)

    def profile(self, ctx: TraceContext) -> None:
        with self.reported(ctx):
            ctx.state["profiles"] = profile_program(ctx.state["program"], ctx.state["const"], ctx.flops,
                                                    ctx.measure_time, ctx.device, ctx.warmup, ctx.repeats)

    @staticmethod
    @contextmanager
    def reported(ctx: TraceContext):
        """A failure while running the joint graph is a `CaptureError` that says where."""
        try:
            yield
        except (InvalidInputError, CaptureError):
            raise
        except Exception as e:  # noqa: BLE001
            raise CaptureError(f"running the joint graph of {ctx.name} failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from e

    def assemble(self, ctx: TraceContext) -> tuple[list[Node], list[tuple[int, int]], dict]:
        cap, prog, profs = ctx.state["cap"], ctx.state["program"], ctx.state["profiles"]
        nodes = []
        for g, (members, kind, p) in enumerate(zip(prog.groups, prog.kinds, profs)):
            head = members[0]
            t = ctx.flops_model.time(p.flops, p.alloc_bytes) if ctx.flops else p.time
            extra: dict = {"ops": [n.name for n in members],
                           "op": str(getattr(head.target, "__name__", head.target))}
            if ctx.flops:
                extra["flops"] = p.flops
            if prog.random[g]:
                extra["random"] = True
            grads = [fqn for _, k, fqn in prog.sinks[g] if k == "grad"]
            bufs = [fqn for _, k, fqn in prog.sinks[g] if k == "buffer"]
            if grads:
                extra["param_grads"] = grads
            if bufs:
                extra["mutates"] = bufs
            if p.scratch:
                extra["scratch_bytes"] = int(p.scratch)
            node_name = "loss" if kind == "loss" else head.name
            if prog.part_of[g] is not None:  # a later part of an op: its tensor only (`remat.core.graph`)
                nodes.append(Node(g, node_name, kind, 0.0, int(p.bytes), 0, extra, part_of=prog.part_of[g]))
                continue
            ws, persistent = p.workspace, 0
            if ctx.grads == "accumulated":
                # the gradients it makes become fresh .grad tensors that stay: the value itself
                # (in the workspace while it runs) or a copy made beside it
                ws, persistent = p.workspace + p.grad_bytes - p.grad_stolen, p.grad_bytes
            nodes.append(Node(g, node_name, kind, float(t), int(p.bytes), int(ws), extra,
                              persistent_bytes=int(persistent)))
        edges = [(p, g) for g, ps in enumerate(prog.preds) for p in ps]
        fx_ops = sum(1 for n in cap.gm.graph.nodes if n.op == "call_function")
        log.info("joint graph of %s: %d fx ops -> %d nodes (%d forward, %d backward)", ctx.name, fx_ops, len(nodes),
                 prog.kinds.count("forward"), prog.kinds.count("backward"))
        return nodes, edges, {
            "depth": None,
            "capture": CAPTURE_METHOD,
            "backward_edges": "saved",
            "capture_notes": list(cap.notes),
            "rng_nodes": [g for g in range(len(nodes)) if prog.random[g]],
            "buffer_mutations": {nodes[g].name: [f for _, k, f in prog.sinks[g] if k == "buffer"]
                                 for g in range(len(nodes)) if any(k == "buffer" for _, k, _ in prog.sinks[g])},
            "joint": {"static": [n.name for n in prog.static], "loss": cap.loss.name,
                      "seed": prog.seed.name if prog.seed is not None else None, "fx_ops": fx_ops},
        }


def trace_joint(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable | None = None, profile: str = "flops",
                device: "str | torch.device | None" = None, repeats: int | None = None, *, warmup: int = 1,
                example_kwargs: dict | None = None, optimizer: str | None = None, name: str | None = None,
                flops_model: FlopsModel | None = None, grads: str = "accumulated") -> Graph:
    """Trace and profile one training step of `model` as a joint forward+backward op graph.

    Arguments as `remat.trace` (``granularity="joint"``); `profile` is ``"flops"`` (deterministic,
    the default here) or ``"measure"``.  Returns a `Graph` whose nodes are described in the module
    docstring.  Raises `InvalidInputError` for bad input and `CaptureError` when aot_export_module
    cannot capture the model (the message says why).
    """
    frontend = JointFrontend()
    ctx = prepare(frontend, model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn, profile=profile,
                  device=device, repeats=repeats, warmup=warmup, optimizer=optimizer, name=name,
                  flops_model=flops_model, grads=grads)
    return trace_with(frontend, ctx)


def program_from_graph(cap: JointCapture, graph: Graph) -> JointProgram:
    """Rebuild a traced graph's `JointProgram` on a fresh capture, by fx node names; raises
    `InvalidInputError` (re-plan) when the capture has other ops."""
    by_name = cap.nodes_by_name
    jmeta = graph.meta.get("joint") or {}
    try:
        groups = [[by_name[name] for name in v.extra["ops"]] for v in graph.nodes]
        static = [by_name[name] for name in jmeta.get("static", [])]
    except KeyError as e:
        raise InvalidInputError(f"remat.apply: the model's joint graph has no op {e.args[0]!r} that the plan names: "
                                "the plan belongs to another model/batch shape or torch version; re-plan "
                                "(remat.trace(..., granularity='joint'), remat.plan)") from None
    ops = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    covered = sum(len(m) for m in groups) + len(static)
    if covered != len(ops) or jmeta.get("loss") not in (None, cap.loss.name):
        raise InvalidInputError(f"remat.apply: the model's joint graph has {len(ops)} ops, the plan covers {covered} "
                                "(or names another loss): the plan belongs to another model/batch shape; re-plan")
    return build_program(cap, groups, static, [v.kind for v in graph.nodes], [v.part_of for v in graph.nodes])


__all__ = ["JointFrontend", "trace_joint", "capture_joint", "JointCapture", "JointProgram", "build_program", "discover_groups",
           "profile_program", "program_from_graph", "placeholder_values", "CAPTURE_METHOD"]
