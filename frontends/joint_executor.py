"""Run a plan over a joint forward+backward graph (``granularity="joint"``, see `joint`).

``planned = remat.apply(model, plan, inputs)`` (which dispatches here when
``plan.graph.meta["granularity"] == "joint"``, or `apply_joint` directly) returns a module;
``loss = planned(*inputs); loss.backward()`` then trains as plain autograd would: the loss is
``loss_fn(model(*inputs), *inputs)`` (the plan's loss function, default `default_loss`) and the
backward *adds* each parameter's gradient into ``param.grad`` (setting it when it is None), as
autograd's gradient accumulation does.  Buffers (BatchNorm running statistics) are updated once.

How: the model's joint graph is captured again (aot_export_module, as `trace_joint` did; nothing
is pickled) and cut into the plan's nodes by the fx op names each node lists (``extra["ops"]``);
the plan must match (model fingerprint, input shapes, op names), else `InvalidInputError`
(re-plan).  The whole step is one ``torch.autograd.Function``: its forward performs the plan's
ops up to and including ``compute loss``, its backward the rest, as straight-line Python written
once per plan (`joint_codegen`), or op by op by this module's interpreter where the generator
refuses the plan, for steps with an ``on_op`` probe, and with ``straight_line = False`` (the two
hold the same values at every op).  No autograd graph is built: every ATen op runs under
``torch.no_grad()`` on values held in an environment:

* ``compute i``: run node i's ATen ops on its inputs' values (which must be resident) and
  keep the values other nodes read; a recomputation runs them again, random nodes with the RNG
  state recorded before their first compute (CPU, and the device's generator on CUDA);
* at the *first* compute of a node, its parameter gradients are accumulated into ``.grad``
  and its buffer updates copied into the buffers (in place, no extra memory); a value used for
  nothing else is dropped at once (the plan counts it as the node's workspace).  A later
  recomputation that reads such a buffer sees the updated value: harmless for BatchNorm in
  training mode (its normalisation and backward use the batch statistics); for anything else
  a warning is logged;
* ``free i``: drop node i's values (its storages die unless another resident value is a view
  of them, which the grouping rules out);
* the loss node holds the loss and the gradient seed ``ones_like(loss)``; the backward
  replaces the seed with the incoming gradient (so ``(2 * loss).backward()`` or a gradient
  scaler work);
* ``swap_out i``: start copying node i's values, storage by storage, to host buffers
  (`transfer.Transfers`: a reused pinned pool, a side stream and events on CUDA; synchronous
  and outside the device accounting on the CPU); ``free i`` then drops the device copies;
  ``swap_in i`` allocates device storages, starts the copies back and rebuilds the values as
  views of them; ``wait i`` (or the first use of i) makes the compute stream wait.  Only
  forward nodes are swapped (the solvers' rule); host copies live until the step ends.

In eval mode or under ``torch.no_grad()`` the plain model runs.  On the CPU the measured peak
(`measure_peak` with parameters, buffers, inputs and gradients resident) is the plan's predicted
peak up to a few bytes (the loss tensor handed to the caller and autograd's own ``ones_like``).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.fx as fx

from remat.core.errors import InvalidInputError
from remat.core.plan import Plan

from .joint import (STATIC, JointProgram, capture_joint, model_state, placeholder_values, program_from_graph,
                    steals_gradient)
from .joint_codegen import Unsupported, generate
from .runtime import PlannedBase, RunBase
from .transfer import StorageSet, Transfers

log = logging.getLogger(__name__)

class PlannedJointStep(PlannedBase):
    """``planned(*inputs) -> loss`` that runs `plan`'s ops over the joint graph; see the module docstring.
    ``code``: the plan as straight-line Python (`joint_codegen`), None where it is interpreted
    (``interpreted_because`` says why); ``straight_line = False`` interprets it anyway (and so
    does a step with an ``on_op`` probe)."""

    straight_line = True

    def __init__(self, model: torch.nn.Module, plan: Plan, example_inputs: Any = None, loss_fn: Callable | None = None,
                 example_kwargs: dict | None = None):
        if plan.graph.meta.get("granularity") != "joint":
            raise InvalidInputError("remat.apply: the plan's graph is not a joint graph (granularity "
                                    f"{plan.graph.meta.get('granularity')!r}); use remat.apply")
        super().__init__(model, plan, example_inputs, loss_fn, example_kwargs)

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        self._check_model(args, kwargs)
        cap = capture_joint(self.model, args, kwargs, self.loss_fn, self.plan.graph.meta.get("model_inputs"))
        self._prog: JointProgram = program_from_graph(cap, self.plan.graph)
        self._split_ops(self._prog.loss_id)
        try:
            self.code: tuple | None = generate(self._prog, self._fwd_ops, self._bwd_ops)
            self.interpreted_because: str | None = None
        except Unsupported as e:
            self.code, self.interpreted_because = None, str(e)
            log.info("remat.apply: the plan is interpreted op by op (%s)", e)
        self._ready = True

    def _new_run(self, args: tuple, flat: list, transfers: Transfers) -> "_JointRun":
        return _JointRun(self, [t.detach() for t in flat if isinstance(t, torch.Tensor)], transfers)


class _JointRun(RunBase):
    """The state of one step: resident values per node, RNG states, what has been applied."""

    def __init__(self, step: PlannedJointStep, flat_inputs: list, transfers: Transfers):
        super().__init__(step, transfers)   # host: swapped-out node -> (host buffers, value layouts)
        self.prog: JointProgram = step._prog
        self.model = step.model
        self.state = model_state(step.model)   # (the sinks' targets)
        self.const: dict = placeholder_values(self.prog.cap, step.model, flat_inputs, self.state)
        with torch.no_grad():
            self.prog.run_static(self.const)
        self.values: dict[int, dict] = {}
        self.stash: dict[int, dict] = {}   # later parts of the op computed last, until their computes
        self.updated: set[str] = set()     # buffers updated this step
        self.warned: set[int] = set()
        self.loss_value: torch.Tensor | None = None
        self.code = step.code if step.straight_line and step.on_op is None else None

    def forward_ops(self) -> None:
        if self.code is None:
            return super().forward_ops()
        with torch.no_grad() if torch.is_grad_enabled() else nullcontext():
            self.code[0](self, self.const)

    def backward_ops(self) -> None:
        if self.code is None:
            return super().backward_ops()
        with torch.no_grad() if torch.is_grad_enabled() else nullcontext():
            self.code[1](self, self.const)

    def lookup(self, x: fx.Node) -> Any:
        g = self.prog.group_of[x]
        if g == STATIC:
            return self.const[x]
        self.wait(g)
        vals = self.values.get(g)
        if vals is None or x not in vals:
            raise RuntimeError(f"remat.apply: {x.name} (a value of node {g}, {self.step.plan.graph.nodes[g].name}) is "
                               "needed but not resident: the plan does not follow the graph's edges")
        return vals[x]

    def free(self, g: int) -> None:
        self.values.pop(g, None)

    # ---- swaps -----------------------------------------------------------------------------
    def swap_out(self, g: int) -> None:
        vals = self.values.get(g)
        if vals is None:
            raise RuntimeError(f"remat.apply: swap_out of node {g}, which is not resident")
        self.send(g, vals)

    def send(self, g: int, vals: dict) -> None:
        """Start copying node g's values ({fx node: value}) to host buffers; they stay resident
        until ``free g``."""
        moved = StorageSet()
        layout = {n: ("host", moved.add(t)) if isinstance(t, torch.Tensor) else ("value", t) for n, t in vals.items()}
        self.wait(g)
        buffers, event = self.transfers.to_host(moved.storages)
        self.host[g] = (buffers, layout)
        self.pending[g] = event

    def swap_in(self, g: int) -> None:
        if g not in self.host:
            raise RuntimeError(f"remat.apply: swap_in of node {g}, which has no host copy")
        if g in self.values:
            raise RuntimeError(f"remat.apply: swap_in of node {g}, which is resident")
        self.values[g] = self.receive(g)

    def receive(self, g: int) -> dict:
        """Node g's values ({fx node: value}) back on the device, as views of storages whose
        copies have started (``wait g``, or the first use, waits for them)."""
        buffers, layout = self.host[g]
        storages, event = self.transfers.to_device(buffers)
        self.pending[g] = event
        return {n: StorageSet.view(storages, how[1], self.device) if how[0] == "host" else how[1]
                for n, how in layout.items()}

    def run_compute(self, g: int) -> None:
        prog = self.prog
        if g in self.values:
            raise RuntimeError(f"remat.apply: node {g} is computed while resident: the plan is not valid")
        if prog.part_of[g] is not None:  # a later part of an op: its values came with the op's leader
            vals = self.stash.pop(g, None)
            if vals is None:
                raise RuntimeError(f"remat.apply: part {g} of op {prog.part_of[g]} is computed without its op: "
                                   "the plan is not valid")
            self.values[g] = vals
            self.computed.add(g)
            return
        first = g not in self.computed
        if not first and self.updated:
            self.check_buffer_reads(g)
        # (inside the step's autograd.Function grad mode is already off; a context per node costs
        # more than most nodes' Python)
        with torch.no_grad() if torch.is_grad_enabled() else nullcontext():
            if prog.random[g]:
                with self.rng_of(g, True):
                    local = prog.run(g, self.lookup)
            else:
                local = prog.run(g, self.lookup)
            kept = prog.op_keep(g)
            for node, what, fqn in prog.sinks[g]:
                if first:
                    self.apply_sink(local[node], what, fqn, stealable=node not in kept)
                if node not in kept:
                    local.pop(node, None)
            self.stash.update(prog.take_parts(g, local))
        self.computed.add(g)
        self.values[g] = local
        if g == prog.loss_id:
            self.loss_value = local[prog.cap.loss]

    def check_buffer_reads(self, g: int) -> None:
        """A recomputation reads a buffer this step already updated: it sees the new value.  Harmless
        for BatchNorm in training mode (its output and backward use the batch statistics; only the
        running-statistics outputs differ, and they are applied once); said once otherwise."""
        for n in self.prog.groups[g]:
            if "batch_norm" in str(n.target):
                continue
            hit = [i for i in n.all_input_nodes if self.prog.cap.placeholders.get(i, ("", ""))[1] in self.updated
                   and self.prog.cap.placeholders[i][0] == "buffer"]
            if hit and g not in self.warned:
                self.warned.add(g)
                log.warning("joint executor: recomputing %s reads buffer %s after this step updated it; the "
                            "recomputation sees the updated value", n.name, self.prog.cap.placeholders[hit[0]][1])

    def apply_sink(self, value: torch.Tensor, what: str, fqn: str, stealable: bool) -> None:
        if what == "buffer":
            self.state[fqn].copy_(value)
            self.updated.add(fqn)
            return
        p = self.state[fqn]
        if p.grad is not None:
            p.grad.add_(value)       # autograd's accumulation: in place into the existing gradient
        elif steals_gradient(value, p, stealable):
            p.grad = value.detach()  # the new gradient becomes .grad, as autograd does
        else:
            p.grad = torch.empty_like(p).copy_(value)

    def start_backward(self, grad_loss: torch.Tensor) -> None:
        """Put the incoming gradient of the loss where the graph has ``ones_like(loss)``."""
        prog = self.prog
        L = prog.loss_id
        vals = self.values.get(L)
        if prog.seed is None or vals is None:
            if not bool((grad_loss == 1).all()):
                raise NotImplementedError("joint granularity: the loss's gradient is not 1 and the joint graph has no "
                                          "ones_like(loss) seed to replace")
            return
        seed = grad_loss.detach().reshape(self.loss_value.shape).to(self.loss_value.dtype).contiguous()
        with torch.no_grad():
            start = {n: v for n, v in vals.items() if n not in prog.seed_members}
            start[prog.seed] = seed
            local = prog.run(L, self.lookup, start, members=prog.seed_members)
        kept = set(prog.keep[L])
        self.values[L] = {n: v for n, v in local.items() if n in kept}

    def end(self) -> None:
        self.values.clear()
        self.stash.clear()
        self.const.clear()
        self.loss_value = None
        super().end()


def apply_joint(model: torch.nn.Module, plan: "Plan | str", example_inputs: Any = None,
                loss_fn: Callable | None = None, *, example_kwargs: dict | None = None) -> PlannedJointStep:
    """`remat.apply` for a plan over a joint graph: a module whose call runs one training step of
    `model` as `plan` says (see the module docstring).  Raises `InvalidInputError` when the plan
    belongs to another model or batch shape, NotImplementedError for plans with swap ops."""
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    return PlannedJointStep(model, plan, example_inputs, loss_fn, example_kwargs)


__all__ = ["apply_joint", "PlannedJointStep"]
