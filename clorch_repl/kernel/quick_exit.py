"""A rank's clean exit without the interpreter's teardown.

Why: ``%clorch stop`` and a restart of a healthy group end a rank with a shutdown request, so
that what the user relies on at exit happens: their atexit handlers run, their threads finish,
and the objects of their namespace are released (IPython's own atexit handler clears it), which
flushes and closes the files they left open. Measured on the 2-core CPU box (issue 39), that
part took 0.1-0.2 s after the request; the interpreter's teardown after it (every module's
globals released one by one, torch's C++ destructors) took another 0.35-0.45 s that nobody waits
for on purpose, and on GPUs it is where a healthy restart lost most of a second against a restart
after a death. The process's memory, GPU memory included (the driver frees a CUDA context when
its process exits), and its descriptors go back to the system at exit either way.

So once the kernel's loop has ended, :func:`exit_now` does what ``Py_FinalizeEx`` does first, in
its order (wait for the non-daemon threads, run the atexit handlers, flush the standard streams
the rank's log is written through) and then ends the process with ``os._exit``. What is skipped
is what CPython does not promise to run at exit anyway: ``__del__`` of objects still reachable
from modules.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)


def exit_now(status: int = 0) -> None:
    """End the process as a clean exit would, without tearing the interpreter down; never returns.

    Where ``threading._shutdown`` (how CPython waits for non-daemon threads at exit) is missing,
    an interpreter that changed it, this returns and the caller exits the ordinary way."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:
        logger.debug("threading._shutdown is missing: the rank exits the ordinary way")
        return
    shutdown()  # the non-daemon threads first, as at any exit: atexit handlers may rely on them being done
    atexit._run_exitfuncs()  # noqa: SLF001 - the interpreter's own list, run once and in its order
    # The rank's log: the kernel's streams echo to these as they are written (their IOPub side has
    # nobody to read it any more).
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError) as exc:  # closed, or its descriptor is gone: nothing left to write to
            logger.debug("flushing %s at exit failed: %s", stream, exc)
    os._exit(status)
