"""Run each stage of a captured graph on its own and measure it.

A stage runs its ATen ops on real tensors: activation inputs become fresh leaves (cloned when
the stage writes into them), parameters are the model's own.  Per stage:

* forward and backward time: warm-up, then the median of ``repeats`` runs (CUDA events on a GPU,
  ``time.perf_counter`` elsewhere), or, for ``profile="flops"``, a deterministic cost from
  ``torch.utils.flop_counter`` (see `FlopsModel`);
* output bytes and saved bytes: unique storages of the outputs and of the tensors autograd packs
  (``saved_tensors_hooks``), leaving out parameters, buffers and the stage's inputs (a saved
  input is its producer's output, counted there);
* workspace: the peak of storages allocated while the stage runs above what it keeps
  (`StorageTracker`); for the backward, above the input gradients it returns.  With
  ``fresh_grads`` (a loop that zeroes gradients with PyTorch's default
  ``zero_grad(set_to_none=True)``) the stage's parameter gradients are None when its backward
  starts, as at their first accumulation: the workspace is the peak with the ones it allocates
  (``param_grads``, which stay: the graph's persistent bytes) and the saved tensors autograd
  frees as it goes, as the backward really runs.  Without it, parameter
  gradients exist before the backward (fixed bytes) and accumulate in place, so the backward's
  workspace holds each new parameter gradient only until it is added, as in a loop that keeps
  them (``zero_grad(set_to_none=False)``).
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .measuring import AllocatorWindow, StorageTracker, storage_bytes, storage_key, unique_bytes


@dataclass
class FlopsModel:
    """Deterministic time model: ``time = flops / flops_per_s + bytes / bytes_per_s``, where
    ``bytes`` are the bytes the stage's ops allocate (a floor for ops with no flop formula,
    which ``torch.utils.flop_counter`` counts as 0).  Defaults are an A100-class GPU in fp32/TF32
    (the compiler's estimator does the same with max(flops, 1); docs/references.md)."""
    flops_per_s: float = 50e12
    bytes_per_s: float = 1.5e12

    def time(self, flops: int, nbytes: int) -> float:
        return flops / self.flops_per_s + nbytes / self.bytes_per_s

    @classmethod
    def measured(cls, device: "torch.device | str" = "cpu", dtype: torch.dtype = torch.float32) -> "FlopsModel":
        """Rates measured on `device` (once per process, device and dtype): a square matrix
        product's FLOP/s and an elementwise op's bytes (read and written) per second, each the
        best of a few runs after a warm-up."""
        key = (str(torch.device(device)), dtype)
        if key not in _MEASURED:
            _MEASURED[key] = cls(*_measure_rates(torch.device(device), dtype))
        return _MEASURED[key]


_MEASURED: dict = {}


def _measure_rates(device: torch.device, dtype: torch.dtype, n: int = 768, elems: int = 1 << 21) -> tuple:
    """(FLOP/s of an n x n matrix product, bytes/s of ``x * 2.0`` over `elems` elements), on real
    tensors even where a fake mode is active (a compiler's backend runs under one): about 20 MiB
    for a moment."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily(), torch.no_grad():
        return _rates(device, dtype, n, elems)


def _rates(device: torch.device, dtype: torch.dtype, n: int, elems: int) -> tuple:
    timer = Timer(device)

    def best(fn: Callable[[], Any], repeats: int = 5) -> float:
        fn()
        out = []
        for _ in range(repeats):
            t0 = timer.mark()
            fn()
            out.append(timer.seconds(t0, timer.mark()))
        return max(min(out), 1e-9)
    a = torch.randn(n, n, device=device, dtype=dtype)
    x = torch.randn(elems, device=device, dtype=dtype)
    flops = 2 * n ** 3 / best(lambda: a @ a)
    per_byte = 2 * x.numel() * x.element_size() / best(lambda: x * 2.0)
    return flops, per_byte


@dataclass
class StageProfile:
    fwd_time: float = 0.0
    bwd_time: float = 0.0
    fwd_times: list = field(default_factory=list)
    bwd_times: list = field(default_factory=list)
    output_bytes: int = 0
    saved_bytes: int = 0
    retained_bytes: int = 0
    fwd_workspace: int = 0
    grad_bytes: int = 0            # gradients w.r.t. the stage's activation inputs
    param_grad_bytes: int = 0
    param_grads: dict = field(default_factory=dict)   # parameter (storage key) -> its gradient's bytes
    bwd_workspace: int = 0
    saves_input: list = field(default_factory=list)   # per input: does autograd save its storage
    saves_output: bool = False                        # does autograd save one of the outputs
    passes_input: list = field(default_factory=list)  # per input: is its storage (a view of) an output
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_alloc_bytes: int = 0
    bwd_alloc_bytes: int = 0
    random: bool = False
    mutated: list = field(default_factory=list)       # names of buffers/inputs written in place
    differentiable: bool = True
    recompute_time: float | None = None               # the forward's time with its inputs out of the caches
    fwd_scratch: int = 0      # of the workspaces, what kernels allocate inside themselves (the allocator's figure
    bwd_scratch: int = 0      # above the storages' peak: `AllocatorWindow.hidden`)
    engine_release: int = 0   # how much lower the backward peaks when autograd's engine owns the incoming gradient


RANDOM_TAG = torch.Tag.nondeterministic_seeded


def is_random(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and RANDOM_TAG in t.tags


def writes_of(node: fx.Node) -> list:
    """Argument values the op writes in place (from its schema)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return []
    out = []
    for idx, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = node.args[idx] if idx < len(node.args) else node.kwargs.get(a.name)
            if isinstance(val, fx.Node):
                out.append(val)
    return out


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.name = "cuda events" if self.cuda else "perf_counter"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def cache_bytes(device: torch.device) -> int:
    """Bytes of the device's last-level cache: twice CUDA's L2 (``L2_cache_size``), on a CPU the
    largest cache Linux lists for cpu0 (sysfs), else 64 MiB; at least 8 MiB."""
    if device.type == "cuda":
        return max(8 << 20, 2 * int(torch.cuda.get_device_properties(device).L2_cache_size))
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(8 << 20, max(sizes, default=64 << 20))


def cold_factors(runs: list[Callable[[], Any]], device: torch.device, repeats: int) -> list[float]:
    """Per run of `runs`, how much longer it takes as a recomputation finds the caches (without
    its inputs, its parameters or the memory it writes) than with them warm: the median over
    `repeats` pairs of cold / warm seconds, each pair a run right after writing a buffer of the
    last-level cache's size (`cache_bytes`; Triton's ``do_bench`` empties the L2 the same way
    before it times a kernel) and the same run again at once.

    A recomputation reads tensors saved long before and writes into memory the step has not
    touched lately, while a profile that runs a node in a loop finds all of them in the caches
    (on a 2-core CPU a recomputed bottleneck block took 1.8x, a batch norm 3x, its looped time).
    A smaller buffer does not reproduce the step: on the 2-core CPU machine (zoo ResNet-50,
    batch 8, 64 px, recomputed natively) a buffer of twice what the step allocates priced the
    recomputations at 1/1.5 of what they took in the step, the whole cache at what they took.
    The ratio of adjacent runs, not the cold run's own seconds: on a shared machine writing the
    whole cache (480 MiB there) slows every run for a while, and an attention block that
    dropout's random numbers keep compute-bound (45 ms, the same warm or cold) timed cold at 50
    to 150 ms from one trace to the next; its pair's warm run slows alike.

    The module frontend prices its forward nodes' recomputations so (`Node.recompute_time`, the
    looped forward time times the factor): a module is recomputed whole, its entry reading saved
    inputs.  The joint graph does not: there a recomputation runs as a chain of ops, each but
    the first reading its predecessor's fresh output, so each op priced cold overshoots (zoo
    ResNet-50's op-level plan at 0.5x predicted 1.41x plain's step where it measured 1.21x); its
    nodes keep the first compute's time."""
    timer = Timer(device)
    flush = torch.empty(cache_bytes(device), dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for run in runs:
        ratios = []
        for _ in range(repeats):
            flush.zero_()
            sync()
            a = timer.mark()
            run()
            b = timer.mark()
            run()
            c = timer.mark()
            cold, warm = timer.seconds(a, b), timer.seconds(b, c)
            ratios.append(cold / warm if warm > 0 else 1.0)
        out.append(statistics.median(ratios))
    del flush
    return out


def release_plan(nodes: list, keep: list) -> dict:
    """{node: values to drop right after it runs}: each value of `nodes` goes after its last use
    inside `nodes` (at once if it has none), unless it is in `keep`, so a stage's intermediates
    are freed when eager PyTorch would free them."""
    own = set(nodes)
    keep_set = set(keep)
    last: dict = {}
    for n in nodes:
        last[n] = n
        for u in n.all_input_nodes:
            if u in own:
                last[u] = n
    plan: dict = {}
    for value, at in last.items():
        if value not in keep_set:
            plan.setdefault(at, []).append(value)
    return plan


def run_nodes(nodes: list, env: dict, release: dict | None = None) -> dict:
    """Evaluate fx call_function nodes in order; `env` maps outside nodes to values.  With a
    `release_plan`, intermediates are dropped after their last use."""
    local = dict(env)
    get = local.__getitem__
    for n in nodes:
        args = fx.node.map_arg(n.args, get)
        kwargs = fx.node.map_arg(n.kwargs, get)
        local[n] = n.target(*args, **kwargs)
        del args, kwargs
        if release:
            for v in release.get(n, ()):
                del local[v]
    return local


def _tensors(xs: Any) -> list:
    return [t for t in tree_flatten(xs)[0] if isinstance(t, torch.Tensor)]


class Runner:
    """A differentiable function of a stage: ``forward(inputs) -> outputs`` plus how to make
    its inputs and take its backward.  `grad_inputs` are the positions whose gradient is wanted
    (activations); parameters come through `params`."""

    def __init__(self, forward: Callable[[list], list], values: list, grad_inputs: list[int],
                 cloned_inputs: list[int], params: list):
        self.forward = forward
        self.values = values
        self.grad_inputs = grad_inputs
        self.cloned = set(cloned_inputs)
        self.params = params

    def make_inputs(self) -> tuple[list, list, list]:
        """(arguments, leaves wanting gradients, clones made)"""
        args, leaves, clones = [], [], []
        for k, v in enumerate(self.values):
            if k in self.grad_inputs:
                leaf = v.detach().requires_grad_(True)
                leaves.append(leaf)
                v = leaf
            if k in self.cloned and isinstance(v, torch.Tensor):
                v = v.clone()
                clones.append(v)
            args.append(v)
        return args, leaves, clones


def _diff(outputs: list) -> list:
    return [o for o in _tensors(outputs) if o.requires_grad]


def _backward(outs: list, grad_outs: list | None, leaves: list, params: list) -> list:
    """Backward into the parameters' ``.grad`` (accumulating into their existing gradients, as
    in a training loop that keeps them); returns the gradients that reach the leaves, taken by
    tensor hooks before the leaves' own accumulation (which a real graph does not have: there
    the gradient flows on into the producer's backward)."""
    targets = leaves + params
    if not outs or not targets:
        return [None] * len(leaves)
    got: list = [None] * len(leaves)

    def keep(i: int):
        def hook(g: torch.Tensor) -> None:
            got[i] = g
        return hook
    handles = [leaf.register_hook(keep(i)) for i, leaf in enumerate(leaves)]
    try:
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(outs, grad_outs, inputs=targets)
    finally:
        for h in handles:
            h.remove()
    return got


def profile_runner(runner: Runner, *, device: torch.device, ignore: list, measure_time: bool, warmup: int,
                   repeats: int, grad_outputs: Callable[[list], list] | None = None,
                   flops: bool = False, fresh_grads: bool = False) -> tuple[StageProfile, list]:
    """Profile one stage (see the module docstring).  Returns (profile, [(output, whether it
    requires grad)]) from the measured run, for the stages that consume them.

    Runs: one measured run (storages, saved tensors, flops; it is also the first warm-up), then
    ``warmup - 1`` more warm-up runs and ``repeats`` timed ones when `measure_time`."""
    timer = Timer(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    if device.type == "cuda":
        # a first run makes what the CUDA libraries keep (cuBLAS workspaces, handles): not
        # this stage's workspace (`LibraryWorkspaces` counts them for the whole step)
        _warm_run(runner, grad_outputs)
    # no garbage collection in the middle of the measured run: storages are released when
    # their last reference goes, deterministically
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        prof, outs, gouts = _measured_run(runner, ignore, grad_outputs, flops, device, fresh_grads)
    finally:
        if gc_was_enabled:
            gc.enable()

    if measure_time:
        fw, bw = [], []
        for r in range(warmup - 1 + repeats):
            args, leaves, _ = runner.make_inputs()
            sync()
            t0 = timer.mark()
            o = runner.forward(args)
            t1 = timer.mark()
            diff = _diff(o)
            _backward(diff, gouts, leaves, runner.params)
            t2 = timer.mark()
            if r >= warmup - 1:
                fw.append(timer.seconds(t0, t1))
                bw.append(timer.seconds(t1, t2))
            del args, leaves, o, diff
        prof.fwd_times, prof.bwd_times = fw, bw
        prof.fwd_time = statistics.median(fw) if fw else 0.0
        prof.bwd_time = statistics.median(bw) if bw and prof.differentiable else 0.0
    return prof, outs


def _warm_run(runner: Runner, grad_outputs: Callable[[list], list] | None) -> None:
    args, leaves, _ = runner.make_inputs()
    diff = _diff(runner.forward(args))
    if diff:
        _backward(diff, grad_outputs(diff) if grad_outputs else [torch.ones_like(o) for o in diff], leaves,
                  runner.params)


def _measured_run(runner: Runner, ignore: list, grad_outputs: Callable[[list], list] | None,
                  flops: bool, device: torch.device = torch.device("cpu"),
                  fresh_grads: bool = False) -> tuple[StageProfile, list, list | None]:
    prof = StageProfile()
    args, leaves, clones = runner.make_inputs()
    tracker = StorageTracker(record_events=True)
    tracker.ignore(ignore)
    tracker.ignore(runner.values)
    tracker.ignore(args)
    input_keys = {}
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            input_keys.setdefault(storage_key(a), k)
    for k, v in enumerate(runner.values):
        if isinstance(v, torch.Tensor):
            input_keys.setdefault(storage_key(v), k)
    excluded = set(tracker.ignored)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(storage_key(t), storage_bytes(t))
        return t.detach()

    counter_f = _flop_counter() if flops else None
    counter_b = _flop_counter() if flops else None
    with tracker:
        m0 = tracker.mark()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (counter_f or _null()), \
                AllocatorWindow(device, cpu_events=True) as alloc_f:
            outs = runner.forward(args)
        m1 = tracker.mark()
        diff = _diff(outs)
        prof.differentiable = bool(diff)
        out_keys = {storage_key(t): storage_bytes(t) for t in _tensors(outs)}
        own_out = {k: b for k, b in out_keys.items() if k not in excluded}
        own_saved = {k: b for k, b in saved.items() if k not in excluded and k not in own_out}
        prof.output_bytes = sum(own_out.values())
        prof.saved_bytes = sum(own_saved.values())
        prof.saves_output = any(k in saved for k in own_out)
        prof.retained_bytes = sum(tracker.new_live(m0).values())
        kept = max(prof.output_bytes + prof.saved_bytes, prof.retained_bytes)
        # on CUDA also what the kernels allocate internally (cuDNN's workspaces, say)
        visible = tracker.peak_between(m0, m1)
        prof.fwd_scratch = alloc_f.hidden(tracker, m0, m1)
        prof.fwd_workspace = max(0, visible - kept) + prof.fwd_scratch
        prof.fwd_alloc_bytes = sum(d for _, d in tracker.events[m0:m1] if d > 0)
        saved_inputs = {input_keys[k] for k in saved if k in input_keys}
        prof.saves_input = [k in saved_inputs for k in range(len(runner.values))]
        passed = {input_keys[k] for k in out_keys if k in input_keys}
        prof.passes_input = [k in passed for k in range(len(runner.values))]
        # the incoming gradients stand for the consumers' backward outputs: made here, then
        # left out of this node's backward figures
        gouts = grad_outputs(diff) if grad_outputs else [torch.ones_like(o) for o in diff]
        gout_keys = {storage_key(g) for g in gouts or []}
        if fresh_grads:
            for p in runner.params:
                p.grad = None
        mb = tracker.mark()
        with (counter_b or _null()), AllocatorWindow(device, cpu_events=True) as alloc_b:
            grads = _backward(diff, gouts, leaves, runner.params)
        m2 = tracker.mark()
        # gradients w.r.t. the inputs: counted in full even when one passes an incoming
        # gradient through (it then outlives the consumer's backward node that made it)
        in_keys = {storage_key(g): storage_bytes(g) for g in grads if g is not None}
        prof.grad_bytes = sum(in_keys.values())
        new_grad_bytes = sum(b for k, b in in_keys.items() if k in tracker.live and k not in gout_keys)
        artefacts = _leaf_artefacts(tracker, leaves, in_keys)
        prof.param_grad_bytes = unique_bytes(p.grad for p in runner.params if p.grad is not None)
        prof.param_grads = {storage_key(p): storage_bytes(p.grad) for p in runner.params if p.grad is not None}
        prof.bwd_scratch = alloc_b.hidden(tracker, mb, m2)
        prof.bwd_workspace = max(0, tracker.peak_between(mb, m2, exclude=artefacts) - new_grad_bytes) + prof.bwd_scratch
        prof.bwd_alloc_bytes = sum(d for k, d in tracker.events[mb:m2] if d > 0 and k not in artefacts)
        plain = [(o.detach(), o.requires_grad) if isinstance(o, torch.Tensor) else (o, False) for o in outs]
        del grads, outs, diff
        if prof.differentiable and gouts is not None:
            held = tracker.peak_between(mb, m2, exclude=artefacts) + unique_bytes(gouts)
            prof.engine_release = max(0, held - _engine_owned_peak(runner, gouts, tracker, fresh_grads))
    prof.fwd_flops = counter_f.get_total_flops() if counter_f else 0
    prof.bwd_flops = counter_b.get_total_flops() if counter_b else 0
    del args, leaves, clones
    return prof, plain, gouts


def _leaf_artefacts(tracker: StorageTracker, leaves: list, returned: Iterable) -> set:
    """The uids of the leaves' own accumulated gradients (``leaf.grad``), an artefact of running a
    stage alone, but those whose storage is a gradient the backward returned (`returned` keys)."""
    returned = set(returned)
    return {tracker.uid(leaf.grad) for leaf in leaves
            if leaf.grad is not None and storage_key(leaf.grad) not in returned} - {None}


def _engine_owned_peak(runner: Runner, gouts: list, tracker: StorageTracker, fresh_grads: bool) -> int:
    """The stage's backward peak (above the live bytes before it, the incoming gradient
    included) when autograd's engine makes the incoming gradient, as in a model's own step: the
    outputs times the gradients, summed, and the backward of that, whose product's backward hands
    the stage a gradient nothing else holds, which the engine frees once the stage's first
    function has read it (a profile that passes the gradient in holds it to the end)."""
    args, leaves, _ = runner.make_inputs()
    diff = _diff(runner.forward(args))
    loss = sum((o * g).sum() for o, g in zip(diff, gouts))
    if fresh_grads:
        for p in runner.params:
            p.grad = None
    m = tracker.mark()
    grads = _backward([loss], None, leaves, runner.params)
    returned = [storage_key(g) for g in grads if g is not None]
    peak = tracker.peak_between(m, exclude=_leaf_artefacts(tracker, leaves, returned))
    del args, leaves, diff, loss, grads
    return peak


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode
    return FlopCounterMode(display=False)


__all__ = ["FlopsModel", "StageProfile", "Runner", "profile_runner", "cache_bytes", "cold_factors", "run_nodes", "is_random", "writes_of",
           "Timer", "release_plan"]
