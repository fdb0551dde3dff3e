"""The benchmarks' CSV output: one header, one row per dict, the file's folder made if missing."""
from __future__ import annotations

import csv
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
