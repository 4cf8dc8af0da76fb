"""Byte sizes as people write them: parsing a budget ('80GiB') and printing sizes.

Units: `B`; binary `KiB MiB GiB TiB` (powers of 1024); decimal `KB MB GB TB` (powers of
1000); a bare `K M G T` means the binary unit, as GPU memory is usually quoted ('80G' = 80 GiB).
Case-insensitive, optional space, fractional numbers allowed ('1.5 TiB'); a plain number is bytes.
"""

from __future__ import annotations

import math
import re

_BINARY = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """'80GiB' -> 85899345920. Raises ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise TypeError(f"A byte size must be an int or a string like '80GiB', got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"A byte size must be positive, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"A byte size must be an int or a string like '80GiB', got "
                        f"{type(value).__name__}: {value!r}")
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else ""
    if unit.endswith("ib"):
        unit = unit[:-2]
    scale = _DECIMAL.get(unit) or _BINARY.get(unit)
    if m is None or scale is None:
        raise ValueError(
            f"Cannot read {value!r} as a byte size: expected a number and a unit, e.g. "
            f"'80GiB', '80GB', '512MiB', '80G' (binary) or a plain number of bytes."
        )
    nbytes = int(float(m.group(1)) * scale)
    if nbytes <= 0:
        raise ValueError(f"A byte size must be positive, got {value!r}")
    return nbytes


def format_bytes(nbytes: int | float | None) -> str:
    """Binary units, three significant digits: 1.23 GiB, 512 MiB, 0 B."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1000 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int) -> str:
    """Parameter counts: 6.74B, 1.85M, 7.6K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
