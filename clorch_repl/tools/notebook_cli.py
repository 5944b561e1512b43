"""``clorch-notebook``: run a notebook headless (``run``, :mod:`.notebook_runner`) or turn it back
into a torchrun script (``export``, :mod:`.notebook_export`). The command line only: parsing,
its errors, the exit status."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Sequence

from . import notebook_runner
from ..errors import ConfigError
from ..common.topology import NPROC_ENV, parse_number

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def _seconds(text: str) -> float:
    """A positive number of seconds, refused in the words every other number option uses."""
    try:
        value = parse_number(text, "it", "seconds")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("it ")) from None
    assert value is not None  # text is never None here
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clorch-notebook",
                                     description="Run Jupyter notebooks headless, e.g. as tests of distributed code.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser("run", help="execute a notebook in a real kernel and write the executed copy",
                              description=notebook_runner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("notebook", help="the .ipynb file")
    run.add_argument("--nproc", type=_positive_int, default=None,
                     help=f"ranks for %%clorch start when the notebook gives none (sets {NPROC_ENV})")
    run.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                     help="time limit of each cell in seconds (default 600)")
    run.add_argument("--output", default=None, metavar="OUT.ipynb",
                     help="where to write the executed notebook (default: NB.executed.ipynb beside it)")
    run.add_argument("--cwd", default=None, help="the kernel's working directory (default: the notebook's folder)")
    run.add_argument("--kernel", default=None, help="kernel name (default: the notebook's kernelspec, else python3)")
    from . import notebook_export

    notebook_export.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        from . import notebook_export

        return notebook_export.main(args)
    try:
        runner = notebook_runner.NotebookRun(args.notebook, nproc=args.nproc, timeout_s=args.timeout, output=args.output,
                             cwd=args.cwd, kernel_name=args.kernel)
    except notebook_runner.UsageProblem as exc:
        print(f"clorch-notebook: {exc}", file=sys.stderr)
        return notebook_runner.EXIT_USAGE
    status = runner.run()
    # The run is over and its status decided: a signal between here and the exit (a second Ctrl-C
    # sent while the stop it asked for ended) has nothing left to stop and must not turn the
    # status into a death by signal.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    return status


if __name__ == "__main__":
    sys.exit(main())
