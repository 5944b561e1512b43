"""What a ``%%distributed`` line asks for, parsed and checked once for both of its readers.

Two places read the line: the magic itself, and the head start (:mod:`.head_start`), which sends
the cell to the ranks from ipykernel's shell dispatch before IPython reaches the magic. Both take
:func:`cell_options`, so a line the magic would refuse is never sent early, and what the ranks
are sent is what the magic would have sent.

Why memoised: a notebook runs the same few lines (``%%distributed``, ``%%distributed --ranks 0``)
over and over, and argparse costs about 60 us of every cell's path. A line that fails to parse
or asks for ``--help`` is not memoised (it raises, or prints the help, each time).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

from .arguments import asks_help, parse, parse_hang_notice, parse_max_mb, parse_ranks

logger = logging.getLogger(__name__)

__all__ = ["CellOptions", "cell_options"]

#: distinct lines remembered (the oldest is parsed again when it comes back)
MEMO_LINES = 128


@dataclass(frozen=True)
class CellOptions:
    """One ``%%distributed`` line, parsed and checked (see :func:`cell_options`)."""

    ranks: tuple[int, ...] | None
    timeout_s: float | None
    stdin_ranks: tuple[int, ...] | None
    hang_notice_s: float | None
    #: --gather NAME, checked to be a Python name
    gather: str | None
    #: --max-mb in bytes (the size limit of --gather's values)
    max_bytes: int
    #: --profile DIR ("": the default folder), None when not asked for
    profile: str | None
    merge: bool

    @property
    def rank_list(self) -> list[int] | None:
        return None if self.ranks is None else list(self.ranks)

    @property
    def stdin_rank_list(self) -> list[int] | None:
        return None if self.stdin_ranks is None else list(self.stdin_ranks)


def cell_options(magic: Callable[..., Any], line: str, *, quiet_help: bool = False) -> CellOptions | None:
    """``line`` read with ``magic``'s parser (the ``%%distributed`` magic's ``magic_arguments``);
    None after printing the help (only None with ``quiet_help``: the head start asks, and the
    magic prints it). Bad input raises ``UsageError`` (the parser's own) or
    :class:`~clorch_repl.errors.ClorchError` (a value the parser let through)."""
    if "-h" in line and asks_help(magic, line):
        return None if quiet_help else parse(magic, line)  # the help, printed every time it is asked for
    # Memoised by the function under a bound magic: its parser is the function's (magic_arguments),
    # and a key holding the ClorchMagics would keep an unloaded extension's instance alive.
    return _read(getattr(magic, "__func__", magic), line)


@functools.lru_cache(maxsize=MEMO_LINES)  # a line that raises is not memoised: it raises each time
def _read(magic: Callable[..., Any], line: str) -> CellOptions:
    args = parse(magic, line)
    from ..session.transfer import check_name
    from ..common.topology import parse_timeout

    ranks = parse_ranks(args.ranks)
    stdin_ranks = parse_ranks(args.stdin_ranks, "--stdin-ranks")
    return CellOptions(
        ranks=None if ranks is None else tuple(ranks),
        timeout_s=parse_timeout(args.timeout, "--timeout"),
        stdin_ranks=None if stdin_ranks is None else tuple(stdin_ranks),
        hang_notice_s=parse_hang_notice(args.hang_notice),
        gather=None if args.gather is None else check_name(args.gather, "--gather"),
        max_bytes=parse_max_mb(args.max_mb),
        profile=args.profile,
        merge=not args.no_merge)


def notebook_cell_number(shell: Any) -> int:
    """The number the notebook shows for the cell running now (``[12]``), which the ranks give
    their run of a ``%%distributed`` cell: a rank's traceback then says ``Cell In[12]`` where the
    notebook shows ``[12]``. Numbering on the rank, rather than rewriting the traceback text
    afterwards, keeps every place that shows it right (tracebacks, the rank's ``In``/``Out``,
    ``%clorch why`` stacks) without parsing text."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(result, "execution_count", None)
    return int(count if count is not None else shell.execution_count)
