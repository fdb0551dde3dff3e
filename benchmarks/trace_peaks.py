"""Predicted vs measured peak of one training step, for every zoo model.

For each model: trace it (`remat.trace`), simulate the checkpoint-all schedule (no
rematerialization), and run one plain training step (forward, the default loss, backward) on
the CPU while `remat.frontends.measure_peak` counts live tensor storages.  Two real steps:

* gradients kept from the previous step (``zero_grad(set_to_none=False)``): gradients are
  resident for the whole step, as the graph's fixed bytes say; the prediction should match;
* gradients freed (``set_to_none=True``, PyTorch's default): the real step allocates them
  during the backward only, so the prediction is an upper bound, loose by up to the gradients
  that do not exist yet when the real peak happens.

    python benchmarks/trace_peaks.py                       # small sizes (seconds)
    python benchmarks/trace_peaks.py --medium              # batch 8, 64x64 images, GPT-2 4x128, seq 128
    python benchmarks/trace_peaks.py --granularity op --out benchmarks/out/trace_peaks_op.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

import remat
from remat.budget import format_bytes
from remat.frontends import trace, zoo
from remat.frontends import plain_step_peaks
from remat.solvers import get

MEDIUM = {
    "resnet18": dict(batch=8, image_size=64, width=64),
    "resnet50": dict(batch=8, image_size=64, width=64),
    "vgg16": dict(batch=8, image_size=64, width_div=2, hidden=512),
    "mobilenet_v2": dict(batch=8, image_size=64, width_mult=1.0),
    "unet": dict(batch=4, image_size=64, base=16, depth=3),
    "gpt2": dict(batch=4, seq_len=128, n_layer=4, n_embd=128, n_head=4, vocab_size=2048),
}
COLUMNS = ("model", "granularity", "nodes", "fixed_bytes", "predicted_peak", "real_peak_grads_kept",
           "error_kept", "real_peak_set_to_none", "error_set_to_none", "trace_seconds")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(zoo.names()), help="comma list of zoo models")
    ap.add_argument("--medium", action="store_true", help="medium sizes instead of the zoo's small defaults")
    ap.add_argument("--granularity", choices=("module", "op"), default="module")
    ap.add_argument("--profile", choices=("measure", "flops"), default="flops",
                    help="times do not matter here; flops is faster (bytes are measured either way)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--out", default="benchmarks/out/trace_peaks.csv")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model, inputs = zoo.get(name, **(MEDIUM[name] if args.medium else {}))
        g = trace(model, inputs, name=name, granularity=args.granularity, profile=args.profile)
        predicted = remat.simulate(g, get("checkpoint-all")(g)).peak_bytes
        kept, freed = plain_step_peaks(model, inputs)
        row = {"model": name, "granularity": args.granularity, "nodes": g.n, "fixed_bytes": g.fixed_bytes,
               "predicted_peak": predicted, "real_peak_grads_kept": kept, "error_kept": predicted / kept - 1,
               "real_peak_set_to_none": freed, "error_set_to_none": predicted / freed - 1,
               "trace_seconds": g.meta["trace_seconds"]["total"]}
        rows.append(row)
        print(f"{name:13s} {g.n:4d} nodes  fixed {format_bytes(g.fixed_bytes):>11s}  predicted "
              f"{format_bytes(predicted):>11s}  real (grads kept) {format_bytes(kept):>11s} {row['error_kept']:+6.1%}"
              f"  real (set_to_none) {format_bytes(freed):>11s} {row['error_set_to_none']:+6.1%}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    worst = max(abs(r["error_kept"]) for r in rows)
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
