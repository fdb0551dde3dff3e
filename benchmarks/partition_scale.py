"""Partitioning at full size, in the cost model: the search against the baselines at 2, 4 and 8
devices, and how long the search takes.

For each case and device count, in one run: `remat.partition` (least communication, no budget;
with ``--prove`` each level's cut solved again as an integer program, `remat.partitioning.certify`)
and the baselines in the same cost model (data parallel, FSDP-style, Megatron-style, layer
placement with one micro-batch, stages balanced by memory) and layer placement pipelined over 8
micro-batches with 1F1B, stages balanced by time (``pipeline``, as ``remat partition --pipeline``
plans it) or by memory (``pipeline-memory``).  Per variant the bytes communicated per
device per step (as DTensor runs the plan over NCCL, `tofu.mesh_comm`, divided by the devices;
layer placement: activations sent to the next stages and their gradients back, a tied parameter's
gradient all-reduced) and the predicted peak per device (the simulator's keep-everything peak of
the device graph; layer placement: its heaviest stage's, with the micro-batches in flight).
Nothing runs on a device.

    python benchmarks/partition_scale.py                          # gpt2-12l and wide-resnet50, 2/4/8, --prove
    python benchmarks/partition_scale.py --cases gpt2-12l --devices 2,4

Cases: the zoo GPT (12 layers, width 768, 12 heads, vocabulary 50,304, sequence 256, batch 8,
dropout 0, tied embedding: GPT-2 small's shape) and torchvision's wide_resnet50_2 (batch 32,
224 px, cross entropy; batch norm in training).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import write_csv  # noqa: E402

VARIANTS = ("search", "data-parallel", "fsdp", "megatron", "layers", "pipeline", "pipeline-memory")
MICROBATCHES = 8
COLUMNS = ("case", "ops", "devices", "variant", "comm_bytes_per_device", "peak_bytes_per_device", "compute_time",
           "seconds", "exact", "proof", "note")


def graph(name: str):
    """The case's `OpGraph`."""
    from remat.frontends.partitioning import op_graph
    torch.manual_seed(0)
    if name == "gpt2-12l":
        from remat.frontends.zoo import GPT
        model = GPT(vocab_size=50304, block_size=256, n_layer=12, n_head=12, n_embd=768, dropout=0.0)
        ids = torch.randint(0, 50304, (8, 256))
        return op_graph(model, (ids, torch.roll(ids, -1, 1)), None, name=name)
    if name == "wide-resnet50":
        from remat.frontends.vision import torchvision
        model = torchvision().models.wide_resnet50_2()
        x, y = torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))
        return op_graph(model, (x, y), lambda out, x, y: torch.nn.functional.cross_entropy(out, y), 1, name=name)
    raise SystemExit(f"unknown case {name!r}: gpt2-12l, wide-resnet50")


def proof(search: dict) -> str:
    """The certificates of `certify` in a few words."""
    certs = search.get("certificates")
    if not certs:
        return ""
    if all(c["gap"] == 0.0 for c in certs):
        return f"every level optimal ({sum(c['seconds'] for c in certs):.1f} s of CBC)"
    return "; ".join(f"level {c['level']}: gap {c['gap']}" for c in certs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gpt2-12l,wide-resnet50")
    ap.add_argument("--devices", default="2,4,8")
    ap.add_argument("--no-prove", action="store_true", help="do not solve the cuts again as integer programs")
    ap.add_argument("--device-type", default="cuda", choices=("cuda", "cpu"),
                    help="cost the conversions as NCCL (cuda) or gloo (cpu) runs them (default cuda)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/out/partition-scale.csv")
    args = ap.parse_args(argv)
    from remat.partitioning import baseline, layer_placement, partition
    rows = []
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        g = graph(name)
        print(f"{name}: {len(g.ops)} ops, captured in {time.perf_counter() - t0:.1f} s", flush=True)
        for k in (int(d) for d in args.devices.split(",")):
            for which in args.variants.split(","):
                t0 = time.perf_counter()
                try:
                    if which == "search":
                        p = partition(g, k, baselines_too=False, prove=not args.no_prove, device_type=args.device_type)
                    elif which.startswith("pipeline"):
                        balance = "memory" if which.endswith("memory") else "time"
                        p = layer_placement(g, k, 0.0, MICROBATCHES, "1f1b", balance)
                    else:
                        p = baseline(g, k, which, device_type=args.device_type)
                except Exception as e:  # noqa: BLE001 - a baseline that cannot split this model is a row saying why
                    rows.append({"case": name, "ops": len(g.ops), "devices": k, "variant": which,
                                 "note": f"{type(e).__name__}: {str(e)[:100]}"})
                    print(f"  x{k} {which:<14} {rows[-1]['note']}", flush=True)
                    continue
                seconds = time.perf_counter() - t0
                r = {"case": name, "ops": len(g.ops), "devices": k, "variant": which,
                     "comm_bytes_per_device": p.comm_bytes // k, "peak_bytes_per_device": p.peak_bytes,
                     "compute_time": round(p.compute_time, 4),
                     "seconds": round(seconds, 2), "exact": p.search.get("exact", ""), "proof": proof(p.search)}
                rows.append(r)
                print(f"  x{k} {which:<14} comm {r['comm_bytes_per_device'] / 2**20:10.1f} MiB/device  peak "
                      f"{r['peak_bytes_per_device'] / 2**20:9.1f} MiB/device  step {p.compute_time * 1e3:8.1f} ms "
                      f"(FLOP model)  {seconds:6.1f} s  {r['proof']}", flush=True)
        write_csv(args.out, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
