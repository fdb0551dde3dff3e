"""``remat.trace``: a PyTorch model and an example batch in, a profiled training `Graph` out.

The granularity picks the frontend (`base.Frontend`): ``"module"`` and ``"op-stages"`` are
`modules.ModuleFrontend`'s, ``"joint"`` is `joint.JointFrontend`'s, and ``"op"`` is the joint
graph where it can be captured, else ``"op-stages"`` (the log and ``meta["capture_notes"]`` say
why); ``"auto"`` (the default) traces both the module graph and the joint graph and keeps the
finer one where it describes the step as well (`trace`).  `base.trace_with` runs the chosen frontend's capture, cut, profile and assembly with the
model's buffers and the RNG state restored afterwards.

``fixed_bytes`` = parameters + buffers + inputs (+ optimizer state when ``optimizer`` names
one; + the parameters' gradients with ``grads="resident"``); the breakdown sits in
``meta["fixed_breakdown"]``.  By default (``grads="accumulated"``) each gradient is the
persistent bytes of the backward node that first accumulates it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from remat.core.errors import InvalidInputError
from remat.core.analysis import forced_need
from remat.core.graph import Graph
from remat.core.simulate import keep_all_peak

from .base import PROFILES, Frontend, default_loss, fixed_bytes, prepare, trace_with
from .capture import CaptureError
from .joint import JointFrontend
from .modules import CAPTURES, ModuleFrontend
from .profile import FlopsModel

log = logging.getLogger(__name__)

GRANULARITIES = ("auto", "module", "op", "joint", "op-stages")
FEW_NODES = 4  # a module graph with fewer forward nodes than this gets a warning naming the finer options
# granularity "auto" takes the joint graph when it has at most this many nodes (the scalable ILP's
# reach within a default time limit) and its peak without recomputation is within this factor of
# the module graph's (at op level a node's outputs are kept and freed together: a batch norm's
# output lives as long as its saved statistics, which can inflate the peak)
AUTO_MAX_NODES = 2000
AUTO_PEAK_SLACK = 1.02
# ... unless the module graph is too coarse to plan below this fraction of its own peak (its
# largest node and what must live beside it: `analysis.forced_need`); then the finer graph wins
AUTO_COARSE = 0.5


def trace(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
          granularity: str = "auto", profile: str = "measure", device: "str | torch.device | None" = None,
          repeats: int | None = None, *, depth: "int | str" = "auto", warmup: int = 1, example_kwargs: dict | None = None,
          optimizer: str | None = None, name: str | None = None, flops_model: FlopsModel | None = None,
          capture_with: str = "auto", backward_edges: str = "saved", progress: bool = False,
          grads: str = "accumulated", model_inputs: int | None = None) -> Graph:
    """Trace and profile one training step of `model` on `example_inputs`; return its `Graph`.

    example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments
        (``example_kwargs`` adds keyword arguments to positional ones).
    loss_fn: ``loss_fn(output, *positional_inputs) -> scalar tensor``; default `default_loss`
        (the sum of every floating-point tensor in the output).  Positional inputs beyond those
        the model's ``forward`` takes go to the loss only (a classifier's labels:
        ``remat.trace(model, (images, labels), loss_fn=lambda out, x, y: F.cross_entropy(out, y))``;
        `base.model_inputs`); they are inputs of the traced step like the images.
    granularity: ``"auto"`` (default: the joint graph, as ``"joint"``, where it can be captured,
        has at most `AUTO_MAX_NODES` nodes and its peak without recomputation is within
        `AUTO_PEAK_SLACK` of the module graph's or the module graph is too coarse to plan below
        `AUTO_COARSE` of its peak; else the module graph; ``meta["capture_notes"]``
        and the log say which and why); ``"module"`` (one node per call of a module at `depth`,
        ``"auto"`` by default: the shallowest depth whose modules include repeated blocks,
        looking through wrappers, `segments.auto_depth`; see `segments`);
        ``"op"`` (one node per allocating ATen op of the joint forward+backward graph, backward
        ops and saved tensors explicit: `joint`; when the joint graph cannot be captured, e.g.
        data-dependent control flow, it falls back to ``"op-stages"`` and logs why); ``"joint"``
        (the joint graph, no fallback); ``"op-stages"`` (one forward node per ATen op of the
        forward, each with the backward node autograd gives it, saved tensors measured by hooks;
        torch.export or an eager recording).  ``meta["granularity"]`` records what was built.
    profile: ``"measure"`` (times: `warmup` runs, the first of which also counts storages and
        gives the outputs the next nodes consume, then the median of `repeats` timed runs,
        default 5 on CUDA and 3 on a CPU; CUDA events on a GPU, perf_counter elsewhere) or
        ``"flops"`` (deterministic times from FLOP counts, `FlopsModel`).  Bytes are measured
        the same way in both.
    device: where to run (the model and inputs are moved there, in place for the model);
        default: where the model's parameters are.
    optimizer: optimizer whose state counts as fixed bytes: one of `base.OPTIMIZER_STATE`.
    capture_with: ``"auto"`` (torch.export, falling back to an eager recording when export
        fails; the log says so), ``"export"`` (no fallback) or ``"eager"``.
    backward_edges: ``"saved"`` (the backward of v reads v's output and v's inputs only where
        autograd saved them, as measured) or ``"all"`` (always, as `remat.generators.from_forward`
        and Checkmate do).  Gradient edges (from consumers' backward nodes) are always there.
    progress: a progress bar on stderr.
    grads: how the training loop treats parameter gradients between steps: ``"accumulated"``
        (PyTorch's default ``optimizer.zero_grad()``, ``set_to_none=True``: each gradient is
        allocated at its first accumulation in the backward and lives to the step's end) or
        ``"resident"`` (``zero_grad(set_to_none=False)``: kept between steps, fixed bytes).
        ``meta["grads"]`` records it; `remat.run_plan` zeroes gradients accordingly.
    model_inputs: how many of the positional inputs the model takes (the rest go to the loss
        only; ``meta["model_inputs"]``; `remat.apply` and `remat.run_plan` follow it); default:
        those its ``forward`` has positional parameters for (`base.model_inputs`).

    The model's buffers (BatchNorm running statistics) and the global RNG state are restored
    afterwards; the model is otherwise left as it was (training or eval mode is the caller's).
    """
    if granularity not in GRANULARITIES:
        raise InvalidInputError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if profile not in PROFILES:
        raise InvalidInputError(f"profile: expected one of {PROFILES}, got {profile!r}")
    options = dict(example_kwargs=example_kwargs, loss_fn=loss_fn, profile=profile, device=device, repeats=repeats,
                   warmup=warmup, optimizer=optimizer, name=name, flops_model=flops_model, grads=grads,
                   model_inputs=model_inputs)
    if granularity == "auto":
        return _trace_auto(model, example_inputs, depth, capture_with, backward_edges, progress, options)
    notes = []
    if granularity in ("op", "joint"):
        frontend: Frontend = JointFrontend()
        try:
            return trace_with(frontend, prepare(frontend, model, example_inputs, **options))
        except CaptureError as e:
            if granularity == "joint":
                raise
            note = f"op granularity: the joint forward+backward graph cannot be captured ({e}); per-op stages"
            log.warning("%s; falling back to per-op stages (the forward's ATen ops, each with the backward node "
                        "autograd gives it)", note)
            notes.append(note)
            granularity = "op-stages"
    return _trace_modules(model, example_inputs, granularity, depth, capture_with, backward_edges, progress,
                          options, notes)


def _trace_modules(model: torch.nn.Module, example_inputs: Any, granularity: str, depth: "int | str",
                   capture_with: str, backward_edges: str, progress: bool, options: dict, notes: list) -> Graph:
    frontend = ModuleFrontend(granularity, depth, capture_with, backward_edges)
    ctx = prepare(frontend, model, example_inputs, progress=progress, **options)
    ctx.notes.extend(notes)
    graph = trace_with(frontend, ctx)
    forward = len(graph.forward_ids())
    if granularity == "module" and forward < FEW_NODES:
        # (a wrapper with one child, say: its whole network is one node, which a plan can only keep
        # or recompute whole)
        d = graph.meta["depth"]
        log.warning("%s traced to %d forward node%s at depth %d: a plan can only keep or recompute each whole; "
                    "for finer plans trace at depth=%d or more (--depth), or granularity='op' (--granularity op)",
                    ctx.name, forward, "" if forward == 1 else "s", d, d + 1)
    return graph


def _trace_auto(model: torch.nn.Module, example_inputs: Any, depth: "int | str", capture_with: str,
                backward_edges: str, progress: bool, options: dict) -> Graph:
    """``granularity="auto"``: trace the module graph, then the joint graph; keep the joint one
    when it passes the checks in `trace`'s docstring."""
    module = _trace_modules(model, example_inputs, "module", depth, capture_with, backward_edges, progress,
                            options, [])
    try:
        joint = trace_with(JointFrontend(), prepare(JointFrontend(), model, example_inputs, **options))
    except CaptureError as e:
        return _chosen(module, f"granularity auto: module, depth {module.meta['depth']} (the joint graph cannot "
                               f"be captured: {e})")
    if joint.n > AUTO_MAX_NODES:
        return _chosen(module, f"granularity auto: module, depth {module.meta['depth']} (the joint graph has "
                               f"{joint.n} nodes, more than {AUTO_MAX_NODES})")
    pj, pm = keep_all_peak(joint), keep_all_peak(module)
    floor = forced_need(module) / pm   # the least a module-level plan can need, as a fraction of its peak
    coarse = floor > AUTO_COARSE
    if pj > pm * AUTO_PEAK_SLACK and not coarse:
        return _chosen(module, f"granularity auto: module, depth {module.meta['depth']} (the joint graph's peak "
                               f"without recomputation is {pj / pm - 1:.1%} above the module graph's: at op level "
                               "an op's outputs are kept and freed together)")
    return _chosen(joint, f"granularity auto: op, the joint graph ({joint.n} nodes; its peak without "
                          f"recomputation {pj / pm - 1:+.1%} against the module graph's at depth "
                          f"{module.meta['depth']}" + (f", whose nodes are too coarse for a plan below "
                                                       f"{floor:.2f}x of it)" if coarse else ")"))


def _chosen(graph: Graph, note: str) -> Graph:
    graph.meta.setdefault("capture_notes", []).append(note)
    graph.meta["granularity_auto"] = True
    log.info("%s: %s", graph.meta.get("model", "model"), note)
    return graph


__all__ = ["trace", "default_loss", "fixed_bytes", "GRANULARITIES", "PROFILES", "CAPTURES"]
