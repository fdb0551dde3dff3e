"""The device check of issue 4: plans run on CUDA, measured against what they predict.

For each zoo model: trace on the device (CUDA-event timing, measured pinned-copy bandwidth),
plan with the ILP (swap on) at budgets 1.0x, 0.7x, 0.5x, 0.3x of the checkpoint-all peak
(a budget below the smallest feasible one is replaced by that one and marked), train a few
steps with `remat.apply` and compare ``torch.cuda.max_memory_allocated`` with the predicted
peak; step times against plain training and against checkpointing every block with
``torch.utils.checkpoint`` (non-reentrant), all measured side by side in this one run.
Writes ``gpu_check<tag>.csv`` and ``gpu_check<tag>.png`` to --out (default $OUT, else benchmarks/out).

    python benchmarks/gpu_check.py                          # CUDA, the default models
    python benchmarks/gpu_check.py --device cpu --quick     # the same logic on the CPU (small)

Meant to finish in under 8 minutes on one GPU: small zoo settings scaled up by --batch.
"""
from __future__ import annotations

import argparse
import copy
import csv
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

import remat
from remat.core.errors import InfeasibleBudgetError, RematError
from remat.frontends import default_loss, zoo
from remat.frontends.base import step_loss
from remat.frontends.checkpointing import Checkpointed
from remat.frontends.measuring import untracked_blocks
from remat.frontends.run import random_batch, run_plan

COLUMNS = ("model", "nodes", "budget", "budget_bytes", "note", "solver_status", "predicted_peak", "measured_peak",
           "peak_error", "within_budget", "host_predicted", "host_measured", "predicted_overhead", "step_s",
           "plain_s", "ckpt_blocks_s", "planned_over_plain", "ckpt_over_plain", "plain_peak", "ckpt_peak",
           "bandwidth_h2d", "bandwidth_d2h", "runtime_bytes", "untracked_at_run", "device")

# model -> zoo overrides for the check (batch scaled by --batch)
MODELS = {
    "resnet18": {"image_size": 64},
    "gpt2": {"n_layer": 4},
    "unet": {"image_size": 64},
}


def checkpoint_blocks(model: nn.Module, graph: remat.Graph) -> nn.Module:
    """A copy of `model` with every block the trace cut at (a stage module with children; else
    every stage module with parameters) wrapped in `Checkpointed`."""
    model = copy.deepcopy(model)
    names = [v.extra.get("module") for v in graph.nodes if v.kind == "forward" and v.extra.get("module")]
    mods = dict(model.named_modules())
    blocks = [n for n in names if n in mods and any(True for _ in mods[n].children())]
    if not blocks:
        blocks = [n for n in names if n in mods and any(True for _ in mods[n].parameters())]
    for name in blocks:
        parent_name, _, attr = name.rpartition(".")
        parent = mods[parent_name] if parent_name else model
        setattr(parent, attr, Checkpointed(getattr(parent, attr)))
    return model


def time_steps(model: nn.Module, example: tuple, device: torch.device, steps: int,
               set_to_none: bool = False, loss_fn=default_loss, meter: str = "storage") -> tuple[float, int]:
    """(median step seconds, peak bytes) of plain training steps of `model`, its gradients zeroed
    with ``zero_grad(set_to_none)``; the loss ``loss_fn(model(...), *batch)`` (`step_loss`);
    `meter`: `remat.measure`'s, on a CPU."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times, peak = [], 0
    for k in range(steps + 1):
        batch = random_batch(example, gen, device)
        opt.zero_grad(set_to_none=set_to_none)
        m = remat.measure(lambda: step_loss(model, loss_fn, batch).backward(), device,
                          resident=list(model.parameters()) + list(model.buffers()) + list(batch)
                          + [p.grad for p in model.parameters() if p.grad is not None], meter=meter)
        opt.step()
        if k:
            times.append(m.time)
            peak = max(peak, m.peak_bytes)
    return statistics.median(times), peak


class _Alone:
    """Runs a block with `model` moved to the CPU, so the device holds only what the block
    puts there (a copy being measured must not share the device with its original)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device

    def __enter__(self):
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        return self

    def __exit__(self, *exc):
        self.model.to(self.device)
        return False


def report_untracked(label: str, device: torch.device) -> int:
    """Print the allocator blocks no tensor holds (`untracked_blocks`), largest first (a
    library's workspace is one block of MiB); their bytes (0 off CUDA)."""
    blocks = untracked_blocks(device)
    if blocks:
        print(f"{label}: untracked blocks (bytes) {sorted(blocks.values(), reverse=True)[:12]}", flush=True)
    return sum(blocks.values())


TIMELINE_COLUMNS = ("model", "budget", "k", "op", "node", "node_name", "predicted_during", "predicted_after",
                    "measured_during", "measured_after")


def op_timeline(model: nn.Module, example: tuple, plan, device: torch.device) -> list[dict]:
    """Device bytes op by op in one step of `plan` (after a warm-up step): the simulator's
    against ``max_memory_allocated`` since the previous op and ``memory_allocated`` after it
    (synchronised at every op, so only the bytes are read, not the time)."""
    example = tuple(x.to(device) for x in example)
    planned = remat.apply(model, plan, example)
    planned(*example).backward()
    model.zero_grad(set_to_none=False)
    report_untracked("  after a warm-up step", device)   # what the step itself leaves or makes
    sim = remat.simulate(plan.graph, plan.schedule, timeline=True).timeline
    got: list[tuple] = []
    cuda = device.type == "cuda"

    def probe(op, k):
        if cuda:
            torch.cuda.synchronize(device)
            got.append((torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)))
            torch.cuda.reset_peak_memory_stats(device)
        else:
            got.append((0, 0))
    planned.on_op = probe
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    planned(*example).backward()
    planned.on_op = None
    names = [v.name for v in plan.graph.nodes]
    return [{"k": k, "op": op.op, "node": op.node, "node_name": names[op.node],
             "predicted_during": e["device_bytes"], "predicted_after": e["after_bytes"],
             "measured_during": m[0], "measured_after": m[1]}
            for k, (op, e, m) in enumerate(zip(plan.schedule.ops, sim, got))]


def check_model(name: str, args: argparse.Namespace, device: torch.device, writer: csv.DictWriter,
                timeline: "csv.DictWriter | None" = None) -> list[dict]:
    overrides = dict(MODELS[name])
    overrides["batch"] = args.batch
    if args.quick:
        overrides = {"batch": 2}
    model, example = zoo.get(name, **overrides)
    example = example if isinstance(example, tuple) else (example,)
    model.to(device)
    # the example stays on the host; each use takes its own device copy, so that no batch but
    # the one trained on is resident while a plan is measured
    example = tuple(x.cpu() for x in example)
    # gradients kept between steps, as `time_steps` and gpu.md measure them
    graph = remat.trace(model, tuple(x.to(device) for x in example), profile="measure", device=device, granularity="module", depth=1,
                        grads="resident")
    bw = {"h2d": graph.meta.get("bandwidth_h2d"), "d2h": graph.meta.get("bandwidth_d2h")}
    plain_s, plain_peak = time_steps(model, example, device, args.steps)
    ckpt = checkpoint_blocks(model, graph)
    with _Alone(model, device):
        ckpt_s, ckpt_peak = time_steps(ckpt, example, device, args.steps)
    del ckpt
    rows = []
    for b in args.budgets:
        note = ""
        try:
            try:
                plan = remat.plan(graph, f"{b}x", solver="ilp", time_limit=args.time_limit, threads=args.threads)
            except InfeasibleBudgetError as e:
                if e.min_feasible_bytes is None:
                    print(f"{name} {b}x: infeasible ({e})", file=sys.stderr)
                    continue
                plan = remat.plan(graph, e.min_feasible_bytes, solver="ilp", time_limit=args.time_limit,
                                  threads=args.threads)
                note = "tightest feasible"
            mine = copy.deepcopy(model)
            with _Alone(model, device):
                # device bytes no tensor holds as the run starts, against the trace's `runtime`
                untracked = report_untracked(f"{name} {b}x: at the run's start (the trace's runtime "
                                             f"{graph.meta['fixed_breakdown'].get('runtime')})", device)
                rep = run_plan(mine, example, plan, steps=args.steps, device=device, plain=False)
                if timeline is not None:
                    for r in op_timeline(mine, example, plan, device):
                        timeline.writerow({"model": name, "budget": f"{b}x", **r})
            del mine
        except Exception:  # noqa: BLE001 - a device check reports every failure and goes on
            print(f"{name} {b}x: failed", file=sys.stderr)
            traceback.print_exc()
            continue
        pr = plan.predicted
        row = {
            "model": name, "nodes": graph.n, "budget": f"{b}x", "budget_bytes": plan.budget_bytes, "note": note,
            "solver_status": plan.solver.get("status"), "predicted_peak": pr["peak_bytes"],
            "measured_peak": rep.peak_bytes, "peak_error": round(rep.peak_error, 4),
            "within_budget": rep.peak_bytes <= plan.budget_bytes, "host_predicted": pr["host_peak_bytes"],
            "host_measured": rep.host_peak_bytes, "predicted_overhead": round(pr["overhead"], 4),
            "step_s": round(rep.step_time, 6), "plain_s": round(plain_s, 6), "ckpt_blocks_s": round(ckpt_s, 6),
            "planned_over_plain": round(rep.step_time / plain_s, 4), "ckpt_over_plain": round(ckpt_s / plain_s, 4),
            "plain_peak": plain_peak, "ckpt_peak": ckpt_peak, "bandwidth_h2d": bw.get("h2d"),
            "bandwidth_d2h": bw.get("d2h"), "runtime_bytes": graph.meta["fixed_breakdown"].get("runtime"),
            "untracked_at_run": untracked, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu",
        }
        writer.writerow(row)
        rows.append(row)
        print(f"{name:9s} {b:>4}x {note:18s} predicted {pr['peak_bytes'] / 2**20:9.2f} MiB  measured "
              f"{rep.peak_bytes / 2**20:9.2f} MiB ({100 * rep.peak_error:+.1f}%)  step {rep.step_time * 1e3:8.2f} ms "
              f"= {rep.step_time / plain_s:.2f}x plain (predicted {pr['overhead']:.2f}x; ckpt-blocks "
              f"{ckpt_s / plain_s:.2f}x)", flush=True)
    return rows


def draw(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in sorted({r["model"] for r in rows}):
        rs = [r for r in rows if r["model"] == name]
        a.scatter([r["predicted_peak"] / 2**20 for r in rs], [r["measured_peak"] / 2**20 for r in rs], label=name)
        b.plot([r["budget_bytes"] / 2**20 for r in rs], [r["planned_over_plain"] for r in rs], "o-", label=name)
    hi = max(max(r["predicted_peak"], r["measured_peak"]) for r in rows) / 2**20
    a.plot([0, hi], [0, hi], "k--", lw=0.8)
    a.set_xlabel("predicted peak (MiB)")
    a.set_ylabel("measured peak, max_memory_allocated (MiB)")
    a.legend()
    b.set_xlabel("budget (MiB)")
    b.set_ylabel("step time / plain step time")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default="1.0,0.7,0.5,0.3")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="zoo defaults (tiny), for a dry run on the CPU")
    ap.add_argument("--tag", default="", help="suffix of the files written (gpu_check<tag>.csv, ...)")
    ap.add_argument("--timeline", action="store_true",
                    help="also write gpu_timeline.csv: predicted and measured device bytes op by op, every plan")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    args = ap.parse_args(argv)
    args.budgets = [float(x) for x in args.budgets.split(",")]
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu for a dry run", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[dict] = []
    tl_file = open(out / f"gpu_timeline{args.tag}.csv", "w", newline="") if args.timeline else None
    timeline = csv.DictWriter(tl_file, fieldnames=TIMELINE_COLUMNS) if tl_file else None
    if timeline:
        timeline.writeheader()
    with open(out / f"gpu_check{args.tag}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for name in args.models.split(","):
            try:
                rows += check_model(name, args, device, writer, timeline)
            except RematError as e:
                print(f"{name}: {e}", file=sys.stderr)
            except Exception:  # noqa: BLE001 - the other models still run
                print(f"{name}: failed", file=sys.stderr)
                traceback.print_exc()
            f.flush()
    if tl_file:
        tl_file.close()
    if rows:
        draw(rows, out / f"gpu_check{args.tag}.png")
    bad = [r for r in rows if abs(r["peak_error"]) > 0.10]
    print(f"{len(rows)} plans in {time.perf_counter() - t0:.0f} s; peak within 10 % of predicted: "
          f"{len(rows) - len(bad)}/{len(rows)}; wrote {out / f'gpu_check{args.tag}.csv'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
