"""Tracing and profiling cost: ResNet-50 (full size) at batch 8 on the CPU.

Reports the wall time of `remat.trace` (capture + profile + graph) and the share spent profiling
(warm-up and timed runs of every node), the graph's size, its predicted checkpoint-all peak and,
unless --no-peak, the peak of one real training step measured the same way as
benchmarks/trace_peaks.py (gradients kept).  Writes one CSV row.

    python benchmarks/trace_resnet50.py                 # batch 8, 224x224, 2 threads, remat's repeats
    python benchmarks/trace_resnet50.py --threads 2 --batch 8 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import remat
from csvout import write_csv
from remat.budget import format_bytes
from remat.frontends import default_loss, measure_peak, trace, zoo
from remat.solvers import get

COLUMNS = ("model", "batch", "image_size", "threads", "granularity", "profile", "repeats", "nodes", "wall_seconds",
           "capture_seconds", "profile_seconds", "profile_share", "forward_seconds", "backward_seconds",
           "predicted_peak", "real_peak_grads_kept", "error_kept", "load_average")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--granularity", choices=("module", "op"), default="module")
    ap.add_argument("--profile", choices=("measure", "flops"), default="measure")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per node (default: remat's, 3 on a CPU)")
    ap.add_argument("--no-peak", action="store_true", help="skip the real training step")
    ap.add_argument("--out", default="benchmarks/out/trace_resnet50.csv")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, inputs = zoo.get("resnet50", full=True, batch=args.batch, image_size=args.image_size)
    t0 = time.perf_counter()
    g = trace(model, inputs, name="resnet50", granularity=args.granularity, profile=args.profile,
              repeats=args.repeats, progress=sys.stderr.isatty())
    wall = time.perf_counter() - t0
    secs = g.meta["trace_seconds"]
    predicted = remat.simulate(g, get("checkpoint-all")(g)).peak_bytes
    fwd = sum(v.time for v in g.nodes if v.kind == "forward")
    bwd = sum(v.time for v in g.nodes if v.kind == "backward")
    row = {"model": "resnet50", "batch": args.batch, "image_size": args.image_size, "threads": args.threads,
           "granularity": args.granularity, "profile": args.profile,
           "repeats": g.meta["profile_options"].get("repeats"), "nodes": g.n, "wall_seconds": round(wall, 2),
           "capture_seconds": secs["capture"], "profile_seconds": secs["profile"],
           "profile_share": round(secs["profile"] / wall, 3), "forward_seconds": fwd, "backward_seconds": bwd,
           "predicted_peak": predicted, "real_peak_grads_kept": None, "error_kept": None,
           "load_average": round(os.getloadavg()[0], 2)}
    print(f"resnet50 batch {args.batch} {args.image_size}x{args.image_size}, {args.threads} threads: {g.n} nodes, "
          f"trace {wall:.1f} s (capture {secs['capture']:.1f} s, profiling {secs['profile']:.1f} s = "
          f"{100 * secs['profile'] / wall:.0f}%); profiled step: forward {fwd:.3f} s, backward {bwd:.3f} s; "
          f"load average {row['load_average']}")
    if not args.no_peak:
        def step():
            out = model(*inputs)
            default_loss(out, *inputs).backward()
        step()
        model.zero_grad(set_to_none=False)
        resident = list(model.parameters()) + list(model.buffers()) + list(inputs) + [p.grad for p in model.parameters()]
        real = measure_peak(step, resident=resident)
        row.update(real_peak_grads_kept=real, error_kept=predicted / real - 1)
        print(f"peak: predicted {format_bytes(predicted)}, real step {format_bytes(real)} ({predicted / real - 1:+.1%})")
    write_csv(args.out, COLUMNS, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
