"""Module granularity: one node per call of a module (or, ``"op-stages"``, per ATen op of the
forward), each with the backward node autograd gives it (`ModuleFrontend`).

Pipeline: `capture` (torch.export, or an eager recording when export fails) -> `stages.cut`
(module calls at a depth, or single ops) -> `profile.profile_runner` per stage and for the
loss -> a Checkmate-style layer graph (forward nodes, a loss node, one backward node per
forward node in reverse order; edges as `remat.generators.from_forward`).

What a node costs (docs/design.md, "The memory model"):

* forward node: ``bytes`` = what keeping it for backward costs = its outputs plus what autograd
  saves inside it (unique storages; parameters and the node's inputs left out: an input is its
  producer's output, counted there); ``workspace_bytes`` = transient peak above that while it
  runs, what its kernels allocate inside themselves included (the allocator's figure above the
  storages': CUDA's counters, on a CPU the profiler's allocation events; ``extra["scratch_bytes"]``,
  which `simulate.storage_view` leaves out for the storage accounting); ``time`` = forward
  time.  Extras: ``output_bytes``, ``saved_bytes``, ``module``...
* loss node: the loss function's forward *and* backward: ``bytes`` = the gradient w.r.t. the
  model's outputs (what lives on until the last forward node's backward), ``workspace_bytes``
  = the rest of its peak (saved tensors of the loss, the loss value).
* backward node of v: ``bytes`` = gradient w.r.t. v's activation inputs, ``time`` = v's backward
  (input and parameter gradients), ``workspace_bytes`` = its transient peak, parameter gradients
  left out; ``persistent_bytes`` (``grads="accumulated"``, PyTorch's default loop) = the
  parameter gradients it allocates, those of v's parameters that no earlier backward node
  accumulated (with ``grads="resident"`` they are fixed bytes instead).

Times, measured profile at module granularity: each stage is timed alone, in a loop, its
backward one autograd call after its own forward.  On a CPU the backward times came out 4-25 %
above what the same modules take inside one real step (zoo ResNet-50: 26.5 ms profiled against
21.5 ms: the isolated call's engine set-up, hooks and cache state), and in a process with
glibc's default allocator thresholds the real step's forward pays page faults the loop does
not.  So the frontend times the plain step itself (`plain_step_seconds`: the model's forward
and loss, then ``backward()``, gradients set to None first; buffers, RNG state and gradients
restored afterwards) and scales the forward times (recompute times with them) and the backward
times, each set by one factor, so that they sum to the step's measured forward and backward
(`calibrate_times`; ``meta["time_scale"]``, ``meta["plain_step_seconds"]``).  Where the plain
step does not fit the device (the profile runs stage by stage), the times stay as profiled.
"""
from __future__ import annotations

import logging
import statistics
import sys
from dataclasses import replace
from typing import Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten

from remat.core.errors import InvalidInputError
from remat.core.graph import Node
from remat.core.native import storages_held

from .base import Frontend, TraceContext, model_inputs, step_loss, step_state_kept
from .capture import Captured, capture
from .profile import (FlopsModel, Runner, StageProfile, Timer, cold_factors, is_random, profile_runner, release_plan, run_nodes,
                      writes_of)
from .segments import Segment, auto_depth, cut, group_modules, repeated_blocks

log = logging.getLogger(__name__)

GRANULARITIES = ("module", "op-stages")
CAPTURES = ("auto", "export", "eager")


class ModuleFrontend(Frontend):
    """``granularity="module"``: one node per call of a module at `depth` (`stages.cut`;
    ``"auto"``: `segments.auto_depth`, the shallowest depth with repeated blocks);
    ``"op-stages"``: one per ATen op of the forward.  `capture_with`: ``"auto"`` (torch.export,
    an eager recording when it fails), ``"export"`` or ``"eager"``.  `backward_edges`:
    ``"saved"`` (the backward of v reads v's output and inputs only where autograd saved them)
    or ``"all"`` (always, as Checkmate does)."""

    def __init__(self, granularity: str = "module", depth: "int | str" = 1, capture_with: str = "auto",
                 backward_edges: str = "saved"):
        if granularity not in GRANULARITIES:
            raise InvalidInputError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
        if depth != "auto" and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
            raise InvalidInputError(f"depth: must be a whole number >= 1 or 'auto', got {depth!r}")
        if capture_with not in CAPTURES:
            raise InvalidInputError(f"capture_with: expected one of {CAPTURES}, got {capture_with!r}")
        if backward_edges not in ("saved", "all"):
            raise InvalidInputError(f"backward_edges: expected 'saved' or 'all', got {backward_edges!r}")
        self.granularity, self.depth = granularity, depth
        self.capture_with, self.backward_edges = capture_with, backward_edges

    def capture(self, ctx: TraceContext) -> None:
        ctx.state["cap"] = capture(ctx.model, model_inputs(ctx.model, ctx.args, ctx.kwargs, ctx.model_inputs), ctx.kwargs,
                                   mode=self.capture_with)

    def cut(self, ctx: TraceContext) -> None:
        cap = ctx.state["cap"]
        depth = ctx.state["depth"] = auto_depth(ctx.model) if self.depth == "auto" else self.depth
        if self.depth == "auto":
            blocks = repeated_blocks(group_modules(ctx.model, depth))
            ctx.notes.append(f"depth auto: {depth}" + (f" (repeated blocks {blocks[0]} .. {blocks[-1]})"
                                                        if blocks else " (no repeated blocks found)"))
            log.info("%s: module depth %s chosen (%s)", ctx.name, depth, ctx.notes[-1])
        stages = ctx.state["stages"] = cut(cap, ctx.model, self.granularity, depth)
        log.info("captured %s with %s: %d ops in %d stages", ctx.name, cap.method,
                 sum(len(s.nodes) for s in stages), len(stages))

    def profile(self, ctx: TraceContext) -> None:
        ctx.state["profiles"] = _profile_all(ctx.state["cap"], ctx.state["stages"], ctx.model, ctx.args, ctx.loss_fn,
                                             ctx.device, ctx.measure_time, ctx.warmup, ctx.repeats, ctx.flops,
                                             ctx.progress, ctx.name, fresh_grads=ctx.grads == "accumulated",
                                             cold=self.granularity == "module")
        ctx.state["plain_step"] = None
        if ctx.measure_time and self.granularity == "module":
            try:
                ctx.state["plain_step"] = plain_step_seconds(ctx.model, ctx.args, ctx.kwargs, ctx.loss_fn,
                                                             ctx.model_inputs, ctx.device, ctx.warmup, ctx.repeats)
            except torch.OutOfMemoryError:   # (the plain step need not fit: the profile ran stage by stage)
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                ctx.notes.append("times not calibrated to the plain step: it does not fit the device")
                log.info("%s: %s", ctx.name, ctx.notes[-1])

    def assemble(self, ctx: TraceContext) -> tuple[list[Node], list[tuple[int, int]], dict]:
        cap, stages = ctx.state["cap"], ctx.state["stages"]
        profs, loss_prof, rng_flags, mutated = ctx.state["profiles"]
        nodes, edges = _assemble(cap, stages, profs, loss_prof, rng_flags, mutated, ctx.profile, ctx.flops_model,
                                 backward_edges=self.backward_edges, grads=ctx.grads)
        m = len(stages)
        calibration = {}
        if ctx.state.get("plain_step") is not None:
            fwd, bwd = ctx.state["plain_step"]
            nodes, f, b = calibrate_times(nodes, fwd, bwd)
            calibration = {"time_scale": {"forward": f, "backward": b},
                           "plain_step_seconds": {"forward": fwd, "backward": bwd}}
        return nodes, edges, {
            **calibration,
            "depth": ctx.state["depth"] if self.granularity == "module" else None,
            "capture": cap.method,
            "backward_edges": self.backward_edges,
            "capture_notes": list(cap.notes) + list(ctx.notes),
            "rng_nodes": [j for j in range(m) if rng_flags[j]],
            "buffer_mutations": {stages[j].name: mutated[j] for j in range(m) if mutated[j]},
            "engine_sums": _engine_sums(profs, m),
        }


# ---- profiling ---------------------------------------------------------------------------------
def plain_step_seconds(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable, count: int | None,
                       device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """(forward and loss, backward) seconds of the plain training step, medians of `repeats`
    steps after `warmup`, each from gradients set to None (PyTorch's default ``zero_grad``).
    The model's buffers (BatchNorm's running statistics), the RNG states and the parameters'
    gradients are as before the call."""
    timer = Timer(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = [p for p in model.parameters() if p.requires_grad]
    fw, bw = [], []
    with step_state_kept(model, device):
        for r in range(max(1, warmup) + repeats):
            for p in params:
                p.grad = None
            sync()
            t0 = timer.mark()
            loss = step_loss(model, loss_fn, args, kwargs, count)
            t1 = timer.mark()
            loss.backward()
            t2 = timer.mark()
            if r >= max(1, warmup):
                fw.append(timer.seconds(t0, t1))
                bw.append(timer.seconds(t1, t2))
            del loss
    return statistics.median(fw), statistics.median(bw)


SCALE_RANGE = (0.5, 2.0)   # a factor outside this is a measurement gone wrong, not a calibration


def calibrate_times(nodes: list[Node], forward: float, backward: float) -> tuple[list[Node], float, float]:
    """`nodes` with their times scaled to a measured plain step of `forward` (the model's forward
    and the loss) and `backward` seconds: forward nodes' times and recompute times, and the
    loss node's forward part (``extra["forward_time"]``), by one factor so that they sum to
    `forward`; backward nodes' times and the loss's backward part (``extra["backward_time"]``)
    by another so that they sum to `backward`.  Returns (nodes, forward factor, backward
    factor), each clamped to `SCALE_RANGE` (1.0, those nodes unchanged, where nothing was
    timed)."""
    loss = next(v for v in nodes if v.kind == "loss")
    lo, hi = SCALE_RANGE

    def factor(kind: str, part: str, measured: float) -> float:
        profiled = sum(v.time for v in nodes if v.kind == kind) + float(loss.extra.get(part, 0.0))
        return min(hi, max(lo, measured / profiled)) if profiled > 0 and measured > 0 else 1.0
    f, b = factor("forward", "forward_time", forward), factor("backward", "backward_time", backward)
    out = []
    for v in nodes:
        if v.kind == "forward":
            v = replace(v, time=v.time * f, recompute_time=None if v.recompute_time is None else v.recompute_time * f)
        elif v.kind == "backward":
            v = replace(v, time=v.time * b)
        elif v.kind == "loss" and "forward_time" in v.extra and "backward_time" in v.extra:
            fw, bw = float(v.extra["forward_time"]), float(v.extra["backward_time"])
            v = replace(v, time=fw * f + bw * b, extra={**v.extra, "forward_time": fw * f, "backward_time": bw * b})
        out.append(v)
    return out, f, b


def _profile_all(cap: Captured, stages: list[Segment], model: torch.nn.Module, args: tuple, loss_fn: Callable,
                 dev: torch.device, measure_time: bool, warmup: int, repeats: int, flops: bool, progress: bool,
                 model_name: str, fresh_grads: bool = False, cold: bool = False):
    # parameter gradients preallocated so each stage's backward accumulates into them (with
    # fresh_grads each stage's own are dropped before its measured backward: `profile`); the
    # caller's gradients are put back afterwards
    trainable = [p for p in model.parameters() if p.requires_grad]
    stashed = [(p, p.grad) for p in trainable]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    statics = list(model.parameters()) + list(model.buffers()) + [p.grad for p in trainable]
    try:
        return _profile_stages(cap, stages, args, loss_fn, dev, measure_time, warmup, repeats, flops, progress,
                               model_name, statics, fresh_grads, cold)
    finally:
        for p, g in stashed:
            p.grad = g


def _profile_stages(cap: Captured, stages: list[Segment], args: tuple, loss_fn: Callable, dev: torch.device,
                    measure_time: bool, warmup: int, repeats: int, flops: bool, progress: bool, model_name: str,
                    statics: list, fresh_grads: bool = False, cold: bool = False):
    """Each stage's profile (`profile_runner`), the loss's; with `cold` (module stages, each
    recomputed whole) and `measure_time`, each forward's recompute time (`profile.cold_factors`)."""
    from tqdm import tqdm

    env: dict = dict(cap.values)
    rg: dict = {n: isinstance(v, torch.Tensor) and cap.kinds[n] == "parameter" and v.requires_grad
                for n, v in cap.values.items()}
    profs: list[StageProfile] = []
    runners: list[Runner] = []
    rng_flags: list[bool] = []
    mutated: list[list[str]] = []
    kw = dict(device=dev, measure_time=measure_time, warmup=warmup, repeats=repeats, flops=flops,
              fresh_grads=fresh_grads)
    with tqdm(total=len(stages) + 1, desc=f"profiling {model_name}", unit="node", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for s in stages:
            bar.set_postfix_str(s.name[:40])
            runner = _stage_runner(s, cap, env, rg)
            watched = [(i, env[i]) for i in s.inputs if cap.kinds.get(i) in ("buffer", "input")
                       and isinstance(env[i], torch.Tensor)]
            # BatchNorm's kernel updates running statistics without bumping version counters:
            # compare values too
            versions = [(t._version, t.detach().clone()) for _, t in watched]
            try:
                prof, plain = profile_runner(runner, ignore=statics, **kw)
            except Exception as e:  # noqa: BLE001
                raise InvalidInputError(f"profiling node {s.name!r} ({s.module_type}) failed: "
                                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
            for o, (val, req) in zip(s.outputs, plain):
                env[o] = val
                rg[o] = req
            prof.random = any(_random(n) for n in s.nodes)
            mutated.append([str(cap.targets[i]) if cap.kinds[i] == "buffer" else f"input {cap.targets[i]}"
                            for (i, t), (v, before) in zip(watched, versions)
                            if t._version != v or not torch.equal(t, before)])
            profs.append(prof)
            runners.append(runner)
            rng_flags.append(prof.random)
            bar.update()
        bar.set_postfix_str("loss")
        loss_prof = _profile_loss(cap, env, rg, args, loss_fn, kw)
        bar.update()
    if measure_time and cold:
        # each forward again with its inputs out of the caches, as a recomputation finds them
        factors = cold_factors([lambda r=r: r.forward(r.make_inputs()[0]) for r in runners], dev, repeats)
        for prof, f in zip(profs, factors):
            prof.recompute_time = prof.fwd_time * max(1.0, f)
    return profs, loss_prof, rng_flags, mutated


def _random(n: fx.Node) -> bool:
    if is_random(n):
        return True
    name = getattr(n.target, "__name__", "")
    if "dropout" in name or "bernoulli" in name or name.startswith(("rand", "normal")):
        return True
    if "scaled_dot_product" in name:
        p = n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0)
        return bool(p)
    return False


def _stage_runner(s: Segment, cap: Captured, env: dict, rg: dict) -> Runner:
    values = [env[i] for i in s.inputs]
    written = {w for n in s.nodes for w in writes_of(n)}
    grad_inputs, cloned, params = [], [], []
    for k, i in enumerate(s.inputs):
        v = values[k]
        kind = cap.kinds.get(i)
        if kind == "parameter":
            if isinstance(v, torch.Tensor) and v.requires_grad:
                params.append(v)
            continue
        if kind is None and rg.get(i) and isinstance(v, torch.Tensor) and v.is_floating_point():
            grad_inputs.append(k)
        if i in written and kind != "buffer":
            cloned.append(k)
    inputs, outputs, nodes = list(s.inputs), list(s.outputs), list(s.nodes)
    release = release_plan(nodes, outputs)

    def forward(args: list) -> list:
        local = run_nodes(nodes, dict(zip(inputs, args)), release)
        return [local[o] for o in outputs]
    return Runner(forward, values, grad_inputs, cloned, params)


def _profile_loss(cap: Captured, env: dict, rg: dict, args: tuple, loss_fn: Callable, kw: dict) -> StageProfile:
    out_nodes = [o for o in cap.outputs if isinstance(o, fx.Node)]
    values = [env[o] for o in out_nodes]
    grad_inputs = [k for k, (o, v) in enumerate(zip(out_nodes, values))
                   if rg.get(o) and isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not grad_inputs:
        raise InvalidInputError("the model's output does not require grad (no parameter reaches it?); "
                                "nothing to train")

    def forward(vals: list) -> list:
        it = iter(vals)
        flat = [next(it) if isinstance(o, fx.Node) else o for o in cap.outputs]
        output = tree_unflatten(flat, cap.out_spec)
        loss = loss_fn(output, *args)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidInputError(f"loss_fn must return a scalar tensor, got "
                                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        if not loss.requires_grad:
            raise InvalidInputError("the loss does not depend on the model's output (it does not require grad)")
        return [loss]

    runner = Runner(forward, values, grad_inputs, [], [])
    try:
        prof, _ = profile_runner(runner, ignore=[], grad_outputs=lambda diff: None, **kw)
    except InvalidInputError:
        raise
    except Exception as e:  # noqa: BLE001
        raise InvalidInputError(f"the loss function failed on the model's output: {type(e).__name__}: {e}") from e
    return prof


# ---- the graph ---------------------------------------------------------------------------------
def _producers_where(s: Segment, flags: list, producer: dict) -> list[int]:
    """The stages (sorted) producing the inputs of stage `s` whose flag (one per input) is set."""
    return sorted({producer[i] for i, f in zip(s.inputs, flags) if f and i in producer})


def _backward_id(m: int, v: int) -> int:
    """The id of forward node v's backward node in a module graph of m forward nodes: forward
    nodes 0..m-1, the loss m, then the backward nodes in reverse order."""
    return m + 1 + (m - 1 - v)


def _engine_sums(profs: list[StageProfile], m: int) -> list[dict]:
    """The parameters whose gradient several backward nodes contribute (a tied weight: an
    embedding and the LM head that shares it), each as ``{"bytes": its gradient's bytes,
    "nodes": the contributing backward nodes in the backward's order}`` (`remat.core.native`
    counts what autograd's engine does with them)."""
    contributors: dict = {}
    for v in reversed(range(m)):
        if profs[v].differentiable:
            for k, b in profs[v].param_grads.items():
                contributors.setdefault(k, (b, []))[1].append(_backward_id(m, v))
    return [{"bytes": int(b), "nodes": ns} for b, ns in contributors.values() if len(ns) > 1]


def _assemble(cap: Captured, stages: list[Segment], profs: list[StageProfile], loss_prof: StageProfile,
              rng_flags: list[bool], mutated: list[list[str]], profile: str, fm: FlopsModel,
              backward_edges: str = "saved", grads: str = "resident") -> tuple[list[Node], list[tuple[int, int]]]:
    m = len(stages)
    producer = {o: j for j, s in enumerate(stages) for o in s.outputs}
    preds: list[list[int]] = []
    for j, s in enumerate(stages):
        ps = []
        for i in s.inputs:
            p = producer.get(i)
            if p is not None and p not in ps:
                ps.append(p)
        preds.append(ps)
    succs: list[list[int]] = [[] for _ in range(m)]
    for j, ps in enumerate(preds):
        for p in ps:
            succs[p].append(j)
    feeds_loss = {producer[o] for o in cap.outputs if isinstance(o, fx.Node) and o in producer}
    loss = m
    bwd = {v: _backward_id(m, v) for v in range(m)}

    def t_fwd(p: StageProfile) -> float:
        return fm.time(p.fwd_flops, p.fwd_alloc_bytes) if profile == "flops" else p.fwd_time

    def t_bwd(p: StageProfile) -> float:
        if not p.differentiable:
            return 0.0
        return fm.time(p.bwd_flops, p.bwd_alloc_bytes) if profile == "flops" else p.bwd_time

    nodes: list[Node] = []
    for j, (s, p) in enumerate(zip(stages, profs)):
        extra = {"module": s.module, "module_type": s.module_type, "ops": len(s.nodes),
                 "output_bytes": p.output_bytes, "saved_bytes": p.saved_bytes, "retained_bytes": p.retained_bytes,
                 "saves_input_of": _producers_where(s, p.saves_input, producer),
                 "passes_input_of": _producers_where(s, p.passes_input, producer)}
        if rng_flags[j]:
            extra["random"] = True
        if mutated[j]:
            extra["mutates"] = mutated[j]
        if profile == "flops":
            extra["flops"] = p.fwd_flops
        if p.fwd_scratch:   # (kernels' own allocations, part of the workspace: `simulate.storage_view`)
            extra["scratch_bytes"] = int(p.fwd_scratch)
        recompute = None if profile == "flops" or p.recompute_time is None else float(p.recompute_time)
        nodes.append(Node(j, s.name, "forward", float(t_fwd(p)),
                          int(max(p.output_bytes + p.saved_bytes, p.retained_bytes)),
                          int(p.fwd_workspace), extra, recompute_time=recompute))
    lp = loss_prof
    loss_kept = max(lp.output_bytes + lp.saved_bytes, lp.retained_bytes)
    loss_ws = max(lp.fwd_workspace + loss_kept, loss_kept + lp.bwd_workspace + lp.grad_bytes) - lp.grad_bytes
    loss_extra = {"loss_bytes": lp.output_bytes, "saved_bytes": lp.saved_bytes,
                  "forward_time": t_fwd(lp), "backward_time": t_bwd(lp)}
    if profile == "flops":
        loss_extra["flops"] = lp.fwd_flops + lp.bwd_flops
    if lp.fwd_scratch or lp.bwd_scratch:
        loss_extra["scratch_bytes"] = int(max(lp.fwd_scratch, lp.bwd_scratch))
    nodes.append(Node(loss, "loss", "loss", float(t_fwd(lp) + t_bwd(lp)), int(lp.grad_bytes), int(max(0, loss_ws)),
                      loss_extra))
    accumulated: set = set()  # parameters whose gradient an earlier backward node allocated
    for v in reversed(range(m)):
        p = profs[v]
        extra = {"forward": v, "param_grad_bytes": p.param_grad_bytes}
        if p.engine_release:  # (natively the engine frees the incoming gradient inside: `core.native`)
            extra["engine_release_bytes"] = int(p.engine_release)
        if profile == "flops":
            extra["flops"] = p.bwd_flops
        if p.bwd_scratch and p.differentiable:
            extra["scratch_bytes"] = int(p.bwd_scratch)
        persistent = 0
        ws = int(p.bwd_workspace) if p.differentiable else 0
        if grads == "accumulated" and p.differentiable:
            # each gradient is allocated by the first backward node that accumulates it and lives
            # to the step's end (the profile's workspace holds all of this stage's while it runs;
            # one an earlier node made, of a shared parameter, is only added into)
            first = {k: b for k, b in p.param_grads.items() if k not in accumulated}
            persistent = sum(first.values())
            accumulated.update(first)
        nodes.append(Node(bwd[v], f"grad_{stages[v].name}", "backward", float(t_bwd(p)),
                          int(p.grad_bytes) if p.differentiable else 0, ws, extra, persistent_bytes=int(persistent)))
    edges: list[tuple[int, int]] = []
    for v in range(m):
        for u in preds[v]:
            edges.append((u, v))
        if v in feeds_loss or not succs[v]:
            edges.append((v, loss))
            edges.append((loss, bwd[v]))
        for w in succs[v]:
            edges.append((bwd[w], bwd[v]))
        p = profs[v]
        if backward_edges == "all" or p.saved_bytes or p.saves_output or p.retained_bytes > p.output_bytes:
            edges.append((v, bwd[v]))
        # (a storage a later stage passes on as its own output is held under the stage that made it)
        held = storages_held(v, lambda j: nodes[j].extra["saves_input_of"], lambda j: nodes[j].extra["passes_input_of"])
        read = [u for u in preds[v] if backward_edges == "all" or u in held] + sorted(held - set(preds[v]))
        edges.extend((u, bwd[v]) for u in read)
    return nodes, edges


__all__ = ["ModuleFrontend", "GRANULARITIES", "CAPTURES"]
