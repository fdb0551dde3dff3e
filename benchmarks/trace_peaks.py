"""Predicted vs measured peak of one training step, for every zoo model.

For each model: trace it twice (`remat.trace`, one graph per way a loop treats its gradients),
simulate the checkpoint-all schedule (no rematerialization), and run one plain training step
(forward, the default loss, backward) on the CPU while `remat.frontends.measure_peak` counts
live tensor storages:

* ``grads="accumulated"`` (the default) against a step after PyTorch's default
  ``zero_grad()`` (``set_to_none=True``): each gradient is allocated at its first accumulation;
* ``grads="resident"`` against a step that keeps its gradients from the previous one
  (``zero_grad(set_to_none=False)``): gradients are fixed bytes for the whole step.

    python benchmarks/trace_peaks.py                       # small sizes (seconds)
    python benchmarks/trace_peaks.py --medium              # batch 8, 64x64 images, GPT-2 4x128, seq 128
    python benchmarks/trace_peaks.py --granularity op --out benchmarks/out/trace_peaks_op.csv
"""
from __future__ import annotations

import argparse
import sys

import torch

import remat
from csvout import write_csv
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
COLUMNS = ("model", "granularity", "nodes", "predicted_accumulated", "real_set_to_none", "error_accumulated",
           "predicted_resident", "real_grads_kept", "error_resident", "trace_seconds")


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
        graphs = {grads: trace(model, inputs, name=name, granularity=args.granularity, profile=args.profile,
                               grads=grads) for grads in ("accumulated", "resident")}
        predicted = {k: remat.simulate(g, get("checkpoint-all")(g)).peak_bytes for k, g in graphs.items()}
        kept, freed = plain_step_peaks(model, inputs)
        g = graphs["accumulated"]
        row = {"model": name, "granularity": g.meta["granularity"], "nodes": g.n,
               "predicted_accumulated": predicted["accumulated"], "real_set_to_none": freed,
               "error_accumulated": predicted["accumulated"] / freed - 1,
               "predicted_resident": predicted["resident"], "real_grads_kept": kept,
               "error_resident": predicted["resident"] / kept - 1,
               "trace_seconds": g.meta["trace_seconds"]["total"]}
        rows.append(row)
        print(f"{name:13s} {g.n:4d} nodes  accumulated: predicted {format_bytes(predicted['accumulated']):>11s} "
              f"real {format_bytes(freed):>11s} {row['error_accumulated']:+6.1%}   resident: predicted "
              f"{format_bytes(predicted['resident']):>11s} real {format_bytes(kept):>11s} {row['error_resident']:+6.1%}",
              flush=True)
    write_csv(args.out, COLUMNS, rows)
    worst = max(max(abs(r["error_accumulated"]), abs(r["error_resident"])) for r in rows)
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
