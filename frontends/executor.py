r"""Running a module-granularity plan: ``loss = planned(*inputs); loss.backward()`` as the plan says.

The model is captured and cut into stages exactly as `remat.trace` did (granularity, depth and
capture method from ``plan.graph.meta``), and the stage names, count and order must equal the
plan's forward nodes.  ``loss = planned(*inputs); loss.backward()`` then trains as plain autograd
would, but runs the plan's ops (docs/design.md, "Op semantics"):

* ``compute v`` (forward node): run stage v's ATen ops with grad enabled on *detached* inputs,
  so what autograd saves lives in v's own small graph;
* ``free v``: drop the references to v's outputs (and v's graph when it holds tensors of its
  own; a graph that only refers to its inputs and outputs is kept for v's backward);
* ``compute v`` again (recompute): rerun stage v with the RNG state of its first compute, and
  with copies of the buffers it writes (BatchNorm running statistics are updated once a step);
* ``compute loss``: the loss function on the model's output, forward in the step's forward,
  backward first thing in the step's backward;
* ``compute b_v`` (backward node): ``torch.autograd.grad`` through v's graph with the incoming
  gradients of v's outputs; parameter gradients are accumulated into ``.grad`` as plain
  autograd does (``+=`` into an existing gradient), input gradients feed the producers.

What makes ``free`` real: a saved tensor that is one of the stage's inputs or outputs is
packed (``saved_tensors_hooks``, detached) as a reference to that value and looked up when the
backward unpacks it, in whatever copy is resident then (the first one, or a recomputation); and
an activation enters a stage through `_Entry`, an identity whose backward hands the gradient to
the step, so no autograd leaf keeps the producer's storage alive.  So a stage's graph holds only
what autograd saved inside it, which is what the plan counts as its bytes.  On the CPU the
measured peak (`measure_peak`) equals the predicted one to a few bytes.

Swap ops (forward nodes only, the solvers' executability rule) move what ``free`` would drop:
* ``swap_out v``: start copying, storage by storage, v's outputs and the tensors its graph saved
  of its own to host buffers (`transfer.Transfers`: pinned and reused, a side stream and events
  on CUDA; synchronous and counted as host on the CPU).  Outputs that are views of v's inputs
  are not copied: they are recorded as views and rebuilt from the input on the way back.
* ``free v`` after a swap-out: the device copies go, v's graph stays (its saved tensors now
  live on the host);
* ``swap_in v``: allocate device storages, start the copies back, rebuild v's outputs and
  saved tensors as views of them; ``wait v`` (or the first use of v) makes the compute stream
  wait for the copy.  Host copies live until the step ends (as the simulator counts them).

The whole step is one ``torch.autograd.Function`` (`runtime.Step`): its forward runs the ops up to
the loss, its backward the rest.  Random stages replay their RNG state (the CPU's, and the device's on CUDA).
In eval mode or under ``torch.no_grad()`` the plain model runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.core.errors import InvalidInputError

from .base import model_inputs
from .capture import EAGER, capture
from .measuring import storage_key
from .profile import release_plan, run_nodes, writes_of
from .runtime import PlannedBase, RunBase
from .segments import cut
from .transfer import StorageSet, Transfers

log = logging.getLogger(__name__)


@dataclass
class _StageFn:
    """One forward node: how to run it on values looked up by fx node."""
    name: str
    inputs: list                 # fx nodes read from outside
    outputs: list                # fx nodes (or, for the loss, ["loss"])
    run: Callable[[list], list]  # inputs' values -> outputs' values
    grad_inputs: set             # positions of activation inputs whose gradient is wanted
    cloned: set                  # positions written in place (cloned before the run)
    buffers: list                # positions of buffers the stage writes (copied on recompute)
    random: bool = False
    params: list = field(default_factory=list)


@dataclass
class _Live:
    """A computed forward node: its outputs (until freed) and its graph (until its backward)."""
    outputs: dict | None                     # fx node -> tensor
    edges: list                              # (fx node, GradientEdge) of outputs requiring grad
    held: list = field(default_factory=list)       # _Saved handles of tensors the graph saved of its own
    foreign: set = field(default_factory=set)      # storage keys of the stage's activation inputs

    @property
    def owns_tensors(self) -> bool:
        """The graph holds saved tensors of its own (freeing v's outputs does not free them)."""
        return bool(self.held)


@dataclass
class _HostCopy:
    """What ``swap_out v`` moved to the host: one buffer per storage, and how to rebuild v's
    outputs and saved tensors from them (views: size, stride, offset, dtype)."""
    live: _Live
    buffers: list
    outputs: list    # (fx node, ("host", layout, requires_grad) | ("ref", input node, size, stride, offset) | ("value", x))
    handles: list    # (_Saved, layout); layouts as `StorageSet.add` returns them


class _Saved:
    """A tensor autograd saved; `refer` turns it into a reference to a stage input or output."""
    __slots__ = ("t", "node", "size", "stride", "offset")

    def __init__(self, t: torch.Tensor):
        self.t, self.node = t, None

    def refer(self, node: Any) -> None:
        t = self.t
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.node, self.t = node, None


class PlannedStep(PlannedBase):
    """``planned(*inputs) -> loss`` that runs `plan`'s ops; see the module docstring."""

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        """Capture and cut the model as `remat.trace` did; check it against the plan's graph."""
        model, plan = self.model, self.plan
        graph = plan.graph
        meta = graph.meta
        granularity = meta.get("granularity", "module")
        depth = meta.get("depth") or 1
        mode = "eager" if meta.get("capture") == EAGER else "auto"
        self._check_model(args, kwargs)
        taken_args = model_inputs(model, args, kwargs, meta.get("model_inputs"))
        snapshot = [(b, b.detach().clone()) for b in model.buffers()]
        try:
            with torch.random.fork_rng(devices=[]):
                cap = capture(model, taken_args, kwargs, mode=mode)
        finally:
            with torch.no_grad():
                for b, saved in snapshot:
                    b.copy_(saved)
        stages = cut(cap, model, granularity, depth)
        fwd = [v for v in graph.nodes if v.kind == "forward"]
        names = [s.name for s in stages]
        if names != [v.name for v in fwd]:
            diff = next((k for k, (a, b) in enumerate(zip(names, [v.name for v in fwd])) if a != b),
                        min(len(names), len(fwd)))
            raise InvalidInputError(
                f"remat.apply: the model cuts into {len(names)} stages, the plan has {len(fwd)} forward nodes "
                f"(first difference at #{diff}: {names[diff] if diff < len(names) else None!r} vs "
                f"{fwd[diff].name if diff < len(fwd) else None!r}): the plan belongs to another model/batch "
                "shape; re-plan (remat.trace, remat.plan)")
        # every call brings its own inputs (`_new_run`): the example's tensors are not kept (on a
        # device they stayed resident beside each batch, one batch more than the plan counts)
        for node, kind in cap.kinds.items():
            if kind == "input":
                cap.values[node] = None
        # the capture's input positions count the model's inputs; a batch's flat inputs also hold
        # the loss's own (labels) between the model's positional inputs and the keyword ones
        taken = len(tree_flatten(taken_args)[0])
        skipped = len(tree_flatten(args)[0]) - taken
        self._flat_index = {node: cap.targets[node] + (skipped if cap.targets[node] >= taken else 0)
                            for node, kind in cap.kinds.items() if kind == "input"}
        self._cap = cap
        self._m = len(stages)
        self._loss_id = next(v.id for v in graph.nodes if v.kind == "loss")
        self._fwd_of = {v.id: v.extra["forward"] for v in graph.nodes if v.kind == "backward"}
        if self._loss_id != self._m or any(v.id != k for k, v in enumerate(fwd)):
            raise InvalidInputError("remat.apply: the plan's graph does not number forward nodes 0..m-1 and "
                                    "the loss m, as remat.trace does; re-trace the model")
        self._producer = {o: j for j, s in enumerate(stages) for o in s.outputs}
        self._fns = [self._stage_fn(s, fwd[j].extra.get("random", False), bool(fwd[j].extra.get("mutates")))
                     for j, s in enumerate(stages)]
        self._fns.append(self._loss_fn_stage())
        self._split_ops(self._loss_id)
        self._ready = True

    # ---- stages ---------------------------------------------------------------------------
    def _stage_fn(self, s, random: bool, mutates: bool) -> _StageFn:
        cap = self._cap
        written = {w for n in s.nodes for w in writes_of(n)}
        grad_inputs, cloned, buffers, params = set(), set(), [], []
        for k, i in enumerate(s.inputs):
            kind = cap.kinds.get(i)
            if kind is None:
                grad_inputs.add(k)  # kept only if the value requires grad at run time
            if kind == "buffer" and mutates:
                # the trace saw this stage change a buffer (aten.batch_norm's schema does not say so)
                buffers.append(k)
            elif i in written and kind != "buffer":
                cloned.add(k)
            if kind == "parameter":
                params.append(k)
        nodes, outputs = list(s.nodes), list(s.outputs)
        release = release_plan(nodes, outputs)
        inputs = list(s.inputs)

        def run(values: list) -> list:
            local = run_nodes(nodes, dict(zip(inputs, values)), release)
            return [local[o] for o in outputs]
        return _StageFn(s.name, inputs, outputs, run, grad_inputs, cloned, buffers, random, params)

    def _loss_fn_stage(self) -> _StageFn:
        cap = self._cap
        out_nodes = [o for o in cap.outputs if isinstance(o, fx.Node)]

        def run(values: list) -> list:
            it = iter(values)
            flat = [next(it) if isinstance(o, fx.Node) else o for o in cap.outputs]
            loss = self.loss_fn(tree_unflatten(flat, cap.out_spec), *self._args)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise InvalidInputError("loss_fn must return a scalar tensor")
            return [loss]
        return _StageFn("loss", out_nodes, ["loss"], run, set(range(len(out_nodes))), set(), [])

    # ---- the step -------------------------------------------------------------------------
    def _new_run(self, args: tuple, flat: list, transfers: Transfers) -> "_Run":
        env = {}
        for node, kind in self._cap.kinds.items():
            env[node] = flat[self._flat_index[node]] if kind == "input" else self._cap.values[node]
        self._args = args
        return _Run(self, env, transfers)


class _Run(RunBase):
    """The state of one step: resident values, graphs, gradients, RNG states."""

    def __init__(self, step: PlannedStep, env: dict, transfers: Transfers):
        super().__init__(step, transfers)
        self.const = env               # placeholders: parameters, buffers, inputs, constants
        self.anchor = torch.zeros((), requires_grad=True)
        self.static = {t.untyped_storage()._cdata for t in env.values() if isinstance(t, torch.Tensor)}
        self.live: dict[int, _Live] = {}
        self.grads: dict = {}          # fx node -> gradient of that value
        self.loss_live: _Live | None = None
        self.loss_value: torch.Tensor | None = None

    # values
    def _resident(self, node: Any) -> Any:
        """The value of `node` if it is resident now (a placeholder, or a live output), else None."""
        if node in self.const:
            return self.const[node]
        lv = self.live.get(self.step._producer.get(node))
        return lv.outputs.get(node) if lv is not None and lv.outputs is not None else None

    def value(self, node: Any) -> torch.Tensor:
        if node in self.const:
            return self.const[node]
        j = self.step._producer.get(node)
        self.wait(j)
        lv = self.live.get(j)
        if lv is None or lv.outputs is None:
            raise RuntimeError(f"remat.apply: {node.name} (output of {self.step._fns[j].name if j is not None else '?'}) "
                               "is needed but not resident: the plan does not match what autograd saved")
        return lv.outputs[node]

    def free(self, v: int) -> None:
        if v < self.step._m:
            lv = self.live.get(v)
            if lv is not None:
                lv.outputs = None
                hc = self.host.get(v)
                if hc is not None and hc.live is lv:
                    for h, _ in hc.handles:   # on the host now; the graph stays for v's backward
                        h.t = None
                elif lv.owns_tensors:
                    del self.live[v]

    def run_compute(self, v: int) -> None:
        s = self.step
        if v < s._m or v == s._loss_id:
            self.compute(v)
        else:
            self.backward(s._fwd_of[v])

    def compute(self, v: int) -> None:
        fn = self.step._fns[v]
        first = v not in self.computed
        values, leaves = [], []  # leaves: (input node, storage key)
        for k, i in enumerate(fn.inputs):
            x = self.value(i)
            if isinstance(x, torch.Tensor):
                leaves.append((i, x.untyped_storage()._cdata))
            if k in fn.grad_inputs and isinstance(x, torch.Tensor):
                if x.requires_grad and x.is_floating_point():
                    with torch.enable_grad():
                        x = _Entry.apply(self.anchor, x.detach(), self._sink(i))
                else:
                    x = x.detach()
            if isinstance(x, torch.Tensor) and (k in fn.cloned or (not first and k in fn.buffers)):
                x = x.clone()  # a recomputation leaves the running statistics alone
            values.append(x)
        saved: list[_Saved] = []

        def pack(t: torch.Tensor) -> "_Saved":
            # detached: a saved output holding its own grad_fn would be a reference cycle
            # through C++ that keeps the stage's graph alive after `free`
            h = _Saved(t.detach())
            saved.append(h)
            return h

        def unpack(h: "_Saved") -> torch.Tensor:
            if h.t is not None:
                return h.t
            if h.node is None:
                raise RuntimeError(f"remat.apply: the backward of {fn.name} needs a tensor it saved, which was "
                                   "swapped out and not swapped in: the plan does not match what autograd saved")
            x = self.value(h.node).detach()
            if x.size() == h.size and x.stride() == h.stride and x.storage_offset() == h.offset:
                return x
            return x.as_strided(h.size, h.stride, h.offset)

        with self.rng_of(v, fn.random), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            outs = fn.run(values)
        del values
        self.computed.add(v)
        outputs = dict(zip(fn.outputs, outs))
        # a saved tensor that is an input or an output of the stage: a reference to that value,
        # resolved when the backward unpacks it (in whatever copy is resident then)
        refs: dict = {}
        for i, key in leaves:
            refs.setdefault(key, i)
        for n, o in outputs.items():
            if isinstance(o, torch.Tensor):
                refs.setdefault(o.untyped_storage()._cdata, n)
        held = []
        for h in saved:
            key = h.t.untyped_storage()._cdata
            node = refs.get(key)
            if node is None:
                if key not in self.static:  # parameters, buffers, inputs: resident anyway
                    held.append(h)
            else:
                h.refer(node)
        del saved
        edges = [(n, torch.autograd.graph.get_gradient_edge(o)) for n, o in outputs.items()
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        lv = _Live(outputs, edges, held, {key for _, key in leaves})
        if v == self.step._loss_id:
            self.loss_live = lv
            self.loss_value = outs[0]
        else:
            self.live[v] = lv

    def _sink(self, node: Any) -> Callable[[torch.Tensor], None]:
        def sink(g: torch.Tensor) -> None:
            old = self.grads.get(node)
            self.grads[node] = g if old is None else old + g
        return sink

    def backward(self, v: int, lv: _Live | None = None) -> None:
        """Backward node b_v: input gradients reach `grads` through the stage's `_Entry` nodes,
        parameter gradients accumulate into ``.grad`` one by one, as plain autograd does."""
        if lv is None:
            self.wait(v)
            lv = self.live.get(v)
        if lv is None:
            raise RuntimeError(f"remat.apply: the backward of {self.step._fns[v].name} runs but its graph was "
                               "freed and not recomputed: the plan does not match what autograd saved")
        pairs = [(e, self.grads[n]) for n, e in lv.edges if n in self.grads]
        fn = self.step._fns[v]
        params = [p for p in (self.const[fn.inputs[k]] for k in fn.params) if p.requires_grad]
        # from here on v's graph alone holds what it saved of its own, so the engine frees each
        # saved tensor right after the autograd node that uses it, as plain autograd does (and as
        # the profiler measured the backward's workspace); held until `free v`, they would stay
        # alive under the gradients of the rest of v's backward, above the plan
        lv.held = []
        hc = self.host.get(v)
        if hc is not None and hc.live is lv:
            hc.handles = []
        del hc
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs], inputs=params + [self.anchor])
        del pairs
        for n, _ in lv.edges:
            self.grads.pop(n, None)
        lv.edges = []
        if v < self.step._m and lv.outputs is None:
            self.live.pop(v, None)


    # ---- swaps -----------------------------------------------------------------------------
    def swap_out(self, v: int) -> None:
        lv = self.live.get(v)
        if lv is None or lv.outputs is None:
            raise RuntimeError(f"remat.apply: swap_out of {self.step._fns[v].name}, which is not resident")
        moved = StorageSet()
        producer_inputs = {}
        for i in self.step._fns[v].inputs:
            x = self._resident(i)
            if isinstance(x, torch.Tensor):
                producer_inputs.setdefault(storage_key(x), i)
        outputs = []
        for n, t in lv.outputs.items():
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                # not on the device (a CPU scalar a stage returns beside CUDA tensors): nothing to move
                outputs.append((n, ("value", t)))
            elif storage_key(t) in lv.foreign or storage_key(t) in self.static:
                src = producer_inputs.get(storage_key(t))
                if src is None:
                    raise RuntimeError(f"remat.apply: swap_out of {self.step._fns[v].name}: output {n.name} is a "
                                       "view of a value that is no longer resident")
                outputs.append((n, ("ref", src, t.size(), t.stride(), t.storage_offset())))
            else:
                outputs.append((n, ("host", moved.add(t), t.requires_grad)))
        handles = [(h, moved.add(h.t)) for h in lv.held if h.t.device == self.device]
        self.wait(v)
        buffers, event = self.transfers.to_host(moved.storages)
        self.host[v] = _HostCopy(lv, buffers, outputs, handles)
        self.pending[v] = event

    def swap_in(self, v: int) -> None:
        hc = self.host.get(v)
        if hc is None:
            raise RuntimeError(f"remat.apply: swap_in of {self.step._fns[v].name}, which has no host copy")
        lv = hc.live
        if self.live.get(v) is lv and lv.outputs is not None:
            raise RuntimeError(f"remat.apply: swap_in of {self.step._fns[v].name}, which is resident")
        storages, event = self.transfers.to_device(hc.buffers)
        outputs = {}
        for n, how in hc.outputs:
            if how[0] == "value":
                outputs[n] = how[1]
            elif how[0] == "ref":
                _, src, size, stride, offset = how
                outputs[n] = self.value(src).detach().as_strided(size, stride, offset)
            else:
                _, layout, requires_grad = how
                outputs[n] = StorageSet.view(storages, layout, self.device).requires_grad_(requires_grad)
        for h, layout in hc.handles:
            h.t = StorageSet.view(storages, layout, self.device)
        lv.outputs = outputs
        self.live[v] = lv
        self.pending[v] = event

    def start_backward(self, grad_loss: torch.Tensor) -> None:
        """The loss's backward (part of the loss node) with the incoming gradient."""
        lv = self.loss_live
        self.loss_live = None
        self.grads["loss"] = grad_loss
        self.backward(self.step._loss_id, lv)
        del lv
        self.loss_value = None

    def end(self) -> None:
        self.live.clear()
        self.grads.clear()
        super().end()


class _Entry(torch.autograd.Function):
    """Where an activation enters a stage: the identity, whose backward hands the gradient to
    the step (`_Run.grads`) instead of accumulating it into a leaf.  Its `anchor` (one small
    tensor per step) makes the output require grad without keeping the input's storage."""

    @staticmethod
    def forward(ctx, anchor, x, sink):
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.sink(g)
        return None, None, None


__all__ = ["PlannedStep"]
