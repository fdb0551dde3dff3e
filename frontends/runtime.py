"""What every executor of a plan shares: the planned-step module and the state of one step.

A planned step is one ``torch.autograd.Function`` (`Step`): its forward performs the plan's ops up
to and including ``compute loss``, its backward the rest; `PlannedBase` is the module around it
(``planned(*inputs) -> loss``): the checks that the plan belongs to the model and its inputs
(parameter fingerprint, input shapes), the split of the plan's ops at the loss, and the host
transfers (`transfer.Transfers`: a pinned pool and a side stream on CUDA).  `RunBase` is the state
of one step: host copies and pending transfers (``wait``), the RNG states of random nodes (a
recomputation replays its first run's), the end of the step.  Each executor provides how to
capture the model (`PlannedBase._prepare`) and how to run a node (`RunBase.run_compute`,
``free``, ``swap_out``, ``swap_in``): `executor` at module granularity, `joint_executor` over a
joint graph.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten

from remat.core.errors import InvalidInputError
from remat.core.plan import Plan

from .base import default_loss, input_shapes, model_fingerprint, split_inputs, step_loss
from .transfer import Transfers

SWAP_MESSAGE = ("remat.apply: the plan swaps a {kind} node ({name}); the executor swaps forward nodes only "
                "(gradients go straight to their consumers): re-plan with remat's solvers, which keep to that rule")


class PlannedBase(torch.nn.Module):
    """What every planned-step module shares (this module's `PlannedStep`, the joint graph's
    `PlannedJointStep`): the checks that the plan belongs to the model and its inputs, the split
    of the plan's ops at the loss, the host transfers, and ``planned(*inputs) -> loss``.  A
    subclass provides ``_prepare(args, kwargs)`` (capture the model; call `_check_model` and
    `_split_ops`) and ``_new_run(args, flat_inputs, transfers)`` (the state of one step)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, example_inputs: Any = None, loss_fn: Callable | None = None,
                 example_kwargs: dict | None = None):
        super().__init__()
        self.model = model
        self.plan = plan
        self.loss_fn = loss_fn or default_loss
        for o in plan.schedule.ops:
            if o.op in ("swap_out", "swap_in") and plan.graph.nodes[o.node].kind != "forward":
                v = plan.graph.nodes[o.node]
                raise NotImplementedError(SWAP_MESSAGE.format(kind=v.kind, name=v.name))
        self._transfers: Transfers | None = None
        # called after every op of the plan with (op, index): a probe for tests and tools that
        # follow a step op by op (device bytes after each op, say); None in normal use
        self.on_op: Callable | None = None
        self._ready = False
        if example_inputs is not None or example_kwargs is not None:
            self._prepare(*split_inputs(example_inputs, example_kwargs))

    def _check_model(self, args: tuple, kwargs: dict) -> None:
        """The plan was made for this model (parameter fingerprint) and these input shapes."""
        model, meta = self.model, self.plan.graph.meta
        shapes = input_shapes(args, kwargs)
        if meta.get("model_fingerprint") is not None and meta["model_fingerprint"] != model_fingerprint(model):
            raise InvalidInputError(
                f"remat.apply: the plan was made for a model with other parameters or buffers (fingerprint "
                f"{meta['model_fingerprint']}, this model's is {model_fingerprint(model)}; names, shapes and dtypes "
                f"are compared): the plan belongs to another model; re-plan (remat.trace, remat.plan)")
        if meta.get("input_shapes") is not None and meta["input_shapes"] != shapes:
            raise InvalidInputError(f"remat.apply: the plan was made for inputs of shapes {meta['input_shapes']}, "
                                    f"these have {shapes}: the plan belongs to another model/batch shape; re-plan")
        self._shapes = shapes

    def _split_ops(self, loss_id: int) -> None:
        """The step's forward performs the plan's ops up to the loss's compute, its backward the rest."""
        ops = self.plan.schedule.ops
        split = next((k for k, o in enumerate(ops) if o.op == "compute" and o.node == loss_id), None)
        if split is None:
            raise InvalidInputError("remat.apply: the plan never computes the loss node")
        self._fwd_ops, self._bwd_ops = ops[:split + 1], ops[split + 1:]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled() or not self.model.training:
            return step_loss(self.model, self.loss_fn, args, kwargs, self.plan.graph.meta.get("model_inputs"))
        if not self._ready:  # no example inputs given: the first batch is the example
            self._prepare(args, kwargs)
        flat = [t for t in tree_flatten((args, kwargs))[0]]
        shapes = [list(t.shape) for t in flat if isinstance(t, torch.Tensor)]
        if shapes != self._shapes:
            raise InvalidInputError(f"remat.apply: the plan was made for inputs of shapes {self._shapes}, got "
                                    f"{shapes}; re-plan for this batch shape")
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise InvalidInputError("remat.apply: the model has no parameter that requires grad")
        device = params[0].device
        if self._transfers is None or self._transfers.device != device:
            self._transfers = Transfers(device)
        return Step.apply(self._new_run(args, flat, self._transfers), *params)

    @property
    def host_peak_bytes(self) -> int:
        """Host bytes the last step's swap-outs held (what the plan predicts as host_peak_bytes)."""
        return self._transfers.pool.peak if self._transfers is not None else 0


class RunBase:
    """What the state of every planned step shares: host copies and pending transfers (`wait`),
    the RNG states of random nodes (`rng_of`), and the end of the step (`end`)."""

    def __init__(self, step: PlannedBase, transfers: Transfers):
        self.step = step
        self.transfers = transfers
        self.device = transfers.device
        transfers.pool.reset_peak()
        self.host: dict[int, Any] = {}         # swapped-out node -> its host copy
        self.pending: dict[int, Any] = {}      # node -> event of its last transfer not yet waited for
        self.rng: dict[int, tuple] = {}
        self.computed: set[int] = set()
        self._handlers = {"compute": self.run_compute, "free": self.free, "swap_out": self.swap_out,
                          "swap_in": self.swap_in, "wait": self.wait}

    def wait(self, v: int | None) -> None:
        """The compute stream waits for v's last transfer (``wait v``, or before a use of v)."""
        if v is not None and v in self.pending:
            self.transfers.wait(self.pending.pop(v))

    @contextlib.contextmanager
    def rng_of(self, v: int, random: bool) -> Iterator[None]:
        """Run node v: a random node's first run records the CPU (and, on CUDA, the device's)
        generator state; a recomputation runs with that state and leaves the generators as
        they were."""
        if not random:
            yield
            return
        cuda = [self.device] if self.device.type == "cuda" else []
        if v not in self.computed:
            self.rng[v] = (torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda))
            yield
            return
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            torch.set_rng_state(self.rng[v][0])
            for d, state in zip(cuda, self.rng[v][1:]):
                torch.cuda.set_rng_state(state, d)
            yield

    def run_op(self, op) -> None:
        """Perform one op of the plan; `run_compute` and `free` are each executor's own."""
        handler = self._handlers.get(op.op)
        if handler is None:
            if op.op in ("inline", "into"):   # (`remat.core.compiled`: inductor's kernels run those)
                raise NotImplementedError(f"remat.apply: op {op.op!r} is a compiled program's (remat.compiler runs "
                                          "it through inductor); plan with executor='any' or 'native' to apply it")
            raise RuntimeError(f"remat.apply: unknown op {op.op!r}")
        handler(op.node)

    def forward_ops(self) -> None:
        """Perform the step's ops up to the loss's compute (an executor may run them its own way)."""
        run_ops(self, self.step._fwd_ops)

    def backward_ops(self) -> None:
        """Perform the step's ops after the loss's compute."""
        run_ops(self, self.step._bwd_ops, len(self.step._fwd_ops))

    def end(self) -> None:
        self.host.clear()
        self.pending.clear()
        self.transfers.end_step()


def run_ops(run: Any, ops: list, first: int = 0) -> None:
    """Perform `ops` on `run` in order, calling the step's ``on_op`` probe after each."""
    probe = run.step.on_op
    for k, op in enumerate(ops):
        run.run_op(op)
        if probe is not None:
            probe(op, first + k)


class Step(torch.autograd.Function):
    """A whole planned step as one autograd node: its forward performs the plan's ops up to the
    loss, its backward the rest.  `run` (a `_Run`, or the joint executor's) provides
    ``forward_ops()``, ``backward_ops()``, ``loss_value``, ``start_backward(grad_loss)`` and ``end()``."""

    @staticmethod
    def forward(ctx, run: Any, *params):
        run.forward_ops()
        ctx.run = run
        return run.loss_value.detach()

    @staticmethod
    def backward(ctx, grad_loss):
        run = ctx.run
        ctx.run = None
        run.start_backward(grad_loss)
        run.backward_ops()
        run.end()
        return (None,) * len(ctx.needs_input_grad)


__all__ = ["PlannedBase", "RunBase", "Step", "run_ops", "SWAP_MESSAGE"]
