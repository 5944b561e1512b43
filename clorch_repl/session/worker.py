"""Entry point of one rank's kernel process: ``python -m clorch_repl.session.worker -f CONN``.

A rank is a plain ipykernel with three additions made before the kernel starts:

* it ends itself and its process group as soon as the notebook process that started it is gone,
  even when that process was SIGKILLed (no orphans holding GPUs);
* ``SIGUSR1`` dumps the Python stack of every thread into the rank's stack file, from a C-level
  signal handler, so the notebook can show where a rank that ignores Ctrl-C is stuck (a hung
  collective blocks in C++ and never sees KeyboardInterrupt);
* ``quiet=False`` echoes everything the rank prints to its real stdout/stderr, which the session
  points at the rank's log file, so ``%clorch logs`` holds Python and native output alike.

The process group itself is initialised later by :mod:`clorch_repl.session.bootstrap`, through
the kernel, so that its failures arrive as ordinary tracebacks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

from ..procs import end_own_group, watch_parent

PARENT_ENV = "CLORCH_PARENT_PID"
STACK_FILE_ENV = "CLORCH_STACK_FILE"


def main(argv: list[str] | None = None) -> None:
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    watch_parent(parent, end_own_group)
    stack_path = os.environ.get(STACK_FILE_ENV)
    if stack_path:
        stack_file = open(stack_path, "a", buffering=1)  # noqa: SIM115 - must outlive main()
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)

    from ipykernel.kernelapp import IPKernelApp

    args = list(sys.argv[1:] if argv is None else argv)
    IPKernelApp.launch_instance(argv=[*args, "--IPKernelApp.quiet=False", "--IPKernelApp.capture_fd_output=False"])


if __name__ == "__main__":
    main()
