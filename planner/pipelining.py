"""Running a layer placement plan with PyTorch's pipelining engine (`torch.distributed.pipelining`).

A layer placement plan (`partitioning.layer_placement` with micro-batches) cuts the model's
forward into one contiguous run of modules a device, each run starting at a module
(``plan.search["pipeline"]["split_points"]``: the fully qualified names of the modules where
stages 1..k-1 begin).  Here each process of a group of k ranks:

* splits the model with ``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING})``
  (torch.export of one micro-batch's forward, cut before each named module) and builds its stage
  (`Pipe.build_stage`): its own modules' parameters, the activations of the stage before it
  received, its outputs sent on (point-to-point sends over the process group);
* runs the plan's schedule over ``microbatches`` micro-batches of the batch (`ScheduleGPipe`:
  every micro-batch's forward, then every backward; `Schedule1F1B`: at most ``k - s`` micro-batches
  in flight on stage ``s``), the loss on the last stage;
* sums the gradient of a parameter that several stages hold (a tied embedding and language-model
  head: `pipeline` gives each stage that reads it a copy) over those stages, as one process
  accumulates the contributions of its readers.

The step's loss over micro-batches is one process's loss on the whole batch only when the loss
is the sum or the mean of the micro-batches' losses and nothing couples the examples of a
micro-batch (batch norm's statistics do): `loss_reduction` finds which, on the example batch,
and says when it is neither.  With a sum the micro-batches' gradients are added
(``scale_grads=False``), with a mean averaged (``scale_grads=True``).

`SendCounter` counts the bytes each rank sends (the tensors of the stage's send operations: a
micro-batch's activations forward, their gradients back, and the tied parameters' all-reduces),
the measure the plan's ``comm_bytes`` predicts.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from remat.core.errors import InvalidInputError

SCHEDULES = ("gpipe", "1f1b")


def _chunks(batch: tuple, n: int) -> list[tuple]:
    """The batch's tensors cut into `n` micro-batches along dimension 0 (others repeated)."""
    sizes = {t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise InvalidInputError("pipelining: the batch's tensors must share their first (batch) dimension to be cut "
                                "into micro-batches")
    size = sizes.pop()
    if size % n:
        raise InvalidInputError(f"pipelining: a batch of {size} does not split into {n} equal micro-batches; "
                                f"choose --microbatches dividing {size}")
    parts = [t.chunk(n) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * n for t in batch]
    return [tuple(p[k] for p in parts) for k in range(n)]


def loss_reduction(step: Callable[[tuple], torch.Tensor], batch: tuple, microbatches: int) -> str:
    """"sum" or "mean": how the step's loss on the whole batch (``step(batch)``) is made of its
    losses on `microbatches` micro-batches, checked on `batch` without gradients (module
    docstring); `InvalidInputError` when it is neither."""
    if microbatches == 1:
        return "sum"
    with torch.no_grad(), torch.random.fork_rng():
        whole = float(step(batch))
        parts = []
        for mb in _chunks(batch, microbatches):
            try:
                parts.append(float(step(mb)))
            except (RuntimeError, ValueError) as e:
                raise InvalidInputError(f"pipelining: the step fails on a micro-batch of {len(mb[0])} "
                                        f"({str(e).splitlines()[0]}); use fewer micro-batches") from None
    tol = 1e-4 * max(1.0, abs(whole))
    if abs(sum(parts) - whole) <= tol:
        return "sum"
    if abs(sum(parts) / microbatches - whole) <= tol:
        return "mean"
    raise InvalidInputError(f"pipelining: the step's loss on the whole batch ({whole:.6g}) is neither the sum "
                            f"({sum(parts):.6g}) nor the mean of its losses on {microbatches} micro-batches (batch "
                            "norm's statistics, or a loss that couples the examples): micro-batches would change the "
                            "step; use --microbatches 1 --schedule gpipe")


class SendCounter:
    """Bytes this rank sends point to point in a pipeline stage's schedule: wraps the stage's
    ``get_fwd_send_ops`` / ``get_bwd_send_ops`` (the operations the schedule posts) and sums
    their tensors' bytes; ``add`` counts a collective of our own (a tied parameter's all-reduce)."""

    def __init__(self, stage: Any):
        self.bytes = 0
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            setattr(stage, name, self._counted(getattr(stage, name)))

    def _counted(self, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> list:
            ops = fn(*args, **kwargs)
            for op in ops:
                self.bytes += op.tensor.numel() * op.tensor.element_size()
            return ops
        return wrapped

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes


def canonical_names(model: torch.nn.Module) -> dict:
    """{every name of a parameter: its first name} (a tied parameter's names map to one)."""
    first: dict = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _late_inputs(pipe: Any) -> list:
    """[(stage, placeholder name)] for the model's inputs a stage after the first reads."""
    out = []
    for n in pipe.split_gm.graph.nodes:
        if n.op == "call_module" and n.target != "submod_pp_0" and str(n.target).startswith("submod_pp_"):
            stage = int(str(n.target).rsplit("_", 1)[1])
            out += [(stage, a.name) for a in n.all_input_nodes if a.op == "placeholder"]
    return out


class PipelinedStep:
    """This rank's stage of a layer placement plan and its schedule (module docstring), built once
    (``pipeline`` exports the model) and run by ``step(batch)`` any number of times.

    `model_inputs`: how many of the batch's tensors the model takes (the rest are the loss's:
    at most one, the target the schedule cuts with the batch).  `loss_fn(output, *batch)` as in
    ``remat.trace``; on the last stage the model's own inputs are not there and are passed as
    None."""

    def __init__(self, model: torch.nn.Module, batch: tuple, plan: Any, rank: int, world: int,
                 device: torch.device, loss_fn: Callable | None = None, model_inputs: int | None = None):
        import torch.distributed as dist
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

        from remat.frontends.base import default_loss, model_inputs as inputs_of, step_loss
        spec = plan.search.get("pipeline")
        if not spec:
            raise InvalidInputError("pipelining: the plan is not a layer placement with micro-batches; partition "
                                    "with --pipeline")
        if world != plan.devices:
            raise InvalidInputError(f"pipelining: the plan is for {plan.devices} devices; this process group has "
                                    f"{world}: launch {plan.devices} processes")
        self.microbatches, self.schedule_name = int(spec["microbatches"]), spec["schedule"]
        self.plan_stage = spec["stages"][rank]
        self.rank, self.world, self.device = rank, world, device
        loss_fn = loss_fn or default_loss
        n_in = len(inputs_of(model, batch, None, model_inputs))
        self.n_in = n_in
        extra = len(batch) - n_in
        if extra > 1:
            raise InvalidInputError(f"pipelining: the loss takes {extra} tensors besides the model's inputs; the "
                                    "schedule passes one (the target) to the last stage")
        self.reduction = loss_reduction(lambda b: step_loss(model, loss_fn, b, None, n_in), batch, self.microbatches)
        mb = _chunks(batch, self.microbatches)[0]
        split_spec = {fqn: SplitPoint.BEGINNING for fqn in spec["split_points"]}
        try:
            pipe = pipeline(model, mb_args=tuple(mb[:n_in]), split_spec=split_spec)
        except Exception as e:  # noqa: BLE001  (torch.export's own message, on one line)
            raise InvalidInputError(f"pipelining: torch.distributed.pipelining could not split the model at "
                                    f"{', '.join(spec['split_points'])}: {str(e).splitlines()[0]}") from None
        late = _late_inputs(pipe)
        if late:
            raise InvalidInputError(f"pipelining: stage {late[0][0]} reads the model's input {late[0][1]!r}, and the "
                                    "schedule gives the batch to the first stage only; let the loss take it (pass "
                                    "loss_fn and model_inputs)")
        if pipe.num_stages != world:
            raise InvalidInputError(f"pipelining: splitting at {', '.join(spec['split_points'])} made {pipe.num_stages} "
                                    f"stages, not {world}")
        self.stage = pipe.build_stage(rank, device)
        self.module = pipe.get_stage_module(rank)
        self.counter = SendCounter(self.stage)

        def last_loss(out: Any, target: Any) -> torch.Tensor:
            rest = () if extra == 0 else (target,)
            return loss_fn(out, *([None] * n_in), *rest)
        make = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        self.schedule = make(self.stage, self.microbatches, loss_fn=last_loss,
                             scale_grads=self.reduction == "mean")
        # a tied parameter (several names, one tensor in the model): `pipeline` gives each stage
        # that holds it a copy; its gradient is summed over the copies and their stages
        self.canonical = canonical_names(model)
        self.copies: dict = {}      # the model's name -> this stage's parameters of that name
        for name, p in self.parameters().items():
            self.copies.setdefault(self.canonical.get(name, name), {})[id(p)] = p
        mine = sorted(self.copies)
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        self.shared: dict = {}      # canonical name -> (its process group, or None for all ranks; holders)
        for name in sorted({n for part in every for n in part}):
            holders = [r for r in range(world) if name in every[r]]
            if len(holders) < 2:
                continue
            group = dist.new_group(holders) if len(holders) < world else None  # (collective: on every rank)
            if rank in holders:
                self.shared[name] = (group, len(holders))

    def parameters(self) -> dict:
        """{name: parameter} of this rank's stage, every name of a tied parameter's copies."""
        return dict(self.module.named_parameters(remove_duplicate=False))

    def inputs(self, batch: tuple) -> list:
        """The tensors of `batch` this rank gives its schedule (the model's inputs on the first
        stage, the loss's target on the last), for a meter to count as resident."""
        ins, rest = batch[:self.n_in], batch[self.n_in:]
        return ([t for t in ins if isinstance(t, torch.Tensor)] if self.stage.is_first else []) + \
            (list(rest) if self.stage.is_last else [])

    def buffers(self) -> list:
        """The receive buffers the stage keeps between steps (one per micro-batch and received
        activation or arriving gradient; made at the first step), for a meter to count as
        resident."""
        out = []
        for infos in list(self.stage.args_recv_info.values()) + list(self.stage.grad_recv_info.values()):
            out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
        return out

    def gradients(self) -> dict:
        """{the model's name of a parameter (a tied one's first name): its gradient} for this
        stage's parameters, after `step`."""
        out = {}
        for name, p in self.parameters().items():
            if p.grad is not None:
                out.setdefault(self.canonical.get(name, name), p.grad)
        return out

    def step(self, batch: tuple) -> float | None:
        """One step on this rank: gradients into the stage's parameters' ``.grad`` (set to None
        first), the tied ones summed over their stages; the loss on the last stage (the sum or
        mean of the micro-batches' losses, as the step's own), None elsewhere."""
        import torch.distributed as dist
        for p in self.module.parameters():
            p.grad = None
        ins, rest = batch[:self.n_in], batch[self.n_in:]
        target = rest[0] if rest else torch.zeros(batch[0].shape[0], device=self.device)
        losses: list = []
        if self.stage.is_first and self.stage.is_last:
            self.schedule.step(*ins, target=target, losses=losses, return_outputs=False)
        elif self.stage.is_first:
            self.schedule.step(*ins)
        elif self.stage.is_last:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step()
        for name, (group, n) in self.shared.items():
            ps = list(self.copies[name].values())
            total = sum((p.grad for p in ps if p.grad is not None), torch.zeros_like(ps[0]))
            dist.all_reduce(total, group=group)
            self.counter.add(total.numel() * total.element_size() * 2 * (n - 1) // n)   # (a ring all-reduce)
            for p in ps:
                p.grad = total
        if not losses:
            return None
        total = sum(float(x.detach()) for x in losses)
        return total / len(losses) if self.reduction == "mean" else total

    def gathered(self, loss: float | None) -> tuple[dict, float]:
        """After `step`, on every rank: ({the model's name of a parameter: its full gradient, on
        the CPU}, the step's loss), gathered from the stages (bytes beyond the plan's)."""
        import torch.distributed as dist
        every: list = [None] * self.world
        dist.all_gather_object(every, ({n: g.detach().cpu() for n, g in self.gradients().items()}, loss))
        return {n: g for part, _ in every for n, g in part.items()}, next(x for _, x in every if x is not None)

    def measured(self, batch: tuple) -> dict:
        """One step measured, as `remat.distributed.launch` reports it: {"loss", "grads" (full,
        `gathered`), "peak_bytes" (the storage accounting with the stage's parameters, its part of
        the batch and its receive buffers resident; ``max_memory_allocated`` on CUDA),
        "predicted_peak" (its stage's), "comm_bytes" (sent in the step)}."""
        from remat.frontends.measuring import measure_peak
        box: dict = {}
        sent = self.counter.bytes
        resident = [p for ps in self.copies.values() for p in ps.values()]
        peak = measure_peak(lambda: box.update(loss=self.step(batch)),
                            resident=resident + self.inputs(batch) + self.buffers(),
                            device=self.device if self.device.type == "cuda" else None)
        sent = self.counter.bytes - sent
        grads, loss = self.gathered(box["loss"])
        return {"loss": loss, "grads": grads, "peak_bytes": peak, "comm_bytes": sent,
                "predicted_peak": self.plan_stage["peak_bytes"]}

    def trained(self, model: torch.nn.Module) -> list:
        """[(parameter, the model's name for it)]: `model`'s parameters and this stage's copies
        of them, each once, for an optimizer step on the full gradients."""
        owners: dict = {}
        for name, p in list(model.named_parameters(remove_duplicate=False)) + list(self.parameters().items()):
            owners.setdefault(id(p), (p, self.canonical.get(name, name)))
        return list(owners.values())


__all__ = ["PipelinedStep", "SendCounter", "loss_reduction", "canonical_names", "SCHEDULES"]
