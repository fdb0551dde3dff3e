"""Memory budgets: parsing ``--budget`` and printing byte counts.

A budget is the peak device memory of the whole training step: parameters, gradients, inputs,
activations, and optimizer state when the graph declares it (docs/design.md, "One budget").  It is
written as

* a bare integer: bytes (``"123456"``, or an ``int``);
* a number with a unit: ``B``; ``KB``/``MB``/``GB``/``TB`` (powers of 1000);
  ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024); decimals are allowed (``"1.5GiB"``) and the
  result is rounded down to whole bytes; units are case-insensitive;
* a ratio with ``x``: relative to the plan with no rematerialization, i.e. the simulated peak of
  the checkpoint-all schedule of the graph, fixed bytes included (``"0.5x"``).

Ranges and lists for sweeps (``budget_list``): ``LO:HI:COUNT`` (COUNT values spaced linearly
from LO to HI; both ends relative or both absolute) or a comma list of single budgets.
"""
from __future__ import annotations

import math
import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from typing import TYPE_CHECKING

from remat.core.errors import InvalidInputError
from remat.core.units import format_bytes, format_bytes_exact  # noqa: F401  (re-exported: remat.format_bytes)

if TYPE_CHECKING:  # pragma: no cover
    from remat.core.graph import Graph

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
    "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4,
}
FORMS = ("bytes as an integer (123456), a size with a unit (512MB, 1.5GiB; units B, KB, MB, GB, "
         "TB = powers of 1000, KiB, MiB, GiB, TiB = powers of 1024), or a ratio of the "
         "checkpoint-all peak (0.5x)")

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SIZE_RE = re.compile(rf"^{_NUMBER}\s*([a-z]*)$", re.IGNORECASE)


def baseline_peak(graph: "Graph") -> int:
    """Simulated peak bytes (fixed included) of the checkpoint-all schedule: what ``1x`` means."""
    from remat.core.simulate import keep_all_peak
    return keep_all_peak(graph)


def _floor(x: Decimal) -> int:
    return int(x.to_integral_value(rounding=ROUND_FLOOR))


def _split(text: str) -> tuple[Decimal, str]:
    """('0.5', 'x') style split of one budget; raises InvalidInputError on anything else."""
    m = _SIZE_RE.match(text.strip())
    if not m:
        raise InvalidInputError(f"--budget: cannot read {text!r}; expected {FORMS}")
    try:
        value = Decimal(m.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
        raise InvalidInputError(f"--budget: cannot read {text!r}; expected {FORMS}") from None
    unit = m.group(2).lower()
    if unit != "x" and unit not in UNITS and unit != "":
        raise InvalidInputError(f"--budget: unknown unit {m.group(2)!r} in {text!r}; expected {FORMS}")
    return value, unit


def parse_budget(value: "str | int", graph: "Graph | None" = None, base: int | None = None) -> int:
    """Budget in bytes from an int or a string in one of the forms of the module docstring.

    A relative budget (``"0.5x"``) needs the graph: it is ``floor(ratio * baseline_peak(graph))``,
    or ``floor(ratio * base)`` when `base` is given (an executor's own keep-everything peak).
    Raises `InvalidInputError` naming ``--budget`` for anything else, for a budget below one byte,
    and for a relative budget without a graph.
    """
    if isinstance(value, bool):
        raise InvalidInputError(f"--budget: expected {FORMS}, got {value!r}")
    if isinstance(value, int):
        n = value
        text = str(value)
    elif isinstance(value, float) and math.isfinite(value) and value == int(value):
        n = int(value)
        text = str(value)
    elif isinstance(value, str):
        text = value
        number, unit = _split(value)
        if unit == "x":
            if graph is None and base is None:
                raise InvalidInputError(f"--budget: the relative budget {value!r} needs a graph "
                                        "(it is a ratio of the graph's checkpoint-all peak)")
            n = _floor(number * (baseline_peak(graph) if base is None else base))
        elif unit in ("", "b") and number != number.to_integral_value():
            raise InvalidInputError(f"--budget: {value!r} is not a whole number of bytes; "
                                    "write 1.5KiB or 1.5x, not 1.5")
        else:
            n = _floor(number * UNITS[unit or "b"])
    else:
        raise InvalidInputError(f"--budget: expected {FORMS}, got {value!r}")
    if n < 1:
        raise InvalidInputError(f"--budget: {text!r} is {n} bytes; a budget must be at least 1 byte")
    return n


def parse_memory(value: "str | int") -> int:
    """A device's memory in bytes (``--memory``, `remat.capacity`): what `parse_budget` reads, but
    not a ratio (there is no graph to be relative to); errors name ``--memory``."""
    if is_relative(value):
        raise InvalidInputError(f"--memory: give a size such as 24GiB, not a ratio ({value!r})")
    try:
        return parse_budget(value)
    except InvalidInputError as e:
        raise InvalidInputError(str(e).replace("--budget:", "--memory:", 1)) from None


def is_relative(value: "str | int") -> bool:
    return isinstance(value, str) and value.strip().lower().endswith("x")


def budget_list(spec: str, graph: "Graph | None" = None) -> list[int]:
    """Budgets in bytes from ``LO:HI:COUNT`` (linear, inclusive) or ``B1,B2,...``.

    In a range both ends are relative (ratios are spaced linearly, then each is turned into bytes
    as `parse_budget` does) or both absolute (bytes spaced linearly, rounded down).
    """
    where = "--budgets"
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidInputError(f"{where}: expected LO:HI:COUNT (0.2x:1.0x:9, 1GiB:4GiB:4) or a comma list "
                                f"(0.25x,0.5x,1x); got {spec!r}")
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) != 3:
            raise InvalidInputError(f"{where}: a range is LO:HI:COUNT, e.g. 0.2x:1.0x:9; got {spec!r}")
        lo, hi, count_text = (p.strip() for p in parts)
        try:
            count = int(count_text)
        except ValueError:
            raise InvalidInputError(f"{where}: COUNT in {spec!r} must be a whole number, got {count_text!r}") from None
        if count < 1:
            raise InvalidInputError(f"{where}: COUNT in {spec!r} must be at least 1")
        if is_relative(lo) != is_relative(hi):
            raise InvalidInputError(f"{where}: in {spec!r} both ends must be relative (0.2x:1x:5) "
                                    "or both absolute (1GiB:4GiB:4)")
        if is_relative(lo):
            r_lo, _ = _as_budgets(_split, lo)
            r_hi, _ = _as_budgets(_split, hi)
            if graph is None:
                raise InvalidInputError(f"{where}: relative budgets need a graph")
            peak = baseline_peak(graph)
            ratios = [r_lo + (r_hi - r_lo) * i / (count - 1) if count > 1 else r_lo for i in range(count)]
            out = [_floor(r * peak) for r in ratios]
        else:
            b_lo, b_hi = _as_budgets(parse_budget, lo, graph), _as_budgets(parse_budget, hi, graph)
            out = [b_lo + (b_hi - b_lo) * i // (count - 1) if count > 1 else b_lo for i in range(count)]
        bad = [b for b in out if b < 1]
        if bad:
            raise InvalidInputError(f"{where}: {spec!r} gives a budget below 1 byte")
        return out
    return [_as_budgets(parse_budget, p.strip(), graph) for p in spec.split(",") if p.strip()]


def _as_budgets(fn, *args):
    """Call a single-budget parser, naming --budgets instead of --budget in its errors."""
    try:
        return fn(*args)
    except InvalidInputError as e:
        raise InvalidInputError(str(e).replace("--budget:", "--budgets:", 1)) from None
