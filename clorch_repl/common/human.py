"""Sizes and durations as the tables of ``%clorch status`` and ``%clorch top`` print them, and
clorch's messages wrapped to a notebook cell's width (:func:`wrap`)."""

from __future__ import annotations

import textwrap

__all__ = ["size", "duration", "span", "wrap", "COLUMNS"]

#: The width clorch wraps its own messages to: a notebook cell shows about 100 columns of
#: monospace text at JupyterLab's default font and a 1400-pixel window; wider lines were wrapped
#: by the browser wherever a character fell (``%clor|ch logs``).
COLUMNS = 100


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


def span(seconds: float) -> str:
    """A duration the user gave, in its largest whole unit: ``2 d``, ``1 h``, ``30 min``, ``90 s``
    (``--keep-for``: ``30d`` said as ``720 h`` was hard to read; ``24h`` is said ``1 d``)."""
    if seconds % 86400 == 0:
        return f"{seconds / 86400:.0f} d"
    if seconds % 3600 == 0:
        return f"{seconds / 3600:.0f} h"
    if seconds % 60 == 0:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:g} s"


def headline(text: str, limit: int | None = None) -> str:
    """``text``'s first non-empty line, `` ...`` after it where more lines follow; with ``limit``,
    at most that many characters. Why: some messages run on for lines (gloo's connection errors
    end in a paragraph of advice), and a one-line summary is read at a glance, the whole message
    being beside it (the traceback, the job's logs). A long first line is kept whole unless a
    ``limit`` is asked for: it is often the message itself, advice and all (a refusal's)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    cut = len(lines) > 1
    if limit is not None and len(first) > limit:
        first, cut = first[:limit - 4].rstrip(), True
    return first + " ..." if cut else first


def wrap(text: str, width: int = COLUMNS, indent: str = "", lead: str = "") -> str:
    """``text`` (one message, maybe several paragraphs split by newlines) wrapped at ``width``
    columns between words, never inside one (a path or a command stays whole, even when longer
    than the width); continuation lines start with ``indent``. Lines that start with spaces
    (a stack, a table) are kept as they are. ``lead``: what the page shows before the text's first
    line and is not part of it (IPython's ``UsageError: ``); the first line leaves room for it."""
    if lead:
        return wrap(lead + text, width, indent)[len(lead):]
    out = []
    for line in text.split("\n"):
        if not line.strip() or line[:1].isspace() or len(line) <= width:
            out.append(line)
            continue
        out.extend(piece.replace(_GLUE, " ") for piece in textwrap.wrap(
            _glue_commands(line), width, subsequent_indent=indent, break_long_words=False,
            break_on_hyphens=False))
    return "\n".join(out)


#: joins the words of a command while a message is wrapped (textwrap breaks only at whitespace)
_GLUE = "\x00"


def _glue_commands(line: str) -> str:
    """A command a message names (``%clorch restart --ranks 1``, ``%clorch logs 0``) kept on one
    line: a user copies it from there, and ``%clorch restart`` / ``--ranks 1`` on two lines reads
    as two things."""
    out: list[str] = []
    state = None  # after "%clorch": "cmd"; after its subcommand or a value: "sub"; after an option: "opt"
    for word in line.split(" "):
        glue = (state == "cmd" and word.isidentifier()) or (state == "sub" and word.startswith("-")) \
            or (state == "sub" and (word.isdigit() or word.isupper())) or (state == "opt" and not word.startswith("-"))
        if glue and out:
            out[-1] += _GLUE + word
            state = "opt" if word.startswith("-") else "sub"
            continue
        state = "cmd" if word in ("%clorch", "%%distributed") else None
        out.append(word)
    return " ".join(out)
