"""Entry point of one rank's kernel process: ``python -m clorch_repl.session.worker -f CONN``.

A rank is a plain ipykernel with three additions made before the kernel starts:

* it ends itself and its process group as soon as the notebook process that started it is gone,
  even when that process was SIGKILLed (no orphans holding GPUs), and removes the session's
  private directory, which nobody else is left to remove;
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
import shutil
import signal
import sys

from ..procs import end_own_group, watch_parent

PARENT_ENV = "CLORCH_PARENT_PID"
#: quiet=False: Python-level output is echoed to the process's stdout/stderr, i.e. the rank's log.
#: capture_fd_output=False: native output (NCCL, C++ warnings) goes straight to the log, once.
#: HistoryManager.enabled=False: no SQLite history database per rank; writing it cost a rank
#: about 3 ms per cell here, more than the rest of a cell's round trip. In/Out still work.
#: outstream_class: see RankOutStream. _execute_sleep=0: ipykernel sleeps 0.5 ms after every
#: cell so that a client reading the shell reply first is less likely to miss late output; the
#: relay waits for the idle status on iopub instead, which is ordered after all output.
KERNEL_OPTIONS = ("--IPKernelApp.quiet=False", "--IPKernelApp.capture_fd_output=False",
                  "--HistoryManager.enabled=False",
                  "--IPKernelApp.outstream_class=clorch_repl.session.worker.RankOutStream",
                  "--IPythonKernel._execute_sleep=0",
                  # ipykernel's own parent poller would os._exit before ours removes the session's
                  # directory; ours does everything it did.
                  "--IPKernelApp.parent_handle=0")
STACK_FILE_ENV = "CLORCH_STACK_FILE"
SESSION_DIR_ENV = "CLORCH_SESSION_DIR"


def _out_stream_class() -> type:
    from ipykernel.iostream import OutStream

    class RankOutStream(OutStream):
        """ipykernel's stream, minus the flush of a stream nothing was written to.

        ipykernel flushes stdout and stderr around every cell, and each flush from the main thread
        waits for two hops through the IOPub thread: over a millisecond per cell here, spent even
        when the cell printed nothing. Skipping a clean stream's flush changes nothing else:
        whatever was written before a flush is still sent by it.
        """

        _clean = False

        def write(self, string: str) -> int | None:
            self._clean = False
            return super().write(string)

        def flush(self) -> None:
            if self._clean:
                return
            self._clean = True
            super().flush()

    return RankOutStream


def __getattr__(name: str) -> type:
    # Built on first use: importing ipykernel here at module level would slow every import of
    # clorch_repl.session in the notebook's own process.
    if name == "RankOutStream":
        cls = _out_stream_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _orphaned() -> None:
    """The notebook is gone (killed, perhaps): nobody will stop us or clean up after us. Remove the
    session's private directory (every rank tries; whoever is first wins) and end the group."""
    session_dir = os.environ.get(SESSION_DIR_ENV)
    if session_dir:
        shutil.rmtree(session_dir, ignore_errors=True)
    end_own_group()


def main(argv: list[str] | None = None) -> None:
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    watch_parent(parent, _orphaned)
    # A segfault or abort prints the Python stacks into the rank's log (fd 2), whose tail the
    # notebook shows when a rank dies mid-cell.
    faulthandler.enable(file=sys.__stderr__, all_threads=False)  # the crashing thread: short
    stack_path = os.environ.get(STACK_FILE_ENV)
    if stack_path:
        stack_file = open(stack_path, "a", buffering=1)  # noqa: SIM115 - must outlive main()
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)

    from ipykernel.kernelapp import IPKernelApp

    args = list(sys.argv[1:] if argv is None else argv)
    IPKernelApp.launch_instance(argv=[*args, *KERNEL_OPTIONS])


if __name__ == "__main__":
    main()
