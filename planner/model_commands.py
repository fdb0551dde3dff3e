"""What ``remat trace``, ``remat run`` and ``remat plan MODEL`` run: loading a MODEL, tracing it,
training with a plan (these import torch; the argument parsing stays in remat.cli, which does not).

MODEL is a zoo name (``remat.frontends.zoo.names()``), ``path/to/file.py:factory`` or
``package.module:factory`` (``torchvision.models:resnet50`` with ``--input-shape 3,224,224``).
A factory is called with no arguments (or with ``batch=N`` when ``--batch`` is given and it
names a ``batch`` parameter: not one it would take through ``**kwargs``, which torchvision's and
timm's factories hand to the model's constructor) and returns a model, or a pair
``(model, example_inputs)``.  ``--input-shape C,H,W`` makes the example input
``torch.randn(batch, C, H, W)`` (batch 1 unless ``--batch``); a factory that returns no inputs
needs it.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from typing import Any

from remat.core.errors import InvalidInputError, RematError
from remat.core.graph import file_format
from remat.core.plain import plain_obstacle, plain_prediction

log = logging.getLogger(__name__)

RAN_BY = {"native": "natively", "plain": "as plain autograd", "interpreter": "by the interpreter"}
FORMS = "a zoo model ({zoo}), path/to/file.py:FACTORY or package.module:FACTORY"


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``"3,224,224"`` or ``"3x224x224"`` -> (3, 224, 224)."""
    if text is None:
        return None
    parts = [p for p in text.replace("x", ",").replace(" ", "").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise InvalidInputError(f"--input-shape: expected whole numbers like 3,224,224, got {text!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise InvalidInputError(f"--input-shape: expected positive whole numbers like 3,224,224, got {text!r}")
    return shape


def load_model(spec: str, *, batch: int | None = None, input_shape: tuple | None = None,
               full: bool = False, seq_len: int | None = None) -> tuple[Any, tuple, str]:
    """(model, example_inputs, name) for a MODEL spec (see the module docstring); `seq_len`
    (``remat capacity --seq``): a zoo model's sequence length, or a factory's ``seq_len``
    parameter."""
    from remat.frontends import zoo
    forms = FORMS.format(zoo=", ".join(zoo.names()))
    if seq_len is not None and input_shape is not None:
        raise InvalidInputError("--seq: the sequence length is what capacity varies; drop --input-shape")
    if seq_len is not None and spec in zoo.names():
        if spec not in zoo.SEQUENCE_MODELS:
            raise InvalidInputError(f"--seq: the zoo model {spec!r} has no sequence length (zoo sequence models: "
                                    f"{', '.join(zoo.SEQUENCE_MODELS)}); leave --seq out to vary the batch")
        input_shape = (seq_len,)
    if spec in zoo.names():
        try:
            model, inputs = zoo.get(spec, full=full, batch=batch, input_shape=input_shape)
        except (ValueError, TypeError) as e:
            raise InvalidInputError(f"--input-shape: {e}") from None
        return model, inputs, spec
    if ":" not in spec:
        raise InvalidInputError(f"MODEL: unknown model {spec!r}; expected {forms}")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise InvalidInputError(f"MODEL: cannot read {spec!r}; expected {forms}")
    from remat.frontends import vision
    vision.prepare()   # user code importing transformers or torchvision finds it importable
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise InvalidInputError(f"MODEL: the file {where!r} does not exist")
        mod_name = f"_remat_model_{abs(hash(str(path.resolve())))}"
        try:
            sp = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(sp)
            sys.modules[mod_name] = module
            sp.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error in user code is the user's input
            raise InvalidInputError(f"MODEL: cannot load {where!r}: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001
            raise InvalidInputError(f"MODEL: cannot import module {where!r}: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise InvalidInputError(f"MODEL: {where!r} has no factory {attr!r}")
    if not callable(factory):
        raise InvalidInputError(f"MODEL: {where}:{attr} is not callable")
    kwargs = {}
    if batch is not None and _takes(factory, "batch"):
        kwargs["batch"] = batch
    if seq_len is not None:
        if not _takes(factory, "seq_len"):
            raise InvalidInputError(f"--seq: {where}:{attr} takes no seq_len parameter, so its sequence length "
                                    "cannot change; give the factory a seq_len parameter")
        kwargs["seq_len"] = seq_len
    try:
        made = factory(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise InvalidInputError(f"MODEL: {where}:{attr}() failed: {type(e).__name__}: {e}") from e
    import torch
    if isinstance(made, torch.nn.Module):
        model, inputs = made, None
    elif isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
    else:
        raise InvalidInputError(f"MODEL: {where}:{attr}() must return a torch.nn.Module or (module, example_inputs), "
                                f"got {type(made).__name__}")
    if input_shape is not None:
        inputs = (torch.randn(batch or 1, *input_shape),)
    elif inputs is None:
        raise InvalidInputError(f"MODEL: {where}:{attr}() returned a model without example inputs; pass "
                                "--input-shape (one example's shape, without the batch)")
    elif batch is not None and "batch" not in kwargs:
        log.warning("--batch %d: %s:%s takes no batch parameter; using the inputs it returned", batch, where, attr)
    stem = Path(where).stem if where.endswith(".py") else where.rsplit(".", 1)[-1]
    return model, inputs, f"{stem}:{attr}"


def _takes(fn: Any, name: str) -> bool:
    """`fn` names a parameter `name` (one taken only through ``**kwargs`` is not: torchvision's
    and timm's factories pass those on to the model's constructor)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params and params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)


def print_chosen(graph: Any) -> None:
    """The line saying which granularity and depth ``auto`` chose, and why."""
    for note in graph.meta.get("capture_notes") or []:
        if note.startswith(("granularity auto", "depth auto")):
            print(f"chosen     {note}")


def trace_model(spec: str, *, batch: int | None = None, input_shape: tuple | None = None, full: bool = False,
                progress: bool = True, **options: Any):
    from remat.frontends.tracing import trace
    model, inputs, name = load_model(spec, batch=batch, input_shape=input_shape, full=full)
    graph = trace(model, inputs, name=name, progress=progress, **options)
    graph.meta["model_spec"] = model_spec(spec, batch, input_shape, full)
    return graph


def model_spec(spec: str, batch: int | None, input_shape: tuple | None, full: bool, seq_len: int | None = None) -> dict:
    """How to build the model again from a graph's meta (`remat run --plan` without MODEL)."""
    out = {"model": spec, "batch": batch, "input_shape": list(input_shape) if input_shape else None, "full": full}
    if seq_len is not None:
        out["seq_len"] = seq_len
    return out


def run_run(args: Any, solver_options: dict, trace_options: dict | None = None) -> int:
    """``remat run``: train a few steps with a plan (given, or made here: traced with
    `trace_options`, planned with `solver_options`) and print predicted vs measured peak and time
    per step, then plain autograd's."""
    from remat.core.plan import load_plan
    from remat.core.units import format_bytes
    from remat.frontends.run import metered_prediction, run_meter, run_plan

    from .budget import baseline_peak
    from .planning import plan as make_plan
    shape = parse_shape(args.input_shape)
    if args.plan is not None and file_format(args.plan) == "remat.partition":
        return run_partitioned(args, shape)
    if getattr(args, "nproc", None) is not None:
        raise InvalidInputError("remat run: --nproc is for a partition plan (remat partition -o PARTITION.json, then "
                                "remat run --plan PARTITION.json); this run is on one device: drop --nproc")
    if args.plan is not None:
        p = load_plan(args.plan)
        which, options = model_from_spec(args, shape, p.graph.meta.get("model_spec") or {}, "traced")
        model, inputs, name = load_model(which, **options)
    else:
        if args.model is None:
            raise InvalidInputError("remat run: give MODEL with --budget, or --plan PLAN.json")
        model, inputs, name = load_model(args.model, batch=args.batch, input_shape=shape, full=args.full)
        from remat.frontends.tracing import trace
        graph = trace(model, inputs, name=name, progress=not args.no_progress, **(trace_options or {}))
        graph.meta["model_spec"] = model_spec(args.model, args.batch, shape, args.full)
        print(f"graph      {name}: {graph.n} nodes ({len(graph.forward_ids())} forward), fixed "
              f"{format_bytes(graph.fixed_bytes)}, checkpoint-all peak {format_bytes(baseline_peak(graph))}")
        print_chosen(graph)
        p = make_plan(graph, args.budget, args.solver, **solver_options)
        if args.output:
            p.save(args.output)
            print(f"wrote      {args.output}")
    pr, s = p.predicted, p.solver
    executor = getattr(args, "executor", "interpreter")
    if executor == "auto" and plain_obstacle(p.graph, p.schedule, p.budget_bytes) is None:
        pr = {**pr, **plain_prediction(p.graph, p.schedule)}   # (what runs is the traced plain step)
        print("executor   plain autograd (the plan asks nothing of the step; the plain step the trace measured "
              "fits the budget)")
    elif executor != "interpreter":  # what runs natively is what that execution predicts (`NativeExecution`)
        from remat.frontends.applying import native_refusal
        why = native_refusal(p)
        if why is None or executor == "native":
            from remat.core import native
            sched, kept = native.nativize(p.graph, p.schedule)
            pr = {**pr, **native.native_prediction(p.graph, sched)}
            print("executor   native (the model's own code with hooks)"
                  + (f"; kept resident where the plan recomputes: {', '.join(kept)}" if kept else ""))
        else:
            executor = "interpreter"
            print(f"executor   interpreter: {why}")
    unit = "s" if p.graph.meta.get("profiler") == "measure" else "s (flops model)"
    import torch
    meter = run_meter(p, getattr(args, "meter", "storage"), torch.device(args.device or next(model.parameters()).device))
    metered = metered_prediction(pr, pr["storage_peak_bytes"] if "storage_peak_bytes" in pr else p.storage_peak_bytes) \
        if meter == "storage" else pr
    seen = ("" if metered["peak_bytes"] == pr["peak_bytes"] else
            f" ({format_bytes(metered['peak_bytes'])} of tensor storages, what the CPU's storage meter sees)")
    print(f"plan       {s.get('name')}: {s.get('status')}, budget {format_bytes(p.budget_bytes)}, predicted peak "
          f"{format_bytes(pr['peak_bytes'])}{seen}, host {format_bytes(pr['host_peak_bytes'])}, time {pr['time']:.4g} "
          f"{unit} ({pr['overhead']:.3f}x)")
    pr = metered

    def show(k: int, loss: float, m) -> None:
        err = (m.peak_bytes - pr["peak_bytes"]) / pr["peak_bytes"] if pr["peak_bytes"] else 0.0
        print(f"step {k:<5} loss {loss:.6g}  peak {format_bytes(m.peak_bytes)} ({100 * err:+.1f}% of predicted)  "
              f"time {m.time * 1e3:.4g} ms")
    rep = run_plan(model, inputs, p, steps=args.steps, device=args.device, lr=args.lr, plain=not args.no_plain,
                   on_step=show, executor=executor, meter=meter)
    pr = {**pr, "peak_bytes": rep.predicted.get("peak_bytes", pr["peak_bytes"])}
    print(f"measured   peak {format_bytes(rep.peak_bytes)} vs predicted {format_bytes(pr['peak_bytes'])} "
          f"({100 * rep.peak_error:+.1f}%), budget {format_bytes(p.budget_bytes)}, host {format_bytes(rep.host_peak_bytes)} "
          f"vs predicted {format_bytes(pr['host_peak_bytes'])}; median step {rep.step_time * 1e3:.4g} ms on {rep.device}")
    if rep.plain is not None:
        print(f"plain      autograd steps: peak {format_bytes(rep.plain.peak_bytes)}, time {rep.plain.time * 1e3:.4g} ms; "
              f"planned/plain time {rep.step_time / rep.plain.time:.2f}x (predicted {pr['overhead']:.2f}x), "
              f"peak {rep.peak_bytes / rep.plain.peak_bytes:.2f}x")
    return 0


def model_from_spec(args: Any, shape: tuple | None, spec: dict, made: str) -> tuple[str, dict]:
    """(MODEL, `load_model`'s options) for a plan's model: the command line's where given, else
    the plan's `model_spec` (`model_spec`); `made` says how the plan came from the model."""
    which = args.model or spec.get("model")
    if which is None:
        raise InvalidInputError(f"remat run: the plan does not say which model it was {made} from; give MODEL")
    return which, {"batch": args.batch if args.batch is not None else spec.get("batch"),
                   "input_shape": shape or (tuple(spec["input_shape"]) if spec.get("input_shape") else None),
                   "full": args.full or bool(spec.get("full")), "seq_len": None if shape else spec.get("seq_len")}


def run_partitioned(args: Any, shape: tuple | None) -> int:
    """``remat run --plan PARTITION.json [--nproc N]``: train a few steps of a partition plan in
    N processes (`remat.distributed.launch`) and print per step the loss beside one process's,
    and per rank the measured peak and bytes sent beside the plan's."""
    import functools

    from remat.core.units import format_bytes

    from .distributed import launch
    from .partitioning import PartitionPlan
    plan = PartitionPlan.load(args.plan)
    plan.check_runnable()
    if args.nproc is not None and args.nproc != plan.devices:
        raise InvalidInputError(f"remat run: the partition plan is for {plan.devices} devices, --nproc is {args.nproc}: "
                                f"give --nproc {plan.devices} or partition again with --devices {args.nproc}")
    which, options = model_from_spec(args, shape, plan.model_spec, "partitioned")
    where = which.rpartition(":")[0]
    if where.endswith(".py") and not Path(where).is_file():   # (said here, not by every process)
        raise InvalidInputError(f"MODEL: the file {where!r} does not exist (the partition plan names it relative to "
                                "where remat partition ran); give MODEL")
    make = functools.partial(load_model, which, **options)
    device = args.device or "cpu"
    per_device = plan.comm_per_device
    print(f"partition  {plan.model}: {plan.devices} processes ({'nccl' if device == 'cuda' else 'gloo'}), predicted "
          f"per device: peak {format_bytes(plan.peak_bytes)}, sent {format_bytes(per_device)} a step "
          f"({format_bytes(plan.comm_bytes)} all devices)")
    rows = launch(plan, make, steps=args.steps, lr=args.lr, device_type=device, reference=not args.no_plain)
    differ = any(r["reference_loss"] is not None and abs(r["loss"] - r["reference_loss"]) > 1e-5 * abs(r["reference_loss"])
                 for r in rows)
    if differ and rows[0]["random"]:
        print("note       the step draws random numbers (dropout) that the ranks did not draw as one process does "
              "(CUDA's fused attention kernels draw their own way), so its loss is not one process's; set dropout "
              "to 0 to compare")
    for k in sorted({r["step"] for r in rows}):
        step = sorted((r for r in rows if r["step"] == k), key=lambda r: r["rank"])
        ref = step[0]["reference_loss"]
        sent = sum(r["comm_bytes"] for r in step)
        print(f"step {k:<5} loss {step[0]['loss']:.6g}" + (f" (one process: {ref:.6g})" if ref is not None else "")
              + f"  sent {format_bytes(sent)} ({100 * (sent - plan.comm_bytes) / max(plan.comm_bytes, 1):+.1f}% of "
              f"predicted)  time {max(r['seconds'] for r in step) * 1e3:.4g} ms")
        for r in step:
            predicted = r.get("predicted_peak") or plan.peak_bytes     # (a pipeline's: its stage's)
            err = 100 * (r["peak_bytes"] - predicted) / predicted if predicted else 0.0
            print(f"  rank {r['rank']:<3} peak {format_bytes(r['peak_bytes'])} ({err:+.1f}% of predicted)  sent "
                  f"{format_bytes(r['comm_bytes'])}")
    return 0


def _save(record: Any, path: str) -> None:
    """`record.save(path)` (a graph, a partition plan), a write failure as one line."""
    try:
        record.save(path)
    except OSError as e:
        raise RematError(f"cannot write {path!r}: {e.strerror or e}") from e


def run_trace(args: Any) -> int:
    """``remat trace``: trace MODEL, print a summary, write the graph."""
    from remat.core.units import format_bytes

    from .budget import baseline_peak
    graph = trace_model(args.model, batch=args.batch, input_shape=parse_shape(args.input_shape), full=args.full,
                        progress=not args.no_progress, granularity=args.granularity, depth=args.depth,
                        profile=args.profile, device=args.device, repeats=args.repeats, optimizer=args.optimizer,
                        capture_with=args.capture, grads=args.grads)
    m = graph.meta
    fb = m["fixed_breakdown"]
    n_fwd = len(graph.forward_ids())
    fwd = sum(v.time for v in graph.nodes if v.kind == "forward")
    bwd = sum(v.time for v in graph.nodes if v.kind == "backward")
    loss = sum(v.time for v in graph.nodes if v.kind == "loss")
    secs = m["trace_seconds"]
    how = (f"median of {m['profile_options']['repeats']} runs" if m["profiler"] == "measure"
           else "flops model, not measured")
    print(f"model      {m['model']}: batch {m['batch']}, inputs {m['input_shapes']}, {m['dtype']} on {m['device']}, "
          f"torch {m['torch']}")
    print(f"capture    {m['capture']}, {m['granularity']} granularity"
          + (f" (depth {m['depth']})" if m.get("depth") else "")
          + f": {n_fwd} forward nodes, {graph.n} nodes, {len(graph.edges)} edges")
    print_chosen(graph)
    grads = (f"gradients {format_bytes(fb['gradients'])}" if m.get("grads") != "accumulated" else
             f"gradients {format_bytes(graph.persistent_total)} allocated in the backward")
    print(f"memory     fixed {format_bytes(graph.fixed_bytes)} (parameters {format_bytes(fb['parameters'])}, {grads}, "
          f"buffers {format_bytes(fb['buffers'])}, inputs {format_bytes(fb['inputs'])}, "
          f"optimizer {format_bytes(fb['optimizer'])}"
          + (f", CUDA libraries' workspaces {format_bytes(fb['runtime'])}" if "runtime" in fb else "")
          + f"); checkpoint-all peak {format_bytes(baseline_peak(graph))}")
    print(f"time       forward {fwd * 1e3:.4g} ms, loss {loss * 1e3:.4g} ms, backward {bwd * 1e3:.4g} ms ({how})")
    print(f"trace      {secs['total']:.2f} s (capture {secs['capture']:.2f} s, profiling {secs['profile']:.2f} s = "
          f"{100 * secs['profile'] / secs['total'] if secs['total'] else 0:.0f}%)")
    _save(graph, args.output)
    print(f"wrote      {args.output}")
    return 0


def run_partition(args: Any) -> int:
    """``remat partition``: capture MODEL's step as ATen ops, split it over ``--devices``, print
    the split and the baselines, write the partition plan."""
    from remat.frontends.partitioning import op_graph

    from .partitioning import partition, report
    model, inputs, name = load_model(args.model, batch=args.batch, input_shape=parse_shape(args.input_shape),
                                     full=args.full)
    graph = op_graph(model, inputs, name=name)
    factor = {"none": 0.0, "sgd": 1.0, "adam": 2.0}[args.optimizer]
    if args.pipeline:
        from .partitioning import layer_placement
        p = layer_placement(graph, args.devices, factor, args.microbatches or args.devices, args.schedule,
                            args.balance, args.budget_bytes)
    else:
        p = partition(graph, args.devices, args.budget_bytes, optimizer_factor=factor,
                      recompute=not args.no_recompute, time_limit=args.time_limit, prove=args.prove)
    p.model_spec = model_spec(args.model, args.batch, parse_shape(args.input_shape), args.full)
    for line in report(p):
        print(line)
    _save(p, args.output)
    print(f"wrote {args.output}")
    return 0


def run_capacity(args: Any, solver_options: dict, trace_options: dict) -> int:
    """``remat capacity``: the largest batch (``--seq``: sequence length) whose planned step fits
    ``--memory``, per overhead level; a line per size probed as it is decided, the answers,
    plain autograd's and checkpoint-every-block's beside them, and the plan for the largest."""
    from remat.core.units import format_bytes
    from remat.sizing import capacity
    from remat.sizes import MAX_SIZE
    shape = parse_shape(args.input_shape)
    dim = "seq" if args.seq else "batch"
    sizes = parse_sizes(args.sizes)
    if sizes is None:  # the model's own size and twice it (a sequence: three lengths)
        _, inputs, _ = load_model(args.model, batch=args.batch, input_shape=shape, full=args.full)
        from remat.sizing import DEFAULT_SIZES, example_size
        own = example_size(inputs, dim) or DEFAULT_SIZES[dim][0]
        own = max(own, 2)
        sizes = [own * k for k in range(1, len(DEFAULT_SIZES[dim]) + 1)]

    def make(size: int):
        if dim == "batch":
            model, inputs, _ = load_model(args.model, batch=size, input_shape=shape, full=args.full)
        else:
            model, inputs, _ = load_model(args.model, batch=args.batch, full=args.full, seq_len=size)
        return model, inputs

    print(f"capacity   {args.model}: largest {dim} within {format_bytes(args.memory_bytes)}, overhead levels "
          f"1.00x, 1.10x, {args.max_overhead:.2f}x; tracing at {dim} {', '.join(map(str, sizes))}")
    print(f"{'probe':<10} {dim:>7}  {'keep-all peak':>13}  {'plan peak':>11}  {'overhead':>8}  status")

    def show(p) -> None:
        print(f"{'':<10} {p.size:>7}  {format_bytes(p.keep_all_bytes):>13}  "
              f"{format_bytes(p.peak_bytes) if p.peak_bytes is not None else '-':>11}  "
              f"{f'{p.overhead:.3f}x' if p.overhead is not None else '-':>8}  {p.status}", flush=True)
    swap = solver_options.get("swap")
    rep = capacity(make, args.memory_bytes, dim=dim, sizes=sizes, max_overhead=args.max_overhead, swap=swap,
                   solver=args.solver, time_limit=solver_options["time_limit"], gap=solver_options["gap"],
                   verify=args.verify, peers=not args.no_peers, max_size=args.max_size or MAX_SIZE,
                   device=args.device, on_probe=show, progress=not args.no_progress, **trace_options)
    fam, res = rep.family, rep.result
    g = fam.graphs[fam.sizes[0]]
    print(f"graph      {g.meta.get('granularity')} granularity, {g.n} nodes; costs {'linear' if fam.degree == 1 else 'quadratic'} "
          f"in the {dim} through {dim} {', '.join(map(str, fam.sizes))}")
    names = {1.0: "no recomputation"}
    for a in res.levels:
        label = names.get(a.level, f"<= {a.level:.2f}x")
        print(f"answer     {label:<17} {dim} {a.describe(dim)}")
    print(f"predicted  plain autograd (keep everything): {dim} {res.plain_size}")
    for peer in rep.peers:
        if peer.size is None:
            print(f"peer       {peer.name}: n/a ({peer.reason})")
            continue
        at = ", ".join(f"{format_bytes(peer.peaks[s]) if peer.peaks[s] is not None else 'out of memory'} at {s}"
                       for s in (peer.size, peer.size + 1) if s in peer.peaks)
        plain = rep.peers[0]
        top = max(peer.times)
        ratio = (f"; {peer.times[top] / plain.times[top]:.2f}x plain's step time at {dim} {top}"
                 if peer is not plain and plain.times.get(top) else "")
        print(f"peer       {peer.name}: {dim} {peer.size} (measured {at}{ratio})")
    v = rep.verification
    if v is not None:
        if v.plan is None:
            print(f"verify     {dim} {v.size}: {v.reason}")
        else:
            pr = v.plan.predicted
            print(f"verify     {dim} {v.size}: traced and planned ({v.plan.solver.get('status')}, predicted "
                  f"{format_bytes(pr['peak_bytes'])} at {pr['overhead']:.3f}x); one step measured "
                  f"{format_bytes(v.measured_bytes)} {'<=' if v.fits else '>'} {format_bytes(v.memory)} "
                  f"({RAN_BY.get(v.executor, 'by the interpreter')}, {v.meter} meter)")
    plan = rep.plan()
    if plan is None:
        print(f"no         {dim} fits {format_bytes(args.memory_bytes)}")
        return 1
    size = rep.verification.size if rep.verification is not None and rep.verification.plan is not None \
        else res.best().size
    plan.graph.meta["model_spec"] = model_spec(args.model, size if dim == "batch" else args.batch, shape, args.full,
                                               seq_len=size if dim == "seq" else None)
    plan.save(args.output)
    print(f"wrote      {args.output} ({dim} {size})")
    return 0 if v is None or v.fits else 1


def parse_sizes(text: str | None) -> list[int] | None:
    """``"2,4"`` -> [2, 4] (``--sizes``; `remat.capacity` wants two or more sizes >= 1)."""
    if text is None:
        return None
    try:
        return [int(p) for p in text.split(",") if p.strip()]  # (`remat.capacity` checks them)
    except ValueError:
        raise InvalidInputError(f"--sizes: expected whole numbers like 2,4, got {text!r}") from None


__all__ = ["load_model", "trace_model", "run_trace", "run_run", "run_capacity", "parse_shape", "parse_sizes"]
