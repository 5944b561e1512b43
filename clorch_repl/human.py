"""Sizes and durations as the tables of ``%clorch status`` and ``%clorch top`` print them."""

from __future__ import annotations

__all__ = ["size", "duration"]


def size(n: float | None) -> str:
    """``512 B``, ``3.0 GiB``; ``-`` for an unknown size."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def duration(seconds: float | None) -> str:
    """``45s``, ``1m15s``, ``2h03m07s``; ``-`` for none."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
