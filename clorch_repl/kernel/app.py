"""Entry point of one rank's kernel process: ``python -m clorch_repl.kernel.app -f CONN``, or
:func:`main` called in a process forked from the local session's zygote, which imported all of
this once (:mod:`clorch_repl.host.zygote`, issue 39).

The kernel is started by the rank's :mod:`clorch_repl.host.supervisor`, which ends it and
everything it started when the notebook is gone or the rank is stopped. A rank is a plain ipykernel
with these additions:

* ``SIGUSR1`` dumps the Python stack of the main thread into the rank's stack file, from a C-level
  signal handler, so the notebook can show where a rank that ignores Ctrl-C is stuck (a hung
  collective blocks in C++ and never sees KeyboardInterrupt);
* ``quiet=False`` echoes everything the rank prints to its real stdout/stderr, which the session
  points at the rank's log file, so ``%clorch logs`` holds Python and native output alike; a
  cell's traceback (KeyboardInterrupt too) is written there as well, and ipykernel's start-up
  banner ("To connect another client...") is not, since it is no output of the rank's;
* ``\r`` progress updates are coalesced before they are published (:mod:`.output`);
* the relay's execute requests take a lean path through the kernel (:mod:`.lean_execute`):
  an empty cell cost a rank about 2 ms of CPU in ipykernel's, most of it not the cell's;
* no shell-channel thread: ipykernel 7 reads the shell socket on a thread of its own and hands each
  request to the main thread (and each reply back) over an inproc socket, a thread hop each way
  per cell for the subshells that nothing here uses; a rank reads and answers on its main thread,
  as ipykernel 6 did and ipykernel 7 still does for a kernel without that thread;
* a watchdog thread ends the kernel when its supervisor is gone (the supervisor itself needs no
  GIL to end the kernel; this thread only covers a supervisor killed outright);
* a warm spare (``CLORCH_SPARE`` set; :mod:`clorch_repl.launchers.local`) imports torch and what
  joining a group needs before its kernel starts, and learns its group only when it is made a rank;
* with ``CLORCH_CPU_BIND=numa`` the process binds itself to the CPU cores of its GPU's NUMA node
  (:mod:`clorch_repl.kernel.numa`) before any thread starts, so every thread the kernel runs inherits
  it; what it did or why it could not is written to the rank's log, and nothing there stops it.

After a shutdown request the rank exits through :func:`.quick_exit.exit_now`: threads, atexit
handlers and flushed streams as at any clean exit, without the interpreter's teardown.

The process group itself is joined later, through the kernel (a request, :mod:`.group`), so
that its failures arrive as ordinary tracebacks.

This module keeps its own imports light: it binds the CPUs and (for a spare) imports torch
before ipykernel is imported, which happens when ipykernel loads the classes named in
:data:`KERNEL_OPTIONS` (:mod:`.rank_kernel`, :mod:`.output`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading

from . import numa
from ..common.procs import end_own_group, watch_parent
from ..wire.rank_env import SPARE_ENV
from . import STACK_FILE_ENV

logger = logging.getLogger(__name__)

#: quiet=False: Python-level output is echoed to the process's stdout/stderr, i.e. the rank's log.
#: capture_fd_output=False: native output (NCCL, C++ warnings) goes straight to the log, once.
#: HistoryManager.enabled=False: no SQLite history database per rank; writing it cost a rank
#: about 3 ms per cell here, more than the rest of a cell's round trip. In/Out still work.
#: outstream_class: see clorch_repl.kernel.output; kernel_class: see clorch_repl.kernel.rank_kernel.
#: _execute_sleep=0: ipykernel sleeps 0.5 ms after every cell so that a client reading the shell
#: reply first is less likely to miss late output; the relay drains iopub for a moment after the
#: reply instead.
KERNEL_OPTIONS = ("--IPKernelApp.quiet=False", "--IPKernelApp.capture_fd_output=False",
                  "--HistoryManager.enabled=False",
                  "--IPKernelApp.outstream_class=clorch_repl.kernel.output.RankOutStream",
                  "--IPKernelApp.kernel_class=clorch_repl.kernel.rank_kernel.RankKernel",
                  "--IPythonKernel._execute_sleep=0",
                  # ipykernel's own parent poller would watch the supervisor; ours does.
                  "--IPKernelApp.parent_handle=0")


class _NoShellChannelThread:
    """Stands in for ipykernel's shell channel thread, which a rank does without (see the module
    docstring). Falsy, so that ipykernel takes its path for a kernel without one everywhere it
    asks (``if self.shell_channel_thread``; RankKernel's ``_supports_kernel_subshells``), and
    with ``parent_thread``, which ipykernel 7.4 still reads to run top-level-await cells on the
    main thread with Ctrl-C support, where None would raise AttributeError."""

    def __init__(self) -> None:
        self.parent_thread = threading.main_thread()

    def __bool__(self) -> bool:
        return False


def _app_class() -> type:
    from ipykernel.kernelapp import IPKernelApp

    class RankKernelApp(IPKernelApp):
        """No start-up banner in the rank's log: "To connect another client..." and the note on
        Ctrl-C are ipykernel talking to a terminal user, and the log is the rank's output."""

        def init_sockets(self) -> None:
            super().init_sockets()
            thread = getattr(self, "shell_channel_thread", None)
            if thread is not None:  # made, not started: see the module docstring
                thread.io_loop.close()
                self.shell_channel_thread = _NoShellChannelThread()

        def start(self) -> None:
            # From the loop's first turn on, a request is served at once: say so beside the
            # connection file (a warm spare is taken "ready" by it: clorch_repl.wire.serving)
            from tornado import ioloop

            from ..wire.serving import mark_serving

            ioloop.IOLoop.current().add_callback(mark_serving, self.abs_connection_file)
            super().start()

        def log_connection_info(self) -> None:
            self.log.debug("connection file: %s", self.connection_file)
            self._ports = dict(shell=self.shell_port, iopub=self.iopub_port, stdin=self.stdin_port,
                               hb=self.hb_port, control=self.control_port)

    return RankKernelApp


def warm_imports() -> None:
    """What a warm spare does before its kernel starts: import what joining a group imports
    (torch, torch.distributed, clorch's rendezvous and recorder), so that a restart does not wait
    for it. It touches no GPU: CUDA is initialised when the spare joins a group as a rank (a
    spare may set up the driver before, :func:`_warm_cuda_driver`). The zygote runs this too
    (:mod:`clorch_repl.host.zygote`), so nothing here may initialise CUDA: torch marks every
    process forked after that a bad fork, and each rank's first CUDA call would fail."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from .. import distributed
    from ..distributed import rendezvous  # noqa: F401
    from ..diagnosis import record  # noqa: F401
    from . import group, probes, requests  # noqa: F401


def _warm_cuda_driver() -> None:
    """In a spare that will be a GPU rank (unless ``CLORCH_SPARE_CUDA=0``, common.env_vars.SPARE_CUDA):
    the CUDA driver's own set-up now (``cuInit``, through ``torch.cuda.init``), not when the spare
    joins. ``cuInit`` creates no context and allocates nothing on a GPU, so the spare holds no GPU
    memory and the old rank's stays its own until it exits (it does open the GPU's device files).
    Measured on an H100 (docs/PERFORMANCE.md, "evening session"): 0.20 s ahead, and the join
    0.42-0.46 s against 0.50-0.66 s without, every restart 0.46-0.67 s against 0.58-0.90 s; with it
    on, ``tests/gpu/test_gpu_spares.py`` counts the processes holding a CUDA context (the ranks
    alone). A driver that fails here is only logged: the join sets CUDA up again and fails there,
    as a cold rank would, with the error in its cell. Called by the spare itself (:func:`main`),
    never by :func:`warm_imports`, which the ranks' zygote runs before it forks them: CUDA
    initialised there would make every forked rank a bad fork."""
    from ..common import env_vars
    from ..wire.rank_env import device_index

    if env_vars.SPARE_CUDA.get() == "0" or device_index(os.environ) is None:
        return  # turned off, or a CPU rank's spare
    import torch

    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - the join meets it again and reports it in the rank's cell
        logger.warning("clorch_repl: warm spare: CUDA's driver set-up ahead failed (%s: %s); the rank "
                       "sets it up when it joins", type(exc).__name__, exc)


def main(argv: list[str] | None = None) -> None:
    numa.bind_rank()  # first: the watchdog thread below and the kernel's threads inherit the binding
    watch_parent(os.getppid(), end_own_group)  # the supervisor; see the module's docstring
    if os.environ.pop(SPARE_ENV, ""):
        warm_imports()
        _warm_cuda_driver()  # here, never in warm_imports: the zygote runs that, and forks every rank
    # A segfault or abort prints the Python stacks into the rank's log (fd 2), whose tail the
    # notebook shows when a rank dies mid-cell.
    faulthandler.enable(file=sys.__stderr__, all_threads=False)  # the crashing thread: short
    stack_path = os.environ.get(STACK_FILE_ENV)
    if stack_path:
        stack_file = open(stack_path, "a", buffering=1)  # noqa: SIM115 - must outlive main()
        # The main thread only (Linux hands a process-directed signal to the main thread unless it
        # cannot take it right then; rankfiles.main_thread_stack drops such a dump): walking every
        # thread from a signal handler reads other threads' frames without the GIL and crashed a
        # rank (SIGSEGV) when one of them changed under it (seen in CI: a rank stuck in a gloo
        # barrier, probed by `%clorch why`). The other threads' stacks come from the probe, which
        # reads them under the GIL.
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False, chain=False)

    args = list(sys.argv[1:] if argv is None else argv)
    _app_class().launch_instance(argv=[*args, *KERNEL_OPTIONS])
    # The loop ended on a shutdown request (%clorch stop, a healthy group's restart): exit as cleanly
    # as ever, without the interpreter's teardown that nobody waits for on purpose (.quick_exit).
    from .quick_exit import exit_now

    exit_now()
    # Only where the quick exit is not possible: the ordinary exit runs torch's destructors, and
    # ProcessGroupNCCL's warns unless the group was destroyed first.
    from .group import leave_group

    leave_group()


if __name__ == "__main__":
    main()
