"""``remat.trace``: a PyTorch model and an example batch in, a profiled training `Graph` out.

Pipeline: `capture` (torch.export, or an eager recording when export fails) -> `stages.cut`
(module calls at a depth, or single ops) -> `profile.profile_runner` per stage and for the
loss -> a Checkmate-style layer graph (forward nodes, a loss node, one backward node per
forward node in reverse order; edges as `remat.generators.from_forward`).

What a node costs (DESIGN.md, "Modelling memory honestly"):

* forward node: ``bytes`` = what keeping it for backward costs = its outputs plus what autograd
  saves inside it (unique storages; parameters and the node's inputs left out: an input is its
  producer's output, counted there); ``workspace_bytes`` = transient peak above that while it
  runs; ``time`` = forward time.  Extras: ``output_bytes``, ``saved_bytes``, ``module``...
* loss node: the loss function's forward *and* backward: ``bytes`` = the gradient w.r.t. the
  model's outputs (what lives on until the last forward node's backward), ``workspace_bytes``
  = the rest of its peak (saved tensors of the loss, the loss value).
* backward node of v: ``bytes`` = gradient w.r.t. v's activation inputs, ``time`` = v's backward
  (input and parameter gradients), ``workspace_bytes`` = its transient peak, parameter gradients
  left out (they are fixed bytes).

``fixed_bytes`` = parameters + their gradients + buffers + inputs (+ optimizer state when
``optimizer`` names one); the breakdown sits in ``meta["fixed_breakdown"]``.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from remat.core.errors import InvalidInputError
from remat.core.graph import DEFAULT_BANDWIDTH, Graph, Node

from .capture import CaptureError, Captured, capture
from .measure import LibraryWorkspaces, unique_bytes
from .profile import FlopsModel, Runner, StageProfile, is_random, profile_runner, release_plan, run_nodes, writes_of
from .stages import Stage, cut

log = logging.getLogger(__name__)

GRANULARITIES = ("module", "op", "joint", "op-stages")
PROFILES = ("measure", "flops")
CAPTURES = ("auto", "export", "eager")
# optimizer name -> state tensors per trainable parameter
OPTIMIZER_STATE = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1,
                   "adafactor": 1, "lion": 1}
DEFAULT_REPEATS = {"cuda": 5, "cpu": 3}  # timed runs per node; CPU runs are slow and steadier


def default_loss(output: Any, *inputs: Any) -> torch.Tensor:
    """The default loss: the sum of every floating-point tensor in the output (``output.sum()``
    for a single tensor), in float32 or wider."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise InvalidInputError("the model's output has no floating-point tensor to reduce; pass loss_fn")
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total


def trace(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
          granularity: str = "module", profile: str = "measure", device: "str | torch.device | None" = None,
          repeats: int | None = None, *, depth: int = 1, warmup: int = 1, example_kwargs: dict | None = None,
          optimizer: str | None = None, name: str | None = None, flops_model: FlopsModel | None = None,
          capture_with: str = "auto", backward_edges: str = "saved", progress: bool = False) -> Graph:
    """Trace and profile one training step of `model` on `example_inputs`; return its `Graph`.

    example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments
        (``example_kwargs`` adds keyword arguments to positional ones).
    loss_fn: ``loss_fn(output, *positional_inputs) -> scalar tensor``; default `default_loss`
        (the sum of every floating-point tensor in the output).
    granularity: ``"module"`` (one node per call of a module at `depth`; see `stages`);
        ``"op"`` (one node per allocating ATen op of the joint forward+backward graph, backward
        ops and saved tensors explicit: `joint.trace_joint`; when the joint graph cannot be
        captured, e.g. data-dependent control flow, it falls back to ``"op-stages"`` and logs
        why); ``"joint"`` (the joint graph, no fallback); ``"op-stages"`` (one forward node per
        ATen op of the forward, each with the backward node autograd gives it, saved tensors
        measured by hooks; torch.export or an eager recording).  ``meta["granularity"]``
        records what was built.
    profile: ``"measure"`` (times: `warmup` runs, the first of which also counts storages and
        gives the outputs the next nodes consume, then the median of `repeats` timed runs,
        default 5 on CUDA and 3 on a CPU; CUDA events on a GPU, perf_counter elsewhere) or
        ``"flops"`` (deterministic times from FLOP counts, `FlopsModel`).  Bytes are measured
        the same way in both.
    device: where to run (the model and inputs are moved there, in place for the model);
        default: where the model's parameters are.
    optimizer: optimizer whose state counts as fixed bytes: one of `OPTIMIZER_STATE`.
    capture_with: ``"auto"`` (torch.export, falling back to an eager recording when export
        fails; the log says so), ``"export"`` (no fallback) or ``"eager"``.
    backward_edges: ``"saved"`` (the backward of v reads v's output and v's inputs only where
        autograd saved them, as measured) or ``"all"`` (always, as `remat.generators.from_forward`
        and Checkmate do).  Gradient edges (from consumers' backward nodes) are always there.
    progress: a progress bar on stderr.

    The model's buffers (BatchNorm running statistics) and the global RNG state are restored
    afterwards; the model is otherwise left as it was (training or eval mode is the caller's).
    """
    t_start = time.perf_counter()
    if granularity not in GRANULARITIES:
        raise InvalidInputError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if profile not in PROFILES:
        raise InvalidInputError(f"profile: expected one of {PROFILES}, got {profile!r}")
    fallback_note = None
    if granularity in ("op", "joint"):
        from .joint import trace_joint
        try:
            return trace_joint(model, example_inputs, loss_fn, profile, device, repeats, warmup=warmup,
                               example_kwargs=example_kwargs, optimizer=optimizer, name=name, flops_model=flops_model)
        except CaptureError as e:
            if granularity == "joint":
                raise
            fallback_note = f"op granularity: the joint forward+backward graph cannot be captured ({e}); per-op stages"
            log.warning("%s; falling back to per-op stages (the forward's ATen ops, each with the backward node "
                        "autograd gives it)", fallback_note)
            granularity = "op-stages"
    if not isinstance(depth, int) or depth < 1:
        raise InvalidInputError(f"depth: must be a whole number >= 1, got {depth!r}")
    if capture_with not in CAPTURES:
        raise InvalidInputError(f"capture_with: expected one of {CAPTURES}, got {capture_with!r}")
    if backward_edges not in ("saved", "all"):
        raise InvalidInputError(f"backward_edges: expected 'saved' or 'all', got {backward_edges!r}")
    args, kwargs, dev, repeats, loss, model_name, flops_model = prepare_trace(
        model, example_inputs, example_kwargs, loss_fn, device, repeats, warmup, optimizer, name, flops_model)

    rng_devices = [dev] if dev.type == "cuda" else []
    snapshot = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=rng_devices):
            t0 = time.perf_counter()
            cap = capture(model, args, kwargs, mode=capture_with)
            stages = cut(cap, model, granularity, depth)
            t_capture = time.perf_counter() - t0
            log.info("captured %s with %s: %d ops in %d stages (%.2f s)", model_name, cap.method,
                     sum(len(s.nodes) for s in stages), len(stages), t_capture)
            t0 = time.perf_counter()
            with LibraryWorkspaces(dev) as libs:
                profs, loss_prof, rng_flags, mutated = _profile_all(
                    cap, stages, model, args, loss, dev, profile == "measure", warmup, repeats,
                    profile == "flops", progress, model_name)
            t_profile = time.perf_counter() - t0
    finally:
        with torch.no_grad():
            for b, saved in snapshot:
                b.copy_(saved)

    fixed, breakdown = fixed_bytes(model, args, kwargs, optimizer, runtime=libs.bytes if dev.type == "cuda" else None)
    graph = _assemble(cap, stages, profs, loss_prof, rng_flags, mutated, profile, flops_model, fixed,
                      backward_edges=backward_edges, meta={
        **step_meta(model, args, kwargs, dev, model_name, profile, repeats, warmup, flops_model, loss, optimizer,
                    breakdown),
        "granularity": granularity,
        "depth": depth if granularity == "module" else None,
        "capture": cap.method,
        "backward_edges": backward_edges,
        "capture_notes": list(cap.notes) + ([fallback_note] if fallback_note else []),
    })
    total = time.perf_counter() - t_start
    graph.meta["trace_seconds"] = {"capture": round(t_capture, 4), "profile": round(t_profile, 4),
                                   "total": round(total, 4)}
    log.info("traced %s: %d nodes, fixed %d bytes, %.2f s (profiling %.2f s)", model_name, graph.n, fixed,
             total, t_profile)
    return graph


# ---- inputs ------------------------------------------------------------------------------
def _split_inputs(example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict) and example_kwargs is None:
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        args: tuple = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    elif example_inputs is None:
        args = ()
    else:
        args = (example_inputs,)
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise InvalidInputError("example_kwargs: expected a dict of keyword arguments")
    return args, dict(example_kwargs or {})


def _resolve_device(model: torch.nn.Module, device: Any) -> torch.device:
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidInputError(f"device: cannot read {device!r}: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidInputError("device: CUDA is not available on this machine (use --device cpu)")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _batch(args: tuple, kwargs: dict) -> int | None:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def _dtype(model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    for t in list(model.parameters()) + tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "unknown"


def prepare_trace(model: torch.nn.Module, example_inputs: Any, example_kwargs: dict | None, loss_fn: Callable | None,
                  device: "str | torch.device | None", repeats: int | None, warmup: int, optimizer: str | None,
                  name: str | None, flops_model: "FlopsModel | None", min_warmup: int = 1,
                  need_grad: bool = False) -> tuple:
    """The checks and defaults every granularity's trace shares: ``(args, kwargs, device,
    repeats, loss_fn, model name, flops model)``, the model and inputs moved to the device."""
    if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
        raise InvalidInputError(f"repeats: must be a whole number >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or warmup < min_warmup:
        raise InvalidInputError(f"warmup: must be a whole number >= {min_warmup}, got {warmup!r}")
    if optimizer is not None and optimizer not in OPTIMIZER_STATE:
        raise InvalidInputError(f"optimizer: unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE)}")
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if need_grad and not any(p.requires_grad for p in model.parameters()):
        raise InvalidInputError("model: no parameter requires grad; nothing to train")
    args, kwargs = _split_inputs(example_inputs, example_kwargs)
    dev = _resolve_device(model, device)
    if repeats is None:
        repeats = DEFAULT_REPEATS.get(dev.type, DEFAULT_REPEATS["cpu"])
    if device is not None:
        model.to(dev)
    args, kwargs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    return (args, kwargs, dev, repeats, loss_fn or default_loss, name or type(model).__name__,
            flops_model or FlopsModel())


def step_meta(model: torch.nn.Module, args: tuple, kwargs: dict, dev: torch.device, model_name: str, profile: str,
              repeats: int, warmup: int, flops_model: "FlopsModel", loss: Callable, optimizer: str | None,
              breakdown: dict) -> dict:
    """The meta every granularity's graph records: the model and its inputs, the profiler and
    its options, the loss, the fixed bytes' breakdown, the model's fingerprint, the host link."""
    bw, bw_meta = host_device_bandwidth(dev)
    return {
        "model": model_name,
        "batch": _batch(args, kwargs),
        "input_shapes": [list(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)],
        "dtype": _dtype(model, args, kwargs),
        "device": str(dev),
        "torch": torch.__version__,
        "profiler": profile,
        "profile_options": ({"repeats": repeats, "warmup": warmup, "timer": "cuda events" if dev.type == "cuda"
                             else "perf_counter", "statistic": "median"} if profile == "measure" else
                            {"flops_per_s": flops_model.flops_per_s, "bytes_per_s": flops_model.bytes_per_s,
                             "formula": "flops / flops_per_s + allocated bytes / bytes_per_s"}),
        "loss": getattr(loss, "__name__", type(loss).__name__),
        "training": model.training,
        "optimizer": optimizer,
        "fixed_breakdown": breakdown,
        "model_fingerprint": model_fingerprint(model),
        "bandwidth": bw,
        **bw_meta,
    }


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's parameter and buffer names, shapes and dtypes: what a plan
    was made for (`remat.apply` refuses a plan whose fingerprint differs)."""
    import hashlib
    h = hashlib.sha256()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


# ---- fixed bytes and bandwidth ---------------------------------------------------------------
def fixed_bytes(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None,
                optimizer: str | None = None, runtime: int | None = None) -> tuple[int, dict]:
    """(total, breakdown): parameters, gradients, buffers, inputs, optimizer state; each storage
    counted once (shared parameters, views).  `runtime` (CUDA only, `LibraryWorkspaces`): the
    device bytes the CUDA libraries keep for the step, in the breakdown as ``runtime``."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    p_bytes = unique_bytes(params)
    g_bytes = unique_bytes(trainable)
    b_bytes = unique_bytes(model.buffers())
    inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
    seen = unique_bytes(params + list(model.buffers()))
    i_bytes = unique_bytes(params + list(model.buffers()) + inputs) - seen
    o_bytes = OPTIMIZER_STATE.get(optimizer or "", 0) * g_bytes
    breakdown = {"parameters": p_bytes, "gradients": g_bytes, "buffers": b_bytes, "inputs": i_bytes,
                 "optimizer": o_bytes}
    if runtime is not None:
        breakdown["runtime"] = int(runtime)
    return sum(breakdown.values()), breakdown


def host_device_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, dict]:
    """Pinned host<->device copy bandwidth in bytes/s (the slower direction) and its meta.  On a
    CPU there is no copy to measure: `remat.core.graph.DEFAULT_BANDWIDTH`."""
    if device.type != "cuda":
        return DEFAULT_BANDWIDTH, {"bandwidth_source": "default (no CUDA device)"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for direction, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
        times = []
        for _ in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        t = sorted(times[1:])[len(times[1:]) // 2]
        out[direction] = nbytes / t if t > 0 else DEFAULT_BANDWIDTH
    del host, dev
    return min(out.values()), {"bandwidth_h2d": out["h2d"], "bandwidth_d2h": out["d2h"],
                               "bandwidth_source": f"measured: pinned copies of {nbytes >> 20} MiB, median of {repeats}"}


# ---- profiling ---------------------------------------------------------------------------------
def _profile_all(cap: Captured, stages: list[Stage], model: torch.nn.Module, args: tuple, loss_fn: Callable,
                 dev: torch.device, measure_time: bool, warmup: int, repeats: int, flops: bool, progress: bool,
                 model_name: str):
    # parameter gradients exist for the whole step (fixed bytes): preallocate them so each
    # stage's backward accumulates into them; the caller's gradients are put back afterwards
    trainable = [p for p in model.parameters() if p.requires_grad]
    stashed = [(p, p.grad) for p in trainable]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    statics = list(model.parameters()) + list(model.buffers()) + [p.grad for p in trainable]
    try:
        return _profile_stages(cap, stages, args, loss_fn, dev, measure_time, warmup, repeats, flops, progress,
                               model_name, statics)
    finally:
        for p, g in stashed:
            p.grad = g


def _profile_stages(cap: Captured, stages: list[Stage], args: tuple, loss_fn: Callable, dev: torch.device,
                    measure_time: bool, warmup: int, repeats: int, flops: bool, progress: bool, model_name: str,
                    statics: list):
    from tqdm import tqdm

    env: dict = dict(cap.values)
    rg: dict = {n: isinstance(v, torch.Tensor) and cap.kinds[n] == "parameter" and v.requires_grad
                for n, v in cap.values.items()}
    profs: list[StageProfile] = []
    rng_flags: list[bool] = []
    mutated: list[list[str]] = []
    kw = dict(device=dev, measure_time=measure_time, warmup=warmup, repeats=repeats, flops=flops)
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
            rng_flags.append(prof.random)
            bar.update()
        bar.set_postfix_str("loss")
        loss_prof = _profile_loss(cap, env, rg, args, loss_fn, kw)
        bar.update()
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


def _stage_runner(s: Stage, cap: Captured, env: dict, rg: dict) -> Runner:
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
def _saved_preds(s: Stage, p: StageProfile, producer: dict, preds: list[int]) -> list[bool]:
    """For each producer in `preds`: does stage `s`'s backward read (autograd saved) its output?"""
    saved = {producer[i] for i, sv in zip(s.inputs, p.saves_input) if sv and i in producer}
    return [u in saved for u in preds]


def _assemble(cap: Captured, stages: list[Stage], profs: list[StageProfile], loss_prof: StageProfile,
              rng_flags: list[bool], mutated: list[list[str]], profile: str, fm: FlopsModel, fixed: int,
              meta: dict, backward_edges: str = "saved") -> Graph:
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
    bwd = {v: m + 1 + (m - 1 - v) for v in range(m)}

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
                 "saves_input_of": sorted({producer[i] for i, sv in zip(s.inputs, p.saves_input)
                                           if sv and i in producer})}
        if rng_flags[j]:
            extra["random"] = True
        if mutated[j]:
            extra["mutates"] = mutated[j]
        if profile == "flops":
            extra["flops"] = p.fwd_flops
        nodes.append(Node(j, s.name, "forward", float(t_fwd(p)),
                          int(max(p.output_bytes + p.saved_bytes, p.retained_bytes)),
                          int(p.fwd_workspace), extra))
    lp = loss_prof
    loss_kept = max(lp.output_bytes + lp.saved_bytes, lp.retained_bytes)
    loss_ws = max(lp.fwd_workspace + loss_kept, loss_kept + lp.bwd_workspace + lp.grad_bytes) - lp.grad_bytes
    loss_extra = {"loss_bytes": lp.output_bytes, "saved_bytes": lp.saved_bytes,
                  "forward_time": t_fwd(lp), "backward_time": t_bwd(lp)}
    if profile == "flops":
        loss_extra["flops"] = lp.fwd_flops + lp.bwd_flops
    nodes.append(Node(loss, "loss", "loss", float(t_fwd(lp) + t_bwd(lp)), int(lp.grad_bytes), int(max(0, loss_ws)),
                      loss_extra))
    for v in reversed(range(m)):
        p = profs[v]
        extra = {"forward": v, "param_grad_bytes": p.param_grad_bytes}
        if profile == "flops":
            extra["flops"] = p.bwd_flops
        nodes.append(Node(bwd[v], f"grad_{stages[v].name}", "backward", float(t_bwd(p)),
                          int(p.grad_bytes) if p.differentiable else 0,
                          int(p.bwd_workspace) if p.differentiable else 0, extra))
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
        for u, sv in zip(preds[v], _saved_preds(stages[v], p, producer, preds[v])):
            if backward_edges == "all" or sv:
                edges.append((u, bwd[v]))
    meta = dict(meta)
    meta["rng_nodes"] = [j for j in range(m) if rng_flags[j]]
    meta["buffer_mutations"] = {stages[j].name: mutated[j] for j in range(m) if mutated[j]}
    return Graph(nodes, edges, fixed, meta)


__all__ = ["trace", "default_loss", "fixed_bytes", "host_device_bandwidth", "OPTIMIZER_STATE", "GRANULARITIES",
           "PROFILES"]
