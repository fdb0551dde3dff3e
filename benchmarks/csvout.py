"""What the benchmarks share: their CSV output (one header, one row per dict, the file's folder
made if missing), a steady allocator for timing on the CPU, and step times taken in turns."""
from __future__ import annotations

import csv
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence


def write_csv(path: "str | Path", columns: Sequence[str], rows: Iterable[dict], quiet: bool = False) -> Path:
    """Write `rows` under the header `columns` to `path`; print (unless `quiet`) and return where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)
    if not quiet:
        print(f"wrote {out}")
    return out


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def steady_malloc() -> None:
    """Re-run this process with glibc's allocator thresholds fixed: by default glibc serves large
    blocks by mmap and raises that threshold as blocks are freed, so a run's first steps pay page
    faults its later ones do not (plain autograd measured first ran 2.3x slower than the same
    steps at the end of one run).  A no-op when already set."""
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})


def turn_order(names: list, k: int) -> list:
    """The variants' order in round `k`: rotated by one place a round, so that no variant always
    follows the same one: torchvision's ResNet-50 at full size, its plain step always first in its
    round (right after the lowest-peak plan), measured 1.17x the native 1.0x step, which is plain
    autograd with idle hooks; with the order rotating, 1.01x (`executor_speed.py --cases
    tv-resnet50`, 2026-12-05)."""
    k %= max(1, len(names))
    return list(names[k:]) + list(names[:k])


def time_in_turns(steps: "dict[str, Callable[[], None]]", rounds: int, sync: Callable[[], None] = lambda: None,
                  progress: bool = False) -> "dict[str, float]":
    """Median seconds of each variant's step, the variants taking turns step by step: round 0 warms
    every variant up, rounds 1..`rounds` are timed.  On a shared machine whose speed drifts by tens
    of percent over minutes, a variant timed in a block of its own minutes apart from another is
    not comparable with it; taking turns puts the same drift into every variant's median, and the
    order rotates a place each round (`turn_order`).  `sync` runs before and after each step
    (``torch.cuda.synchronize`` on a GPU)."""
    times: dict = {name: [] for name in steps}
    for k in range(rounds + 1):
        for name in turn_order(list(steps), k):
            step = steps[name]
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if k:
                times[name].append(time.perf_counter() - t0)
        if progress:
            print(f"  round {k}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items() if t),
                  flush=True)
    return {name: statistics.median(t) for name, t in times.items()}
