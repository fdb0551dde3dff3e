"""What the benchmarks share: their CSV output (one header, one row per dict, the file's folder
made if missing), and a steady allocator for timing on the CPU."""
from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Iterable, Sequence


def write_csv(path: "str | Path", columns: Sequence[str], rows: Iterable[dict]) -> Path:
    """Write `rows` under the header `columns` to `path`; print and return where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)
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
