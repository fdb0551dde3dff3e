"""Byte counts for people: what every layer prints (``"1.50 GiB"``).  Nothing here imports torch."""
from __future__ import annotations


def format_bytes(n: int | float | None) -> str:
    """Human-readable bytes: ``"10 B"`` below 1 KiB (tiny synthetic graphs), else KiB/MiB/GiB/TiB
    with two decimals (``"1.50 GiB"``)."""
    if n is None:
        return "-"
    n = int(n)
    if abs(n) < 1024:
        return f"{n} B"
    for unit, size in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"  # pragma: no cover


def format_bytes_exact(n: int) -> str:
    """`format_bytes` plus the exact count when the short form rounds (``"1.50 GiB (1610612736 B)"``)."""
    short = format_bytes(n)
    return short if abs(int(n)) < 1024 else f"{short} ({int(n)} B)"


__all__ = ["format_bytes", "format_bytes_exact"]
