"""The ``remat`` command line: plan, trace, run, simulate, sweep, solvers, generate, show.

Exit codes (docs/design.md, "Clear failure"): 0 ok; 1 runtime failure (`RematError` with exit_code 1, e.g.
an infeasible budget, or a plan that does not fit its budget); 2 bad input (`InvalidInputError`,
bad arguments).  Errors are one line, ``remat: error: ...``, on stderr; ``--debug`` shows the
traceback instead.  The command's results go to stdout; diagnostics go through `logging`
(``-v`` for more).
"""
from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from .budget import FORMS, baseline_peak, budget_list, format_bytes, format_bytes_exact
from remat.core.errors import InvalidInputError, RematError

log = logging.getLogger("remat")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one ``remat: error:`` line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _fmt_time(t: float | None) -> str:
    return "-" if t is None else f"{t:.4g} s"


def _fmt_num(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.2f}%"
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _fmt_overhead(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


# ---- plan ----------------------------------------------------------------------------
def solver_options(args: argparse.Namespace) -> dict:
    """The solver options of `remat plan`, `sweep` and `run` from their arguments."""
    swap = False if args.no_swap else True if args.swap else None  # (None: `planning.default_swap`)
    opts: dict[str, Any] = {"swap": swap, "time_limit": args.time_limit, "gap": args.gap}
    if args.threads is not None:
        opts["threads"] = args.threads
    if args.backend is not None:
        opts["backend"] = args.backend
    if args.mode != "auto":
        opts["mode"] = args.mode
    if getattr(args, "executor", None) == "native":  # (`remat run --executor native` plans in that class too)
        opts["executor"] = "native"
    return opts


def cmd_plan(args: argparse.Namespace) -> int:
    from remat.planning import plan
    graph = _graph_or_model(args.graph, progress=not args.no_progress, options=trace_options(args))
    base = baseline_peak(graph)
    log.info("planning %s (%d nodes) at budget %s with solver %s", args.graph, graph.n, args.budget, args.solver)
    opts = solver_options(args)
    if args.solver == "ilp" and not args.no_progress:
        opts["progress"] = _ilp_progress_printer()
    p = plan(graph, args.budget, args.solver, **opts)
    s, pr = p.solver, p.predicted
    backend = f" ({s['backend']})" if s.get("backend") else ""
    print(f"graph      {args.graph}: {graph.n} nodes, fixed {format_bytes(graph.fixed_bytes)}, "
          f"checkpoint-all peak {format_bytes(base)}")
    print(f"budget     {format_bytes_exact(p.budget_bytes)} ({p.budget_bytes / base:.2f}x of checkpoint-all)")
    source = f" ({s['bound_from']})" if s.get("bound_from") and s.get("lower_bound") is not None else ""
    print(f"solver     {s['name']}{backend}: {s.get('status')}, objective {_fmt_num(s.get('objective'))}, "
          f"lower bound {_fmt_num(s.get('lower_bound'))}{source}, gap {_fmt_num(s.get('gap'), pct=True)}, "
          f"wall {_fmt_time(s.get('wall_time'))}")
    print(f"predicted  peak {format_bytes(pr['peak_bytes'])} (fixed {format_bytes(pr['fixed_bytes'])} + "
          f"activations {format_bytes(pr['activation_peak_bytes'])}), host peak {format_bytes(pr['host_peak_bytes'])}")
    print(f"           time {_fmt_time(pr['time'])}, overhead {pr['overhead']:.3f}x of checkpoint-all")
    _write(args.output, p.save)
    print(f"wrote      {args.output}")
    return 0


def _ilp_progress_printer():
    """A progress callback for the ILP: one status line on stderr (rewritten in place on a
    terminal, else a line per change at most every 2 s)."""
    tty = sys.stderr.isatty()
    last = {"t": -1e9, "text": ""}

    def show(d: dict) -> None:
        phase = f"  [{d['phase']}]" if d.get("phase") and d["phase"] != "done" else ""
        text = (f"ilp: {d['elapsed']:6.1f} s  incumbent {_fmt_num(d['incumbent'])}  "
                f"bound {_fmt_num(d['lower_bound'])}  gap {_fmt_num(d['gap'], pct=True)}{phase}")
        if text == last["text"] or (not tty and d["elapsed"] - last["t"] < 2.0):
            return
        last.update(t=d["elapsed"], text=text)
        sys.stderr.write(("\r" + text) if tty else (text + "\n"))
        sys.stderr.flush()
    return show


# ---- simulate ------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from remat.core.plan import load_plan
    from remat.core.simulate import simulate
    from remat.solvers.baselines import checkpoint_all
    p = load_plan(args.plan)
    if args.bandwidth is not None and not args.bandwidth > 0:
        raise InvalidInputError(f"--bandwidth: must be > 0 bytes/s, got {args.bandwidth}")
    graph = p.graph
    res = simulate(graph, p.schedule, args.bandwidth)
    base = simulate(graph, checkpoint_all(graph), args.bandwidth)
    bw = args.bandwidth if args.bandwidth is not None else graph.bandwidth
    print(f"plan       {args.plan}: solver {p.solver.get('name')} ({p.solver.get('status')}), "
          f"graph {p.graph_hash}, {graph.n} nodes, bandwidth {bw:.6g} bytes/s")
    print(f"peak       {format_bytes_exact(res.peak_bytes)} ({res.peak_bytes / base.peak_bytes:.2f}x of "
          f"checkpoint-all's {format_bytes(base.peak_bytes)})")
    print(f"           fixed {format_bytes(graph.fixed_bytes)}, activations {format_bytes(res.activation_peak_bytes)}, "
          f"host {format_bytes(res.host_peak_bytes)}")
    print(f"time       {_fmt_time(res.time)} (overhead {res.overhead(graph):.3f}x of checkpoint-all's "
          f"{_fmt_time(graph.total_time)}); compute {_fmt_time(res.compute_time)}, "
          f"transfers {_fmt_time(res.transfer_time)}")
    recomputed = sum(c - 1 for c in res.compute_counts if c > 1)
    print(f"ops        {len(p.schedule.ops)}: recomputations {recomputed}, "
          f"swap-outs {sum(o.op == 'swap_out' for o in p.schedule.ops)}")
    fits = res.peak_bytes <= p.budget_bytes
    verdict = "yes" if fits else f"NO, over by {format_bytes_exact(res.peak_bytes - p.budget_bytes)}"
    print(f"budget     {format_bytes_exact(p.budget_bytes)}: fits {verdict}")
    if not fits:
        raise RematError(f"the plan peaks at {format_bytes_exact(res.peak_bytes)}, over its budget of "
                         f"{format_bytes_exact(p.budget_bytes)}")
    return 0


# ---- sweep ---------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from remat import solvers as registry
    from remat.core.graph import Graph
    from remat.planning import SWEEP_COLUMNS, sweep
    graph = Graph.load(args.graph)
    budgets = budget_list(args.budgets, graph)
    names = [s.strip() for s in args.solvers.split(",") if s.strip()]
    if not names:
        raise InvalidInputError("--solvers: expected a comma list of solver names (see `remat solvers`)")
    for name in names:
        try:
            registry.get(name)
        except InvalidInputError as e:
            raise InvalidInputError(str(e).replace("--solver:", "--solvers:", 1)) from None
    opts = solver_options(args)
    if args.plot:
        _check_figure_path(args.plot, "--plot")  # before the solves, not after them
    rows = []
    with tqdm(total=len(budgets) * len(names), file=sys.stderr, unit="solve", desc="sweep",
              disable=args.no_progress) as bar:
        for row in sweep(graph, budgets, names, **opts):
            rows.append(row)
            bar.set_postfix_str(f"{row['solver']} @ {format_bytes(row['budget_bytes'])}: {row['status']}")
            bar.update()

    def write(path: Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS))
            w.writeheader()
            for r in rows:
                w.writerow({k: ("" if r[k] is None else r[k]) for k in SWEEP_COLUMNS})
    _write(args.output, write)

    print(f"{'budget':>12} {'ratio':>6}  {'solver':<22} {'status':<10} {'overhead':>9} {'peak':>12} {'gap':>8}")
    for r in rows:
        print(f"{format_bytes(r['budget_bytes']):>12} {r['budget_ratio']:>6.2f}  {r['solver']:<22} "
              f"{r['status']:<10} {_fmt_overhead(r['overhead']):>9} "
              f"{format_bytes(r['peak_bytes']):>12} {_fmt_num(r['gap'], pct=True):>8}")
    n_inf = sum(r["status"] == "infeasible" for r in rows)
    n_err = sum(r["status"] == "error" for r in rows)
    print(f"wrote {args.output}: {len(rows)} rows ({len(rows) - n_inf - n_err} solved, {n_inf} infeasible"
          + (f", {n_err} errors" if n_err else "") + ")")
    if args.plot:
        from . import viz
        model = graph.meta.get("model") or Path(args.graph).name
        fig = viz.plot_sweep(rows, base_time=graph.total_time,
                             title=f"{model}: overhead against budget ({'no swap' if args.no_swap else 'with swap'})")
        _write(args.plot, lambda path: fig.savefig(path, dpi=150))
        print(f"wrote {args.plot}")
    return 0


# ---- show ----------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    from remat.core.plan import load_plan
    p = load_plan(args.plan)
    _check_figure_path(args.output, "-o")
    from . import viz
    fig = viz.plot_plan(p, args.kind, x=args.x)
    _write(args.output, lambda path: fig.savefig(path, dpi=args.dpi))
    print(f"wrote {args.output}: {args.kind} of {args.plan} ({p.graph.n} nodes, {len(p.schedule.ops)} ops, "
          f"solver {p.solver.get('name')}, budget {format_bytes(p.budget_bytes)})")
    return 0


def _check_figure_path(path: str, option: str) -> None:
    """Fail before any work when a figure cannot be written: no folder, or a format matplotlib
    does not write (the extension picks it)."""
    from matplotlib.figure import Figure
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InvalidInputError(f"{option}: the folder {str(p.parent)!r} does not exist")
    kinds = Figure().canvas.get_supported_filetypes()
    ext = p.suffix.lstrip(".").lower()
    if ext not in kinds:
        raise InvalidInputError(f"{option}: cannot tell the image format from {path!r}; end it in one of "
                                f"{', '.join('.' + k for k in sorted(kinds))}")


# ---- solvers -------------------------------------------------------------------------
def cmd_solvers(args: argparse.Namespace) -> int:
    from remat import solvers as registry
    desc = registry.describe()
    width = max(len(k) for k in desc)
    for name, text in desc.items():
        print(f"{name:<{width}}  {text}")
    return 0


# ---- generate ------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from . import generators as gen
    if args.kind == "chain":
        graph = gen.linear_chain(args.layers, fwd_time=args.fwd_time, bwd_time=args.bwd_time, size=args.size,
                                 bandwidth=args.bandwidth, fixed_bytes=args.fixed_bytes)
    elif args.kind == "random":
        graph = gen.random_layered(args.nodes, width=args.width, skip_prob=args.skip_prob, seed=args.seed,
                                   max_size=args.max_size, bandwidth=args.bandwidth)
    else:
        graph = gen.unet(args.depth, convs_per_level=args.convs_per_level, base_size=args.base_size,
                         bandwidth=args.bandwidth)
    _write(args.output, graph.save)
    print(f"wrote {args.output}: {graph.meta.get('model')}, {graph.n} nodes, {len(graph.edges)} edges, "
          f"checkpoint-all peak {format_bytes(baseline_peak(graph))}, hash {graph.content_hash()}")
    return 0


# ---- trace ---------------------------------------------------------------------------
def cmd_trace(args: argparse.Namespace) -> int:
    from .model_commands import run_trace  # imports torch
    _write(args.output, lambda p: None)  # check the folder before spending time on tracing
    return run_trace(args)


def cmd_run(args: argparse.Namespace) -> int:
    if args.plan is None and args.budget is None:
        raise InvalidInputError("remat run: give --plan PLAN.json, or --budget to plan first")
    if args.plan is not None and args.budget is not None:
        raise InvalidInputError("remat run: give --plan or --budget, not both")
    if args.output:
        _write(args.output, lambda p: None)
    from .model_commands import run_run  # imports torch
    return run_run(args, solver_options(args), trace_options(args))


def cmd_partition(args: argparse.Namespace) -> int:
    from .budget import parse_memory
    if not args.pipeline and (args.microbatches is not None or args.schedule is not None or args.balance is not None):
        raise InvalidInputError("remat partition: --microbatches, --schedule and --balance are for --pipeline (layer "
                                "placement)")
    args.schedule, args.balance = args.schedule or "1f1b", args.balance or "time"
    args.budget_bytes = None if args.budget is None else parse_memory(args.budget)
    _write(args.output, lambda p: None)
    from .model_commands import run_partition  # imports torch
    return run_partition(args)


def cmd_capacity(args: argparse.Namespace) -> int:
    from .budget import parse_memory
    args.memory_bytes = parse_memory(args.memory)
    _write(args.output, lambda p: None)
    from .model_commands import run_capacity  # imports torch
    return run_capacity(args, solver_options(args), trace_options(args))


def _graph_or_model(text: str, progress: bool = True, options: dict | None = None):
    """A GRAPH.json, or a MODEL (zoo name, FILE.py:FACTORY, package.module:FACTORY) traced first
    with `options` (those of `remat trace`)."""
    from remat.core.graph import Graph
    if text.endswith(".json") or Path(text).is_file():
        return Graph.load(text)
    from .model_commands import trace_model  # imports torch
    log.info("tracing %s (%s)", text, options or "the default options of `remat trace`")
    return trace_model(text, progress=progress, **(options or {}))


def _write(path: str, writer) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InvalidInputError(f"-o: the folder {str(p.parent)!r} does not exist")
    try:
        writer(p)
    except OSError as e:
        raise RematError(f"cannot write {str(p)!r}: {e.strerror or e}") from e


# ---- argument parsing ------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _depth(text: str) -> "int | str":
    return "auto" if text == "auto" else _positive_int(text)


def _positive_float(text: str) -> float:
    v = _nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def _add_trace_options(p: argparse.ArgumentParser) -> None:
    """How a MODEL is traced (`remat trace`; `remat run` and `remat plan MODEL` trace first)."""
    g = p.add_argument_group("tracing a MODEL")
    g.add_argument("--granularity", choices=("auto", "module", "op", "joint", "op-stages"), default="auto",
                   help="auto (default): the joint graph where it captures and describes the step as well as "
                   "the module graph, else the module graph (the output says which and why); module: one node per "
                   "module call; op: per allocating ATen op of the joint forward+backward graph, falling back to "
                   "op-stages when it cannot be captured; joint: the same without fallback; op-stages: per ATen op "
                   "of the forward, backward nodes from autograd")
    g.add_argument("--depth", type=_depth, default="auto",
                   help="module depth of the nodes: a number (1: the top module's children, through containers) "
                   "or auto (default: the shallowest depth with repeated blocks, through wrappers)")
    g.add_argument("--profile", choices=("measure", "flops"), default="measure",
                   help="measured times (default) or deterministic FLOP-based times")
    g.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed runs per node (default 5 on CUDA, 3 on a CPU)")
    g.add_argument("--optimizer", default=None, help="count optimizer state as fixed bytes: sgd, sgd-momentum, "
                   "adam, adamw, rmsprop, adagrad")
    g.add_argument("--capture", choices=("auto", "export", "eager"), default="auto",
                   help="torch.export with an eager fallback (default), export only, or eager recording")
    g.add_argument("--grads", choices=("accumulated", "resident"), default="accumulated",
                   help="parameter gradients: allocated at their first accumulation, as with PyTorch's default "
                   "zero_grad() (default), or resident for the whole step, as with zero_grad(set_to_none=False)")


def trace_options(args: argparse.Namespace) -> dict:
    """`remat.trace`'s options from the arguments of `_add_trace_options`."""
    return {"granularity": args.granularity, "depth": args.depth, "profile": args.profile, "repeats": args.repeats,
            "optimizer": args.optimizer, "capture_with": args.capture, "grads": args.grads}


def _add_solver_options(p: argparse.ArgumentParser, time_limit: float) -> None:
    sw = p.add_mutually_exclusive_group()
    sw.add_argument("--no-swap", action="store_true", help="plan recomputation only (no host offload)")
    sw.add_argument("--swap", action="store_true", help="let plans swap to host memory even for a graph traced "
                    "on a CPU (whose host is the same RAM; without --swap such plans do not swap)")
    p.add_argument("--time-limit", type=_positive_float, default=time_limit, metavar="SECONDS",
                   help=f"solver time limit per solve (default {time_limit:g})")
    p.add_argument("--gap", type=_nonneg_float, default=0.0,
                   help="relative optimality gap at which the ILP may stop (default 0: prove optimality)")
    p.add_argument("--threads", type=_positive_int, default=None, help="solver threads (ILP; 2 or more: the scalable mode solves its instant IP in a second "
                        "process; default: the scalable mode takes 2 where two cores are free, else 1)")
    p.add_argument("--backend", choices=("cbc", "highs"), default=None, help="MILP backend of the ILP")
    p.add_argument("--mode", choices=("auto", "exact", "scalable"), default="auto",
                   help="ILP: the exact model on the whole graph, the scalable mode (coarsen, solve, expand, "
                   "refine; a bound for the whole graph), or auto (scalable above 100 nodes; default)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat", description="Memory planner for training: rematerialization and "
                     "swapping schedules that fit a memory budget.",
                     epilog="Exit codes: 0 ok, 1 runtime failure (e.g. infeasible budget), 2 bad input.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument("--version", action="version", version="%(prog)s " + _version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plan", help="plan a graph to fit a memory budget",
                       description="Solve for a schedule of GRAPH that fits --budget and write it as a plan.",
                       epilog=f"--budget is the peak device memory of the whole step: {FORMS}.")
    p.add_argument("graph", metavar="GRAPH.json", help="a remat.graph file (see `remat generate`), or a MODEL "
                   "to trace first as `remat trace MODEL` does")
    p.add_argument("--budget", required=True, help="memory budget, e.g. 6GiB, 512MB, 123456, 0.5x")
    p.add_argument("--solver", default="ilp", help="solver name (default ilp; see `remat solvers`)")
    _add_solver_options(p, 60.0)
    p.add_argument("--no-progress", action="store_true", help="no ILP progress line on stderr")
    p.add_argument("--executor", choices=("any", "native"), default="any",
                   help="native: a plan the model's own code runs (remat.apply(..., executor='native'); "
                   "module granularity: no recomputation in the forward, glue ops never recomputed)")
    p.add_argument("-o", "--output", required=True, metavar="PLAN.json", help="where to write the plan")
    _add_trace_options(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("trace", help="trace and profile a PyTorch model into a graph",
                       description="Trace one training step of MODEL (export, cut into module or op nodes, "
                       "profile time and memory per node) and write its graph.",
                       epilog="MODEL: a zoo model (resnet18, resnet50, vgg16, mobilenet_v2, unet, gpt2), "
                       "path/to/file.py:FACTORY or package.module:FACTORY; a factory returns a model or "
                       "(model, example_inputs).")
    p.add_argument("model", metavar="MODEL", help="zoo name, FILE.py:FACTORY or package.module:FACTORY")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's)")
    p.add_argument("--input-shape", default=None, metavar="SHAPE",
                   help="one example's shape without the batch, e.g. 3,224,224 (GPT-2: sequence length)")
    p.add_argument("--full", action="store_true", help="zoo models: the published size instead of the small one")
    p.add_argument("--device", default=None, help="cpu or cuda (default: where the model is)")
    _add_trace_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, metavar="GRAPH.json", help="where to write the graph")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("run", help="train a few steps with a plan; predicted vs measured peak and time",
                       description="Train MODEL for --steps steps on random batches with a plan (--plan, or "
                       "--budget to trace and plan first) and print, per step, the measured peak device "
                       "bytes and time next to the plan's prediction, each step followed by a plain autograd step (their "
                       "times' ratio against the predicted overhead). A partition "
                       "plan (remat partition) runs in one process a device: per step the loss beside one "
                       "process's, per rank the measured peak and the bytes sent beside the plan's.",
                       epilog="MODEL: a zoo model, path/to/file.py:FACTORY or package.module:FACTORY; with "
                       "--plan it defaults to the model the plan was traced from.")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="zoo name, FILE.py:FACTORY or package.module:FACTORY")
    p.add_argument("--plan", default=None, metavar="PLAN.json", help="the plan to run (remat plan's or remat partition's)")
    p.add_argument("--budget", default=None, help="plan first at this budget (e.g. 0.5x, 6GiB)")
    p.add_argument("--solver", default="ilp", help="solver when planning (default ilp)")
    _add_solver_options(p, 60.0)
    p.add_argument("--steps", type=_positive_int, default=3, help="training steps to measure (default 3)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: where the model is, the CPU)")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="SGD learning rate (default 1e-3)")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size of the model's example")
    p.add_argument("--input-shape", default=None, help="one example's shape without the batch, e.g. 3,224,224")
    p.add_argument("--full", action="store_true", help="zoo models at their published size")
    p.add_argument("--no-plain", action="store_true", help="skip the plain autograd step")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="with a partition plan (remat partition): processes to launch, one a device (default: the "
                   "plan's devices; gloo on the CPU, NCCL with --device cuda)")
    p.add_argument("--executor", choices=("interpreter", "native", "auto"), default="interpreter",
                   help="how the plan runs: interpreter (the captured ops replayed, the default), native (the "
                   "model's own code with hooks; with --budget it plans for it), auto (plain autograd when the plan "
                   "recomputes and swaps nothing and the plain step the trace measured fits the budget, else native "
                   "when the plan fits that way)")
    p.add_argument("--meter", choices=("auto", "allocator", "storage"), default="auto",
                   help="on a CPU, how peaks are measured: allocator (the allocator's own figure, kernels' scratch "
                   "included, as CUDA's max_memory_allocated), storage (tensor storages only, against the "
                   "prediction without scratch), auto (the allocator unless the plan swaps: the default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while tracing")
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="with --budget: write the plan")
    _add_trace_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("capacity", help="the largest batch (or sequence length) that fits a memory",
                       description="Trace MODEL at a few sizes, scale its graph to any size and find the largest "
                       "batch (--seq: sequence length) whose plan fits --memory, for no recomputation, <= 1.1x and "
                       "<= --max-overhead of the step time without recomputation; print a line per size probed, "
                       "the answers, plain autograd's and checkpoint-every-block's beside them, and write the plan "
                       "for the largest size.",
                       epilog="An answer is proven when the size above it is refuted (a bound, a proof of "
                       "infeasibility, or an optimal plan over the level); else it says 'at least'.")
    p.add_argument("model", metavar="MODEL", help="zoo name, FILE.py:FACTORY or package.module:FACTORY (a factory "
                   "with a batch parameter; with --seq, a seq_len parameter)")
    p.add_argument("--memory", required=True, help="device memory for the whole step, e.g. 24GiB, 512MB")
    p.add_argument("--max-overhead", type=_positive_float, default=1.3, metavar="X",
                   help="the largest step time over the time without recomputation to accept (default 1.3)")
    p.add_argument("--seq", action="store_true", help="vary the sequence length instead of the batch")
    p.add_argument("--sizes", default=None, metavar="S1,S2[,S3]", help="sizes to trace at (default: the model's "
                   "own and twice it; with --seq three lengths, for costs quadratic in the length)")
    p.add_argument("--max-size", type=_positive_int, default=None, help="stop the search at this size")
    p.add_argument("--verify", action="store_true", help="trace the answer at its size, plan it and run one step: "
                   "its measured peak must be within --memory (exit 1 if not)")
    p.add_argument("--no-peers", action="store_true", help="skip measuring plain autograd and checkpoint-every-block")
    p.add_argument("--solver", default="ilp", help="solver per probe (default ilp)")
    _add_solver_options(p, 20.0)
    p.add_argument("--batch", type=_positive_int, default=None, help="with --seq: the batch size (default: the model's)")
    p.add_argument("--input-shape", default=None, help="one example's shape without the batch, e.g. 3,224,224")
    p.add_argument("--full", action="store_true", help="zoo models at their published size")
    p.add_argument("--device", default=None, help="cpu or cuda (default: where the model is, the CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while tracing")
    p.add_argument("-o", "--output", default="capacity-plan.json", metavar="PLAN.json",
                   help="where to write the plan for the largest size (default capacity-plan.json)")
    _add_trace_options(p)
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser("partition", help="split MODEL's step across devices (Tofu) under a per-device budget",
                       description="Capture one step of MODEL as ATen ops, split every op across --devices devices "
                       "(Tofu's recursive 2-way search, least communication whose per-device peak fits --budget), "
                       "print the split per block, per-device memory and communication beside data parallel, "
                       "FSDP-style, Megatron-style and layer placement, and write the partition plan.",
                       epilog="Costs are bytes communicated per step and a FLOP model of time. Run the plan "
                       "with remat run --plan PARTITION.json (one process a device, torch.distributed).")
    p.add_argument("model", metavar="MODEL", help="zoo name, FILE.py:FACTORY or package.module:FACTORY")
    p.add_argument("--devices", type=_positive_int, required=True, help="number of devices (a power of 2)")
    p.add_argument("--budget", default=None, help="memory per device, e.g. 20GiB (default: none, least communication)")
    p.add_argument("--optimizer", choices=("none", "sgd", "adam"), default="none",
                   help="optimizer state per parameter counted per device: sgd (momentum) 1x, adam 2x (default none)")
    p.add_argument("--no-recompute", action="store_true",
                   help="do not let the single-device planner recompute when no split fits the budget as it is")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's)")
    p.add_argument("--input-shape", default=None, help="one example's shape without the batch, e.g. 3,224,224")
    p.add_argument("--full", action="store_true", help="zoo models at their published size")
    p.add_argument("--time-limit", type=_positive_float, default=30.0, metavar="SECONDS",
                   help="the single-device planner's time limit when it recomputes, and the integer program's "
                   "a level with --prove (default 30)")
    p.add_argument("--prove", action="store_true",
                   help="solve each level's cut again as an integer program (CBC) and say whether the search's "
                   "cut is optimal, or how far from it")
    p.add_argument("--pipeline", action="store_true",
                   help="layer placement instead of the split search: one run of modules a device, run over "
                   "micro-batches by torch.distributed.pipelining")
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help="with --pipeline: micro-batches a step (default: --devices); the batch must divide by it")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default=None,
                   help="with --pipeline: GPipe (every forward, then every backward) or 1F1B (at most k - s "
                   "micro-batches in flight on stage s; default)")
    p.add_argument("--balance", choices=("time", "memory"), default=None,
                   help="with --pipeline: make the slowest stage as fast as it can be (time, default; by memory "
                   "instead when its peak is over --budget) or the heaviest as light (memory)")
    p.add_argument("-o", "--output", default="partition.json", metavar="PARTITION.json",
                   help="where to write the plan (default partition.json)")
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("simulate", help="re-simulate a plan: peak, time, breakdown, fit",
                       description="Replay a plan's schedule in the simulator and report peak memory, time "
                       "and whether it fits its budget (exit 1 if it does not).")
    p.add_argument("plan", metavar="PLAN.json", help="a remat.plan file")
    p.add_argument("--bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                   help="host<->device bandwidth for swaps (default: the graph's)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("sweep", help="solve a graph at many budgets with several solvers, to CSV",
                       description="Solve GRAPH for each budget with each solver; write one CSV row per pair. "
                       "Budgets a solver cannot fit are recorded with status 'infeasible'.")
    p.add_argument("graph", metavar="GRAPH.json", help="a remat.graph file")
    p.add_argument("--budgets", required=True,
                   help="LO:HI:COUNT, linear (0.2x:1.0x:9, 1GiB:4GiB:4), or a comma list (0.3x,0.5x,1x)")
    p.add_argument("--solvers", default="ilp,checkpoint-all",
                   help="comma list of solver names (default ilp,checkpoint-all)")
    _add_solver_options(p, 30.0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, metavar="SWEEP.csv", help="where to write the CSV")
    p.add_argument("--plot", metavar="SWEEP.png", default=None,
                   help="also draw overhead against budget, one curve per solver (png, pdf, svg...)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("show", help="draw a plan: stage matrices and memory over time",
                       description="Draw a plan's stage matrices (stages x nodes: compute, resident, "
                       "swap-out, swap-in), its device memory over time stacked by category with the "
                       "budget, host memory and the compute/transfer streams, or both side by side.")
    p.add_argument("plan", metavar="PLAN.json", help="a remat.plan file")
    p.add_argument("-o", "--output", required=True, metavar="PLAN.png",
                   help="where to write the figure (the extension picks the format: png, pdf, svg...)")
    p.add_argument("--kind", choices=("matrices", "memory", "both"), default="both",
                   help="what to draw (default both)")
    p.add_argument("--x", choices=("time", "op"), default="time",
                   help="memory plot's x axis: simulated time or op index (default time)")
    p.add_argument("--dpi", type=_positive_int, default=150, help="resolution of raster formats (default 150)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("solvers", help="list the registered solvers", description="List solver names "
                       "and what each does.")
    p.set_defaults(func=cmd_solvers)

    p = sub.add_parser("generate", help="write a synthetic training graph",
                       description="Write a synthetic training graph (abstract units: bytes, time, and "
                       "bandwidth in bytes per unit time).")
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    k = kinds.add_parser("chain", help="n forward layers, a loss, n backward layers (2n+1 nodes)")
    k.add_argument("--layers", type=_positive_int, default=32, help="forward layers (default 32)")
    k.add_argument("--size", type=_positive_int, default=1, help="bytes of each layer's output (default 1)")
    k.add_argument("--fwd-time", type=_nonneg_float, default=1.0, help="forward time per layer (default 1)")
    k.add_argument("--bwd-time", type=_nonneg_float, default=2.0, help="backward time per layer (default 2)")
    k.add_argument("--fixed-bytes", type=int, default=0, help="parameters/gradients/inputs bytes (default 0)")
    kinds_random = kinds.add_parser("random", help="random layered DAG with skip edges")
    kinds_random.add_argument("--nodes", type=_positive_int, default=20, help="forward nodes (default 20)")
    kinds_random.add_argument("--width", type=_positive_int, default=3, help="nodes per layer, at most (default 3)")
    kinds_random.add_argument("--skip-prob", type=_nonneg_float, default=0.2, help="skip-edge probability")
    kinds_random.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    kinds_random.add_argument("--max-size", type=_positive_int, default=8, help="largest output bytes (default 8)")
    u = kinds.add_parser("unet", help="U-Net-like graph with long skip edges")
    u.add_argument("--depth", type=_positive_int, default=3, help="levels (default 3)")
    u.add_argument("--convs-per-level", type=_positive_int, default=1, help="convs per level (default 1)")
    u.add_argument("--base-size", type=_positive_int, default=1, help="bytes at the coarsest level (default 1)")
    for kp in (k, kinds_random, u):
        kp.add_argument("--bandwidth", type=float, default=1.0, help="bytes per unit time (default 1)")
        kp.add_argument("-o", "--output", required=True, metavar="GRAPH.json", help="where to write the graph")
    p.set_defaults(func=cmd_generate)
    return parser


def _version() -> str:
    from . import __version__
    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help / --version
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    debug = args.debug
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("remat: %(levelname)s: %(message)s"))
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING)
    log.propagate = False
    try:
        return int(args.func(args) or 0)
    except RematError as e:
        if debug:
            raise
        print(f"remat: error: {e}" + (f" {e.cli_hint}" if e.cli_hint else ""), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("remat: error: interrupted", file=sys.stderr)
        return 130
    except NotImplementedError as e:  # a named missing piece, not a bug
        if debug:
            raise
        print(f"remat: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: one line unless --debug
        if debug:
            raise
        print(f"remat: error: internal error ({type(e).__name__}: {e}); rerun with --debug for the traceback",
              file=sys.stderr)
        return 1
    finally:  # leave no logging state behind (main may be called many times in one process)
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
