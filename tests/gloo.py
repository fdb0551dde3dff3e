"""Running a test's worker in gloo processes on this machine: `spawn_rows`."""
from __future__ import annotations

import socket
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_rows(worker: Callable, world: int, *args: Any) -> list[dict]:
    """``worker(rank, world, port, *args, out)`` in `world` spawned processes; the row each put
    on `out`, by rank.  gloo can abort a process ("terminate called without an active
    exception") as the group is torn down, after its row was sent: that is not the test's
    failure, a missing row is."""
    out = mp.get_context("spawn").Queue()
    try:
        mp.spawn(worker, args=(world, free_port(), *args, out), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        if "SIGABRT" not in str(e):
            raise
    return sorted((out.get(timeout=60) for _ in range(world)), key=lambda r: r["rank"])


def run_partition_plan(main: Callable, plan: Any, capsys: Any, steps: int = 2) -> tuple[list, list, str]:
    """``remat run --plan PARTITION.json --steps N`` through the CLI's `main`, checked: a line a
    step, each step's loss one process's, the bytes sent the plan's.  Returns (the steps' (step,
    loss, one process's loss, sent against predicted in %), each rank's peak against predicted
    in %, step by step, the output)."""
    import re

    import pytest
    assert main(["run", "--plan", str(plan), "--steps", str(steps)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"step (\d+)\s+loss (\S+) \(one process: (\S+)\)  sent .* \(([+-]\d+\.\d)% of predicted\)", out)
    assert [r[0] for r in rows] == [str(k) for k in range(steps)], out
    for _, loss, ref, sent in rows:
        assert float(loss) == pytest.approx(float(ref), rel=1e-5)
        assert sent in ("+0.0", "-0.0")
    peaks = [float(p) for p in re.findall(r"rank \d+\s+peak .* \(([+-]\d+\.\d)% of predicted\)", out)]
    return rows, peaks, out
