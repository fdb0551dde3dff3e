"""Layer placement pipelined on torch.distributed.pipelining (gloo, CPU processes), predicted
against measured.

For each case, process count, schedule and balance, in one run: ``remat.partitioning.
layer_placement`` (stages begin at modules, the slowest (``time``) or heaviest (``memory``) stage
as light as it can be; micro-batches twice the stages) run by `remat.pipelining.PipelinedStep`
in that many processes, one step after a first (which makes the pipeline's receive buffers);
per run the bytes sent (summed over ranks) against
the plan's `comm_bytes`, each rank's peak (the storage accounting, the receive buffers counted as
resident) against its stage's predicted peak, the loss and the largest gradient difference from
one process's step on the whole batch (relative to the largest gradient).

    python benchmarks/pipeline.py                        # mlp, cnn, cnn-bn, gpt; 2 and 4; 1f1b and gpipe
    python benchmarks/pipeline.py --cases gpt --devices 2 --schedules 1f1b

Cases: the MLP, CNN and CNN with batch norm of `benchmarks/partition.py` (batch 8) and the zoo GPT
(4 layers, width 64, 4 heads, vocabulary 256, sequence 64, batch 8, dropout 0, tied embedding,
the output's sum as loss).  A case a plan or pipelining cannot run is a row saying why.
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

COLUMNS = ("case", "devices", "schedule", "balance", "microbatches", "split_points", "predicted_comm", "measured_comm",
           "peak_error_min", "peak_error_max", "loss_error", "grad_err", "note")


def case(name: str):
    """(model, batch, loss_fn, model_inputs), the same in every process."""
    if name in ("mlp", "cnn", "cnn-bn"):
        from partition import case as partition_case
        return partition_case(name)
    from remat.frontends.zoo import GPT
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
    return model, (torch.randint(0, 256, (8, 64), generator=gen),), None, None


def worker(rank: int, world: int, port: int, name: str, schedule: str, balance: str, microbatches: int,
           out) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        from remat.frontends.base import default_loss, step_loss
        from remat.frontends.partitioning import op_graph
        from remat.partitioning import layer_placement
        from remat.pipelining import PipelinedStep
        model, batch, loss_fn, count = case(name)
        plan = layer_placement(op_graph(model, batch, loss_fn, count), world, 0.0, microbatches, schedule, balance)
        step = PipelinedStep(model, batch, plan, rank, world, torch.device("cpu"), loss_fn, count)
        step.step(batch)
        got = step.measured(batch)
        ref_model, ref_batch, _, _ = case(name)
        ref = step_loss(ref_model, loss_fn or default_loss, ref_batch, None, count)
        ref.backward()
        grads = dict(ref_model.named_parameters(remove_duplicate=False))
        out.put({"rank": rank, "loss": got["loss"], "ref": float(ref.detach()), "sent": got["comm_bytes"],
                 "peak": got["peak_bytes"], "predicted": got["predicted_peak"], "plan_comm": plan.comm_bytes,
                 "splits": " ".join(plan.search["pipeline"]["split_points"]),
                 "grad_err": max(float((g - grads[n].grad).abs().max()) for n, g in got["grads"].items())
                 / max(float(p.grad.abs().max()) for p in ref_model.parameters())})
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - the row says why
        out.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        raise
    finally:
        dist.destroy_process_group()


def run(name: str, world: int, schedule: str, balance: str, microbatches: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").Queue()
    try:
        mp.spawn(worker, args=(world, port, name, schedule, balance, microbatches, q), nprocs=world, join=True)
    except Exception:  # noqa: BLE001 - the ranks' own messages follow
        pass
    rows = []
    while not q.empty():
        rows.append(q.get())
    errors = [r["error"] for r in rows if "error" in r]
    if errors or len(rows) < world:
        return {"note": errors[0] if errors else "a process exited"}
    rows.sort(key=lambda r: r["rank"])
    last = rows[-1]
    errs = [r["peak"] / r["predicted"] - 1 for r in rows]
    return {"split_points": last["splits"], "predicted_comm": last["plan_comm"],
            "measured_comm": sum(r["sent"] for r in rows), "peak_error_min": round(min(errs), 4),
            "peak_error_max": round(max(errs), 4), "loss_error": abs(last["loss"] - last["ref"]) / abs(last["ref"]),
            "grad_err": max(r["grad_err"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp,cnn,cnn-bn,gpt")
    ap.add_argument("--devices", default="2,4")
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--balances", default="time,memory")
    ap.add_argument("--out", default="benchmarks/out/pipeline.csv")
    args = ap.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        for world in (int(d) for d in args.devices.split(",")):
            for schedule, balance in ((s, b) for s in args.schedules.split(",") for b in args.balances.split(",")):
                m = 2 * world
                r = {"case": name, "devices": world, "schedule": schedule, "balance": balance, "microbatches": m,
                     **run(name, world, schedule, balance, m)}
                rows.append(r)
                if "note" in r:
                    print(f"{name} x{world} {schedule} by {balance} m={m}: {r['note']}", flush=True)
                else:
                    print(f"{name} x{world} {schedule} by {balance} m={m} (stages from {r['split_points']}): sent "
                          f"{r['measured_comm']} B / {r['predicted_comm']} B predicted; peaks "
                          f"{100 * r['peak_error_min']:+.1f} .. {100 * r['peak_error_max']:+.1f} % of predicted; loss "
                          f"{r['loss_error']:.1e}, gradients {r['grad_err']:.1e} (relative) from one process's", flush=True)
        write_csv(args.out, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
