"""What every frontend shares: the interface a granularity implements, and the trace around it.

A *frontend* turns one training step of a model into the nodes of a `Graph` at one granularity
(`modules.ModuleFrontend`: one node per module call, or per op of the forward with autograd's
backward beside it; `joint.JointFrontend`: one node per op of the joint forward+backward graph).
It implements four steps on a `TraceContext` (the model, its example inputs on the device, the
loss, the profiling options):

1. ``capture(ctx)``: the model's computation as an fx graph (torch.export, an eager recording,
   or AOTAutograd's joint graph);
2. ``cut(ctx)``: that graph cut into the units that become nodes;
3. ``profile(ctx)``: each unit run on real tensors: bytes kept for the backward, workspace,
   time (measured, or from FLOP counts);
4. ``assemble(ctx)``: the nodes, the edges, and the meta that are the frontend's own.

`trace_with(frontend, ctx)` runs them in that order with what every granularity needs around
them: the RNG state and the model's buffers (BatchNorm statistics) restored afterwards, the CUDA
libraries' workspaces measured while profiling (`LibraryWorkspaces`), the fixed bytes
(parameters, gradients, buffers, inputs, optimizer state), the meta of the step (`step_meta`)
and the time each part took.

Also here, for the executors and tools: `default_loss`, `split_inputs`, `model_fingerprint` (what a
plan was made for) and `plain_step_peaks` (one plain training step's peak).
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from remat.core.errors import InvalidInputError
from remat.core.graph import DEFAULT_BANDWIDTH, Graph, Node

from .measuring import LibraryWorkspaces, measure, measure_peak, unique_bytes
from .profile import FlopsModel

log = logging.getLogger(__name__)

# optimizer name -> state tensors per trainable parameter
OPTIMIZER_STATE = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1,
                   "adafactor": 1, "lion": 1}
DEFAULT_REPEATS = {"cuda": 5, "cpu": 3}  # timed runs per node; CPU runs are slow and steadier
PROFILES = ("measure", "flops")
# how the training loop treats parameter gradients between steps: "accumulated" (PyTorch's default
# `zero_grad()`, set_to_none=True: each is allocated at its first accumulation in the backward)
# or "resident" (`zero_grad(set_to_none=False)`: kept, so fixed bytes for the whole step)
GRADS = ("accumulated", "resident")

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


# ---- inputs ------------------------------------------------------------------------------
def model_inputs(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, count: int | None = None) -> tuple:
    """The positional inputs `model` takes out of a batch `args`; the rest are the loss's alone,
    such as a classifier's labels: for a batch ``(images, labels)`` the step is
    ``loss_fn(model(images), images, labels)``.  They are inputs of the traced step like the
    others, on the device, read by the loss.  `count` (``remat.trace(..., model_inputs=k)``,
    recorded as ``meta["model_inputs"]``) says how many the model takes; without it, all of them
    up to the last positional parameter of its ``forward`` (all where it takes ``*args``;
    parameters given in `kwargs` do not count): an input the model could take goes to the model
    (for ``forward(x, mask=None)`` the labels would be the mask: say ``model_inputs=1``).  A
    ``torch.compile``'d module counts as the module it compiles."""
    import inspect
    if count is not None:
        return args[:count]
    # (``torch.compile(model)`` forwards ``*args``: the signature is its original module's)
    model = getattr(model, "_orig_mod", model)
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return args
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return args
    named = set(kwargs or ())
    takes = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in named for p in params)
    return args[:takes]


def step_loss(model: torch.nn.Module, loss_fn: Callable, args: tuple, kwargs: dict | None = None,
              count: int | None = None) -> torch.Tensor:
    """One step's loss, ``loss_fn(model(*model_inputs(model, args, kwargs, count), **kwargs), *args)``."""
    kwargs = kwargs or {}
    return loss_fn(model(*model_inputs(model, args, kwargs, count), **kwargs), *args)


def check_model_inputs(count: Any, args: tuple) -> int | None:
    """`count` checked against a batch of ``len(args)`` positional inputs (None: the default rule)."""
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(args):
        raise InvalidInputError(f"model_inputs: expected a whole number from 0 to {len(args)} (the positional inputs "
                                f"the model takes; the rest go to the loss only), got {count!r}")
    return count


def split_inputs(example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
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


def resolve_device(model: torch.nn.Module, device: Any) -> torch.device:
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
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    dev = resolve_device(model, device)
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
        "input_shapes": input_shapes(args, kwargs),
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
                optimizer: str | None = None, runtime: int | None = None, grads: str = "accumulated") -> tuple[int, dict]:
    """(total, breakdown): parameters, gradients, buffers, inputs, optimizer state; each storage
    counted once (shared parameters, views).  The gradients are there only with
    ``grads="resident"`` (a loop that keeps them between steps); with ``"accumulated"`` they
    are the backward nodes' persistent bytes instead (``gradients`` is 0).  `runtime` (CUDA
    only, `LibraryWorkspaces`): the device bytes the CUDA libraries keep for the step, in the
    breakdown as ``runtime``."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    p_bytes = unique_bytes(params)
    g_bytes = unique_bytes(trainable)
    b_bytes = unique_bytes(model.buffers())
    inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
    seen = unique_bytes(params + list(model.buffers()))
    i_bytes = unique_bytes(params + list(model.buffers()) + inputs) - seen
    o_bytes = OPTIMIZER_STATE.get(optimizer or "", 0) * g_bytes
    breakdown = {"parameters": p_bytes, "gradients": g_bytes if grads == "resident" else 0, "buffers": b_bytes,
                 "inputs": i_bytes,
                 "optimizer": o_bytes}
    if runtime is not None:
        breakdown["runtime"] = int(runtime)
    return sum(breakdown.values()), breakdown


def rng_state_bytes(device: torch.device) -> int:
    """Device bytes of one saved generator state, what an executor keeps per random node to
    replay it (`runtime.RunBase.rng_of`): on the CPU ``torch.get_rng_state()`` (5,056 bytes, which
    the storage accounting does not see: no op makes it); on CUDA 0 (the states are host tensors)."""
    return int(torch.get_rng_state().numel()) if device.type == "cpu" else 0


def make_optimizer(name: str, params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The `torch.optim` optimizer an `OPTIMIZER_STATE` name stands for, with PyTorch's defaults
    (``sgd-momentum``: momentum 0.9).  ``lion`` has no `torch.optim` class: NotImplementedError."""
    optim = torch.optim
    table = {"sgd": lambda: optim.SGD(params, lr=lr), "sgd-momentum": lambda: optim.SGD(params, lr=lr, momentum=0.9),
             "adam": lambda: optim.Adam(params, lr=lr), "adamw": lambda: optim.AdamW(params, lr=lr),
             "rmsprop": lambda: optim.RMSprop(params, lr=lr), "adagrad": lambda: optim.Adagrad(params, lr=lr)}
    if hasattr(optim, "Adafactor"):
        table["adafactor"] = lambda: optim.Adafactor(params, lr=lr)
    if name not in table:
        raise NotImplementedError(f"optimizer {name!r}: torch.optim has no such optimizer here; its step cannot be "
                                  "run or measured")
    return table[name]()


def optimizer_tensors(opt: torch.optim.Optimizer) -> list:
    """The tensors an optimizer's state holds (momenta, step counters)."""
    return [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def optimizer_step_bytes(model: torch.nn.Module, optimizer: str | None, device: torch.device) -> int | None:
    """Device bytes ``optimizer.step()`` allocates above the parameters, gradients and its state
    while it runs (its transient: PyTorch's multi-tensor Adam holds a square root of every second
    moment at once, the per-tensor loop one parameter's worth): measured on copies of the
    trainable parameters with zero gradients, on the second step (the first allocates the
    state, which the fixed bytes count).  0 without an optimizer; None where torch.optim has no
    such optimizer (nothing measured).  Needs the parameters' bytes twice over, briefly."""
    if optimizer is None:
        return 0
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        opt = make_optimizer(optimizer, params)
    except NotImplementedError:
        return None
    opt.step()
    held = params + [p.grad for p in params] + optimizer_tensors(opt)
    # (on CUDA `measure_peak` is the device's whole peak, so the bytes before the step come off)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else unique_bytes(held)
    return max(0, measure_peak(opt.step, resident=held, device=device) - before)


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


# ---- the interface ------------------------------------------------------------------------
@dataclass
class TraceContext:
    """One trace's inputs, checked and moved to the device (`prepare`), and what a frontend keeps
    between its steps (`state`: its capture, its units, their profiles)."""
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    device: torch.device
    loss_fn: Callable
    name: str
    profile: str
    repeats: int
    warmup: int
    flops_model: FlopsModel
    optimizer: str | None
    grads: str = "accumulated"
    progress: bool = False
    model_inputs: int | None = None   # positional inputs the model takes (`model_inputs`); None: the default rule
    notes: list = field(default_factory=list)   # why a granularity fell back, for meta["capture_notes"]
    state: dict = field(default_factory=dict)

    @property
    def rng_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    @property
    def measure_time(self) -> bool:
        return self.profile == "measure"

    @property
    def flops(self) -> bool:
        return self.profile == "flops"


class Frontend(ABC):
    """One granularity's way from a model to a graph's nodes (module docstring)."""
    granularity: str = ""   # what meta["granularity"] records
    min_warmup = 1          # the fewest warm-up runs its profiling accepts
    need_grad = False       # refuse a model with no trainable parameter before capturing

    @abstractmethod
    def capture(self, ctx: TraceContext) -> None:
        """The model's computation as a graph, kept in ``ctx.state``; `CaptureError` says why not."""

    @abstractmethod
    def cut(self, ctx: TraceContext) -> None:
        """The captured graph cut into the units that become nodes."""

    @abstractmethod
    def profile(self, ctx: TraceContext) -> None:
        """Each unit run on real tensors: bytes, workspace, time."""

    @abstractmethod
    def assemble(self, ctx: TraceContext) -> tuple[list[Node], list[tuple[int, int]], dict]:
        """(nodes, edges, the meta that is this frontend's own)."""


def prepare(frontend: Frontend, model: torch.nn.Module, example_inputs: Any, *, example_kwargs: dict | None = None,
            loss_fn: Callable | None = None, profile: str = "measure", device: "str | torch.device | None" = None,
            repeats: int | None = None, warmup: int = 1, optimizer: str | None = None, name: str | None = None,
            flops_model: FlopsModel | None = None, progress: bool = False, grads: str = "accumulated",
            model_inputs: int | None = None) -> TraceContext:
    """The `TraceContext` of one trace: inputs checked (`InvalidInputError` names the bad one) and
    moved to the device with the model."""
    if profile not in PROFILES:
        raise InvalidInputError(f"profile: expected one of {PROFILES}, got {profile!r}")
    if grads not in GRADS:
        raise InvalidInputError(f"grads: expected one of {GRADS}, got {grads!r}")
    args, kwargs, dev, repeats, loss, model_name, fm = prepare_trace(
        model, example_inputs, example_kwargs, loss_fn, device, repeats, warmup, optimizer, name, flops_model,
        min_warmup=frontend.min_warmup, need_grad=frontend.need_grad)
    return TraceContext(model, args, kwargs, dev, loss, model_name, profile, repeats, warmup, fm, optimizer, grads,
                        progress, check_model_inputs(model_inputs, args))


def trace_with(frontend: Frontend, ctx: TraceContext) -> Graph:
    """Capture, cut, profile and assemble (module docstring), restoring the model's buffers and
    the RNG state afterwards; the graph with its fixed bytes and meta."""
    t_start = time.perf_counter()
    model, dev = ctx.model, ctx.device
    snapshot = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=ctx.rng_devices):
            t0 = time.perf_counter()
            frontend.capture(ctx)
            frontend.cut(ctx)
            t_capture = time.perf_counter() - t0
            t0 = time.perf_counter()
            with LibraryWorkspaces(dev) as libs:
                frontend.profile(ctx)
            t_profile = time.perf_counter() - t0
    finally:
        with torch.no_grad():
            for b, saved in snapshot:
                b.copy_(saved)
    fixed, breakdown = fixed_bytes(model, ctx.args, ctx.kwargs, ctx.optimizer,
                                   runtime=libs.bytes if dev.type == "cuda" else None, grads=ctx.grads)
    step_bytes = optimizer_step_bytes(model, ctx.optimizer, dev)
    if step_bytes is None:
        log.warning("optimizer %r: torch.optim has no such optimizer, so its step's transient bytes are not "
                    "measured nor counted at the step's end", ctx.optimizer)
        ctx.notes.append(f"optimizer {ctx.optimizer}: the step's transient not measured (no torch.optim class)")
    nodes, edges, meta = frontend.assemble(ctx)
    ctx.state.clear()   # (what capture and profiling hold is no part of the plain step on a device)
    plain_step = measured_plain_step(ctx)
    one = rng_state_bytes(dev)
    rng = one * len(meta.get("rng_nodes") or [])
    if rng:   # the executors keep a random node's generator state from its first run to the step's
        fixed += rng   # end, and a recomputation saves the current one beside it while it runs
        breakdown = {**breakdown, "rng_states": rng}
        meta = {**meta, "rng_state_bytes": rng}
        nodes = [replace(v, workspace_bytes=v.workspace_bytes + one,
                         extra={**v.extra, "scratch_bytes": int(v.extra.get("scratch_bytes") or 0) + one})
                 if v.extra.get("random") and v.part_of is None else v for v in nodes]
    graph = Graph(nodes, edges, fixed, {
        **step_meta(model, ctx.args, ctx.kwargs, dev, ctx.name, ctx.profile, ctx.repeats, ctx.warmup, ctx.flops_model,
                    ctx.loss_fn, ctx.optimizer, breakdown),
        "granularity": frontend.granularity, "grads": ctx.grads,
        **({"model_inputs": ctx.model_inputs} if ctx.model_inputs is not None else {}),
        **({"optimizer_step_bytes": step_bytes} if step_bytes else {}),
        **({"plain_step": plain_step} if plain_step else {}), **meta})
    total = time.perf_counter() - t_start
    graph.meta["trace_seconds"] = {"capture": round(t_capture, 4), "profile": round(t_profile, 4),
                                   "total": round(total, 4)}
    log.info("traced %s (%s): %d nodes, fixed %d bytes, %.2f s (profiling %.2f s)", ctx.name, frontend.granularity,
             graph.n, fixed, total, t_profile)
    return graph


def input_shapes(args: tuple, kwargs: dict) -> list:
    """The shapes of a step's tensor inputs, in pytree order (``meta["input_shapes"]``, and the
    shapes a plain step was measured at)."""
    return [list(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]


@contextmanager
def step_state_kept(model: torch.nn.Module, device: torch.device):
    """Around plain training steps run to measure them: afterwards the parameters' gradients,
    the model's buffers (BatchNorm's running statistics) and the RNG states are as before."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def measured_plain_step(ctx: TraceContext) -> dict | None:
    """One plain training step of the traced model measured as `remat run` meters a plan's
    (``meta["plain_step"]``, what `remat.core.plain` predicts a plain plan by): its peak on the
    allocator's meter (``peak_bytes``) and on the storage accounting (``storage_peak_bytes``),
    each one step with the gradients set to None before it, at the traced inputs (``input_shapes``).
    Only for a measured profile in PyTorch's default loop (no optimizer named, gradients
    accumulated from None): None otherwise, or when the step fails (then logged).  The model's
    gradients, buffers (BatchNorm's running statistics) and the RNG state are left as they were."""
    if ctx.profile != "measure" or ctx.optimizer is not None or ctx.grads != "accumulated":
        return None
    model = ctx.model
    params = list(model.parameters())
    resident = params + list(model.buffers()) + tree_flatten((ctx.args, ctx.kwargs))[0]   # (`measure` skips non-tensors)

    def step() -> None:
        step_loss(model, ctx.loss_fn, ctx.args, ctx.kwargs, ctx.model_inputs).backward()
    peaks = {}
    try:
        with step_state_kept(model, ctx.device):
            for key, meter in (("peak_bytes", "allocator"), ("storage_peak_bytes", "storage")):
                for p in params:
                    p.grad = None
                peaks[key] = measure(step, ctx.device, resident=resident, meter=meter).peak_bytes
    except Exception as e:   # (the trace itself ran the model: a failure here only loses the figure)
        log.info("the plain step was not measured: %s: %s", type(e).__name__, e)
        return None
    return {**peaks, "input_shapes": input_shapes(ctx.args, ctx.kwargs)}


def plain_step_peaks(model: torch.nn.Module, inputs: tuple, loss_fn: Callable | None = None) -> tuple[int, int]:
    """Peak bytes of one plain training step (forward, loss, backward) of `model` on `inputs`:
    (with the gradients kept from a previous step, as `zero_grad(set_to_none=False)` leaves
    them; with them freed, PyTorch's default `set_to_none=True`).  The model's state is
    restored afterwards; its gradients are left as None."""
    if loss_fn is None:
        loss_fn = default_loss

    def step() -> None:
        step_loss(model, loss_fn, tuple(inputs)).backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    resident = list(model.parameters()) + list(model.buffers()) + list(inputs)
    step()
    model.zero_grad(set_to_none=False)
    kept = measure_peak(step, resident=resident + [p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    freed = measure_peak(step, resident=resident)
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    return kept, freed


__all__ = ["Frontend", "TraceContext", "prepare", "trace_with", "default_loss", "model_inputs", "step_loss",
           "check_model_inputs", "split_inputs", "resolve_device", "prepare_trace", "step_meta", "model_fingerprint",
           "fixed_bytes", "host_device_bandwidth", "plain_step_peaks", "make_optimizer", "optimizer_tensors",
           "rng_state_bytes", "optimizer_step_bytes", "step_state_kept", "measured_plain_step", "input_shapes", "OPTIMIZER_STATE", "DEFAULT_REPEATS", "PROFILES", "GRADS"]
