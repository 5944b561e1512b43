"""Argument decorators shared by every clorch magic, so each option parses and fails the same way
everywhere and ``--help`` works on all of them (after ipyparallel's magics)."""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split  # shlex with IPython's settings (see split_line)

from ..errors import ClorchError, ConfigError, DistributedCellError, StartInterrupted, StartupError, TopologyError
from ..common.human import wrap

if TYPE_CHECKING:
    from ..launchers.base import LaunchOptions
    from ..session.script_run import RunRequest

Func = Callable[..., Any]

#: How the magics spell the options whose checks they share with the Python API (``nproc=2`` there,
#: ``--nproc 2`` here): the words of a :class:`~clorch_repl.errors.TopologyError` in a refusal
OPTION_NAMES = {**{name: f"--{name}" for name in ("nproc", "devices", "backend", "timeout")},
                "limit": "a cell's own time limit is %%distributed --timeout"}


def refused(message: object) -> UsageError:
    """The one way a magic refuses a command: IPython shows a ``UsageError`` as one message after
    ``UsageError: `` on the page, so it is wrapped like clorch's other messages (between words, at
    the cell's width, the first line leaving room for that prefix); a browser wrapped it anywhere
    (``%clor|ch logs``)."""
    return UsageError(wrap(str(message), indent="  ", lead="UsageError: "))


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Show the package's own errors, and the parsers' refusals, as one wrapped message
    (:func:`refused`), options named as the magics spell them (:data:`OPTION_NAMES`); rank
    failures keep their tracebacks."""
    try:
        yield
    except StartupError as exc:
        if exc.outcome is not None and exc.outcome.failed:
            raise DistributedCellError(exc.outcome) from None
        raise refused(exc) from None
    except TopologyError as exc:  # the checks the Python API shares say nproc=; the user typed --nproc
        raise refused(exc.spelled(OPTION_NAMES)) from None
    except (ClorchError, UsageError) as exc:
        raise refused(exc) from None
    except StartInterrupted as exc:  # the user's Ctrl-C during a start: what became of it, not where it landed
        raise refused(exc.message) from None


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
             help="process-group timeout for rendezvous and collectives, in seconds (default 600 on both backends)"),
)

#: where the ranks run (API.md, "Beyond one host"); read by :func:`parse_launch`
launcher_options = _compose(
    argument("--launcher", metavar="NAME", default="local",
             help="where ranks run: local (children of this kernel, the default), slurm (srun) or attach "
                  "(print the command to run on every node under torchrun/srun, and wait for the ranks)"),
    argument("--nodes", metavar="N", default=None, help="slurm/attach: number of nodes (default 1)"),
    argument("--nproc-per-node", metavar="N", default=None, dest="nproc_per_node",
             help="slurm/attach: ranks per node, one GPU each on GPU nodes (gloo on CPU nodes)"),
    argument("--listen", metavar="ADDR", default=None,
             help="slurm/attach: the one address of this host the ranks call back to (default: the "
                  "interface that routes to the nodes; never 0.0.0.0)"),
    argument("--port", metavar="PORT", default=None, help="slurm/attach: the port to listen on (default: any free)"),
    argument("--orphan-timeout", metavar="SECONDS", default=None, dest="orphan_timeout",
             help="slurm/attach: a rank that has not heard from this notebook for this long ends itself (default 60)"),
    argument("--start-timeout", metavar="SECONDS", default=None, dest="start_timeout",
             help="slurm/attach: how long to wait for every rank to call back (default 300)"),
    argument("--partition", metavar="P", default=None, help="slurm: the partition (outside an allocation)"),
    argument("--time", metavar="T", default=None, help="slurm: the time limit (outside an allocation)"),
    argument("--srun-args", metavar="ARGS", default="", dest="srun_args",
             help='slurm: more srun arguments, one quoted string, e.g. "--gres=gpu:8 --exclusive"'),
    argument("--spares", metavar="0|1", default=None,
             help="1 keeps a warm spare per rank (torch imported, no GPU touched; remote ranks: beside their "
                  "nanny) so that %%clorch restart takes seconds less, 0 keeps none (default: 1 with GPUs, 0 on CPUs)"),
    argument("--name", metavar="NAME", default=None,
             help="the session's name, should it be detached (%%clorch detach; default USER-N)"),
    argument("--cpu-bind", metavar="MODE", default=None, dest="cpu_bind",
             help="numa: each GPU rank binds itself to the CPU cores of its GPU's NUMA node; none (default)"),
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

def one_rank(text: str) -> int:
    """argparse's type for a positional that names one rank: a whole number (its range is the
    session's to check). A list or range is said to name several, where argparse's own words were
    "invalid int value"."""
    try:
        return int(text)
    except ValueError:
        several = (" (one rank at a time: a list or a range names several)"
                   if any(c in text.lstrip("-") for c in ",-") else "")
        raise argparse.ArgumentTypeError(f"one rank number, e.g. 0; got {text!r}{several}") from None


tail_option = _compose(argument("--tail", metavar="N", type=int, default=200,
                                help="how many lines to show (default 200; 0 for all)"))


def parse(func: Func, line: str) -> Any:
    """Parse ``line`` with ``func``'s magic_arguments parser; ``--help`` prints help and returns None.

    IPython's magic parsers are built without argparse's own ``-h``; we answer it here so that
    ``%clorch start --help`` works like any command line.
    """
    argv = _values_kept(func.parser, split_line(line))  # type: ignore[attr-defined]
    if _help_in(argv):
        print(help_text(func.parser))  # type: ignore[attr-defined]
        return None
    try:
        return func.parser.parse_args(argv)  # type: ignore[attr-defined]
    except UsageError as exc:
        raise refused(f"{exc} (see --help)") from None


def asks_help(func: Func, line: str) -> bool:
    """Whether ``line`` asks ``func``'s magic for its help: ``-h`` or ``--help`` as a word of its
    own, not an option's value (``--srun-args "-h"`` is srun's ``-h``, not a request for ours)."""
    return _help_in(_values_kept(func.parser, split_line(line)))  # type: ignore[attr-defined]


def _help_in(argv: list[str]) -> bool:
    return bool({"-h", "--help"} & set(argv))


def split_line(line: str) -> list[str]:
    """A magic's line as a shell splits a command line: quotes group words and are taken off
    (``--name 'a b'`` gives ``a b``, ``--srun-args "--gres=gpu:8 --exclusive"`` one value). Why not
    IPython's own reading (``parse_argstring``): it keeps the quotes in the value, so a quoted name
    was refused, or echoed, with its quotes, and a quoted ``--srun-args`` reached srun as one
    argument. A quote left open is refused, saying so (shlex raised a bare ValueError)."""
    try:
        return arg_split(line, posix=True)
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        fix = ("a \\ at the end escapes nothing: remove it, or write \\\\ for a backslash"
               if "escaped" in str(exc) else
               "close the quote (a quote inside a value goes between quotes of the other kind)")
        raise refused(f"cannot read {line.strip()!r}: {str(exc).lower()}; {fix}") from None


def help_text(parser: Any) -> str:
    """A magic parser's ``--help``, without the reST literal-block marker (``::``) that
    IPython's help formatter puts before the usage for its own documentation pages."""
    return parser.format_help().removeprefix("::\n\n")


def _values_kept(parser: Any, argv: list[str]) -> list[str]:
    """``argv`` with each option that takes a value joined to a value that begins with ``-``
    (``--keep-for -5m`` as ``--keep-for=-5m``). argparse takes such a value for an option of its
    own and says only "expected one argument", where the option's own check says what is wrong
    with the value (a negative duration); a token that is one of the parser's options stays one."""
    options = parser._option_string_actions  # argparse's table of option strings (no public accessor)
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        action = options.get(token)
        if action is not None and action.nargs is None:  # an option of one value (flags have nargs 0)
            following = next(tokens, None)
            if following is not None and following.startswith("-") and following not in options:
                out.append(f"{token}={following}")
                continue
            out.append(token)
            if following is not None:
                out.append(following)
            continue
        out.append(token)
    return out


def parse_hang_notice(value: str | None) -> float | None:
    """``--hang-notice``: seconds, 0 (off) or more; None when not given."""
    from ..common.topology import parse_number

    return parse_number(value, "--hang-notice", "seconds", zero="off")


def parse_max_mb(value: str | None) -> int:
    """``--max-mb``: the size limit of one value in bytes (default 256 MB)."""
    from ..wire.values import DEFAULT_LIMIT_BYTES
    from ..common.topology import parse_number

    mb = parse_number(value, "--max-mb", "megabytes")
    return DEFAULT_LIMIT_BYTES if mb is None else int(mb * 1_000_000)


def parse_launch(args: Any) -> "LaunchOptions":
    """The launcher options of ``%clorch start`` as a validated LaunchOptions."""
    from ..launchers.base import ORPHAN_TIMEOUT_S, START_TIMEOUT_S, LaunchOptions
    from ..common.topology import parse_number

    def whole(value: str | None, what: str, floor: int) -> int | None:
        if value is None:
            return None
        text = str(value).strip()
        if not text.isdigit() or int(text) < floor:
            raise ConfigError(f"{what} must be a whole number >= {floor}; got {value!r}")
        return int(text)

    _refuse_others_options(args)
    orphan = parse_number(args.orphan_timeout, "--orphan-timeout", "seconds")
    start = parse_number(args.start_timeout, "--start-timeout", "seconds")
    listen = args.listen
    if listen is not None:
        import ipaddress

        try:
            address = ipaddress.ip_address(listen)
        except ValueError:
            raise ConfigError(f"--listen must be an IP address of this host; got {listen!r}") from None
        if address.is_unspecified:
            raise ConfigError("--listen 0.0.0.0 would listen on every interface: give the one address the "
                              "nodes reach this host at")
    return LaunchOptions(nodes=whole(args.nodes, "--nodes", 1) or 1,
                         nproc_per_node=whole(args.nproc_per_node, "--nproc-per-node", 1),
                         listen=listen, port=_port(args.port),
                         orphan_timeout_s=orphan or ORPHAN_TIMEOUT_S, start_timeout_s=start or START_TIMEOUT_S,
                         partition=args.partition, time=args.time, srun_args=args.srun_args or "",
                         spares=_spares(args.spares), name=_name(getattr(args, "name", None)))


#: the options only some launchers read (``launcher_options``' help says whose): given to another
#: launcher they were ignored without a word (``--partition gpu`` on this host's ranks)
_CALLBACK_OPTIONS = ("nodes", "nproc_per_node", "listen", "port", "orphan_timeout", "start_timeout")
_SLURM_OPTIONS = ("partition", "time", "srun_args")
_READ_BY = {"local": (), "attach": _CALLBACK_OPTIONS, "slurm": _CALLBACK_OPTIONS + _SLURM_OPTIONS}


def _refuse_others_options(args: Any) -> None:
    """Refuse an option that ``--launcher`` does not read (a launcher of a plugin's is not checked:
    which options it reads is its own)."""
    launcher = getattr(args, "launcher", "local")
    if launcher not in _READ_BY:
        return
    parts = []
    for names, whose in ((_CALLBACK_OPTIONS, "--launcher slurm or attach"), (_SLURM_OPTIONS, "--launcher slurm")):
        given = [f"--{name.replace('_', '-')}" for name in names
                 if name not in _READ_BY[launcher] and getattr(args, name, None) not in (None, "")]
        if given:
            parts.append(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for {whose}")
    if parts:
        raise ConfigError(f"{'; '.join(parts)}, and this start's launcher is {launcher}: give the launcher "
                          "they are for, or leave them out")


def _name(value: str | None) -> str | None:
    """``--name``: checked at the start, before any rank exists, though only a detach uses it."""
    from ..session.registry import check_name

    return None if value is None else check_name(value)


def _spares(value: str | None) -> int | None:
    """``--spares``: 0 or 1 warm spare sets; None when not given (the launcher's default)."""
    if value is None:
        return None
    text = str(value).strip()
    if text not in ("0", "1"):
        raise ConfigError(f"--spares must be 0 (no warm spares) or 1 (one per rank); got {value!r}")
    return int(text)


def _port(value: str | None) -> int:
    if value is None:
        return 0
    text = str(value).strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"--port must be a TCP port, 1..65535; got {value!r}")
    return int(text)


def parse_cpu_bind(value: str | None) -> str:
    mode = (value or "none").strip().lower()
    if mode not in ("numa", "none"):
        raise ConfigError(f"--cpu-bind must be numa or none; got {value!r}")
    return mode


def parse_ranks(value: str | None, what: str = "--ranks") -> list[int] | None:
    from ..common.topology import parse_int_list

    return parse_int_list(value, what)


def parse_run(parser: Any, line: str) -> RunRequest | None:
    """``%clorch run``'s line as a :class:`RunRequest`; None after printing the help (``--help``
    before the script). ``parser``: the magic's argparse parser, with ``script`` and a REMAINDER
    ``args``. Bad input raises :class:`ConfigError` (a ``UsageError`` from the parser itself)."""
    from ..session.script_run import RunRequest
    from ..common.topology import parse_timeout

    argv = split_line(line)  # quotes go, as a shell takes them off
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:  # as parse() says it for every other command
        raise refused(f"{exc} (see --help)") from None
    if args.help:
        print(help_text(parser))
        return None
    if not args.script:
        what = "MODULE" if args.module else "SCRIPT"
        raise ConfigError(f"%clorch run needs a {what}: %clorch run [options] SCRIPT [ARGS...] or "
                          "%clorch run [options] -m MODULE [ARGS...] (see --help)")
    if args.module and not all(part.isidentifier() for part in args.script.split(".")):
        raise ConfigError(f"-m takes a module name (e.g. pkg.train), got {args.script!r}; to run a file, leave -m out")
    return RunRequest(script=args.script, args=tuple(args.args), module=args.module, interactive=args.interactive,
                      ranks=parse_ranks(args.ranks), timeout_s=parse_timeout(args.timeout, "--timeout"),
                      hang_notice_s=parse_hang_notice(args.hang_notice), merge=not args.no_merge)


__all__ = ["launcher_options", "parse_launch", "parse_cpu_bind", "magic_arguments", "argument", "timeout_option", "ranks_option", "topology_options",
           "tail_option", "hang_notice_option", "stdin_ranks_option", "max_mb_option", "parse", "parse_max_mb", "parse_hang_notice", "parse_ranks", "parse_run",
           "split_line", "asks_help", "ConfigError"]
