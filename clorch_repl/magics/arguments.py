"""Argument decorators shared by every clorch magic, so each option parses and fails the same way
everywhere and ``--help`` works on all of them (after ipyparallel's magics)."""

from __future__ import annotations

from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.utils.process import arg_split  # the tokenizer the magic parsers use

from ..errors import ConfigError

Func = Callable[..., Any]


def _compose(*decorators: Func) -> Func:
    def apply(func: Func) -> Func:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func
    return apply


timeout_option = _compose(argument(
    "--timeout", metavar="SECONDS", default=None,
    help="time limit in seconds (none unless given)"))

ranks_option = _compose(argument(
    "--ranks", metavar="LIST", default=None,
    help="comma-separated ranks to run on, e.g. 0,2 (default: every rank)"))

topology_options = _compose(
    argument("--nproc", metavar="N", default=None,
             help="number of ranks (default: $CLORCH_NPROC if set, else one per visible GPU; 2 CPU ranks with no GPU)"),
    argument("--devices", metavar="LIST", default=None,
             help="comma-separated GPU indices, one per rank, e.g. 0,1"),
    argument("--backend", metavar="NAME", default=None,
             help="nccl (GPUs, the default there) or gloo (CPU, the default without GPUs)"),
    argument("--timeout", metavar="SECONDS", default=None,
             help="process-group timeout for rendezvous and collectives (default 600)"),
)

hang_notice_option = _compose(argument(
    "--hang-notice", metavar="SECONDS", default=None, dest="hang_notice",
    help="with no output and no finished collective for this long, say which rank and collective "
         "hold the cell, once, without stopping it (default 30; 0 turns it off)"))

stdin_ranks_option = _compose(argument(
    "--stdin-ranks", metavar="LIST", default=None, dest="stdin_ranks",
    help="comma-separated ranks whose input(), getpass and breakpoint() prompts reach the notebook, "
         "e.g. 0 (default: every rank; the others' input() raises StdinNotImplementedError)"))

max_mb_option = _compose(argument(
    "--max-mb", metavar="MB", default=None, dest="max_mb",
    help="largest value one rank may send or receive, in MB (default 256)"))

tail_option = _compose(argument("--tail", metavar="N", type=int, default=200,
                                help="how many lines to show (default 200; 0 for all)"))


def parse(func: Func, line: str) -> Any:
    """Parse ``line`` with ``func``'s magic_arguments parser; ``--help`` prints help and returns None.

    IPython's magic parsers are built without argparse's own ``-h``; we answer it here so that
    ``%clorch start --help`` works like any command line.
    """
    if {"-h", "--help"} & set(arg_split(line)):
        print(func.parser.format_help())  # type: ignore[attr-defined]
        return None
    try:
        return parse_argstring(func, line)
    except UsageError as exc:
        raise UsageError(f"{exc} (see --help)") from None


def parse_hang_notice(value: str | None) -> float | None:
    """``--hang-notice``: seconds, 0 (off) or more; None when not given."""
    from ..topology import parse_number

    return parse_number(value, "--hang-notice", "seconds", zero="off")


def parse_max_mb(value: str | None) -> int:
    """``--max-mb``: the size limit of one value in bytes (default 256 MB)."""
    from ..session.values import DEFAULT_LIMIT_BYTES
    from ..topology import parse_number

    mb = parse_number(value, "--max-mb", "megabytes")
    return DEFAULT_LIMIT_BYTES if mb is None else int(mb * 1_000_000)


def parse_ranks(value: str | None, what: str = "--ranks") -> list[int] | None:
    from ..topology import parse_int_list

    return parse_int_list(value, what)


__all__ = ["magic_arguments", "argument", "timeout_option", "ranks_option", "topology_options",
           "tail_option", "hang_notice_option", "stdin_ranks_option", "max_mb_option", "parse", "parse_max_mb", "parse_hang_notice", "parse_ranks", "ConfigError"]
