"""Partition plans measured on torch.distributed (gloo, CPU processes): the search against the
baselines, predicted against measured.

For each case and device count, in one run: `remat.partition`'s plan (least communication, no
budget) and the baselines (data parallel, FSDP-style, Megatron-style), each run for one step by
`remat.distributed.train_step` in that many processes; per variant the bytes sent at the
collectives (summed over ranks) against the plan's `comm_bytes`, each rank's peak (the storage
accounting) against the plan's per-device `peak_bytes`, and the largest gradient difference
from one process's step.  Layer placement is costed only (`remat partition` prints it).

    python benchmarks/partition.py                     # mlp, cnn, cnn-bn, gpt at 2 and 4 processes
    python benchmarks/partition.py --cases gpt --devices 2
    python benchmarks/partition.py --cases gpt-wide,gpt-wide-dropout --variants search,search@0.8,search@0.6

Variant ``search@F``: the search under a per-device budget of F times the least keep-everything
peak of its splits (at weights 0, 0.01, 1, 10^4): below it the devices recompute (the
single-device planner's compiled-class program of the device graph).

Cases: an MLP (Linear(64, 256)-GELU-Linear(256, 64), batch 8), a CNN (two conv-ReLU-pool
blocks and a linear head, batch 8 of 3x16x16, cross entropy), ``cnn-bn`` (the same with batch norm
after each convolution, in training: a batch split synchronises its statistics), the zoo GPT (2 layers, width 32,
4 heads, vocabulary 64, sequence 16, batch 4, dropout 0, tied embedding); ``gpt-wide`` and
``gpt-wide-dropout`` (dropout 0.1): the same at batch 128, where activations outweigh the weights.
Output: CSV (``--out``) and a line per variant.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import write_csv  # noqa: E402

F = torch.nn.functional
VARIANTS = ("search", "data-parallel", "fsdp", "megatron")
COLUMNS = ("case", "devices", "variant", "budget", "recomputed_ops", "predicted_overhead", "predicted_comm",
           "measured_comm", "predicted_peak", "measured_peak_max", "measured_peak_min", "grad_err", "note")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class CNNBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        return self.head(F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2).flatten(1))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, padding=1)
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.head(F.max_pool2d(F.relu(self.conv2(x)), 2).flatten(1))


def case(name: str):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        return MLP(), (torch.randn(8, 64, generator=gen),), lambda out, *_: out.square().mean(), None
    if name in ("cnn", "cnn-bn"):
        return (CNN() if name == "cnn" else CNNBN()), \
            (torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)), \
            lambda out, x, y: F.cross_entropy(out, y), 1
    from remat.frontends.zoo import GPT
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1 if "dropout" in name else 0.0)
    ids = torch.randint(0, 64, (128 if "wide" in name else 4, 16), generator=gen)
    return model, (ids, torch.roll(ids, -1, 1)), None, None


def worker(rank: int, world: int, port: int, name: str, which: str, out) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        from remat.distributed import mesh_for, train_step
        from remat.frontends.base import step_loss
        from remat.frontends.partitioning import capture_step
        from remat.partitioning import baseline, partition
        model, batch, loss_fn, count = case(name)
        cap = capture_step(model, batch, loss_fn, count)
        if which.startswith("search@"):
            from remat.core.simulate import keep_all_peak
            from remat.solvers import tofu
            g = cap.graph
            least = min(keep_all_peak(tofu.device_graph(g, tofu.split(g, world, lam))) for lam in (0.0, 1e-2, 1, 1e4))
            plan = partition(g, world, int(float(which[7:]) * least), baselines_too=False)
        else:
            plan = (partition(cap.graph, world, baselines_too=False) if which == "search"
                    else baseline(cap.graph, world, which))
        state = torch.get_rng_state()        # (the same on every rank: seeded alike)
        got = train_step(model, batch, plan, mesh_for(world), loss_fn, capture=cap, meter=True)
        rec = plan.search.get("recompute") or {}
        row = {"rank": rank, "comm": got["comm_bytes"], "peak": got["peak_bytes"], "plan_comm": plan.comm_bytes,
               "plan_peak": plan.peak_bytes, "budget": plan.budget_bytes, "recomputed_ops": len(rec.get("ops", [])),
               "predicted_overhead": rec.get("overhead")}
        if rank == 0:
            torch.set_rng_state(state)          # one process's step draws what the ranks drew
            step_loss(model, loss_fn or (lambda o, *a: o), batch, None, count).backward()
            row["grad_err"] = max(float((got["grads"][n] - p.grad).abs().max()) for n, p in model.named_parameters())
        out.put(row)
        dist.barrier()  # every rank tears gloo down together: one that leaves early can abort at exit
    finally:
        dist.destroy_process_group()


def run(name: str, which: str, world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(world, port, name, which, q), nprocs=world, join=True)
    rows = sorted((q.get() for _ in range(world)), key=lambda r: r["rank"])
    return {"budget": rows[0]["budget"], "recomputed_ops": rows[0]["recomputed_ops"],
            "predicted_overhead": rows[0]["predicted_overhead"],
            "predicted_comm": rows[0]["plan_comm"], "measured_comm": sum(r["comm"] for r in rows),
            "predicted_peak": rows[0]["plan_peak"], "measured_peak_max": max(r["peak"] for r in rows),
            "measured_peak_min": min(r["peak"] for r in rows), "grad_err": rows[0]["grad_err"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp,cnn,cnn-bn,gpt")
    ap.add_argument("--devices", default="2,4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/out/partition.csv")
    args = ap.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        for world in (int(d) for d in args.devices.split(",")):
            for which in args.variants.split(","):
                try:
                    r = {"case": name, "devices": world, "variant": which, **run(name, which, world)}
                except Exception as e:  # noqa: BLE001 - a variant that cannot run here is a row saying why
                    why = str(e).strip().splitlines()[-1] if isinstance(e, mp.ProcessRaisedException) else \
                        f"{type(e).__name__}: {e}"   # (a process's error: its last line)
                    r = {"case": name, "devices": world, "variant": which, "note": why[:200]}
                    print(f"{name} x{world} {which}: {r['note']}", flush=True)
                    rows.append(r)
                    continue
                rows.append(r)
                rec = f" ({r['recomputed_ops']} ops recomputed, {r['predicted_overhead']:.3f}x predicted; budget " \
                      f"{r['budget']} B)" if r["recomputed_ops"] else ""
                print(f"{name} x{world} {which}{rec}: comm {r['measured_comm']} B measured / {r['predicted_comm']} B "
                      f"predicted; peak per rank {r['measured_peak_min']}-{r['measured_peak_max']} B / "
                      f"{r['predicted_peak']} B predicted; gradients within {r['grad_err']:.1e}", flush=True)
        write_csv(args.out, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
