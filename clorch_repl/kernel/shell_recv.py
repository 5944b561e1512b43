"""How a rank's kernel takes each shell request off its socket: one asyncio task a request,
started at once where Python can.

ipykernel (7.x, without its shell channel thread, as a rank runs: :mod:`.app`) hands each request
to ``shell_main`` through ``_async_in_context``: a coroutine that creates a second task, in the
kernel's persistent context, and awaits it. Two tasks a request, each its own turn of the event
loop and its own done callback, for one request's work. Here the one task is created directly in
that same persistent context (``asyncio``'s ``create_task(context=...)`` runs the coroutine in
the context given, not a copy, as ``_async_in_context`` does), so what a request sets in it (the
shell parent, ipykernel's context variables) is seen by the next request exactly as before.
ZMQStream takes the task as the callback's awaitable and logs its failure as it did the outer
coroutine's.

On Python 3.12 and later the task is an *eager* one (``asyncio.eager_task_factory``): its first
step runs inside the callback that read the request, so a cell that never waits (almost every
cell: ipykernel runs a cell without top-level ``await`` straight through) is over, replied to,
before the loop turns again, and a request that finished so is not handed back to ZMQStream at
all (no done callback, no extra turn). A step that waits (a top-level ``await`` cell, a request
queued behind a running async cell's lock) leaves a pending task the loop goes on with, exactly
as a lazily started one would; inside the step ``asyncio.current_task()`` is that task, as
before. Python 3.11 has no eager tasks: its ranks start each task on the loop's next turn.
Measured: ``docs/PERFORMANCE.md``.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import copy_context
from functools import partial
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: Python 3.12's factory of tasks whose first step runs at once; None before 3.12
EAGER_TASKS: Callable[..., asyncio.Task] | None = getattr(asyncio, "eager_task_factory", None)


def one_task_per_request(kernel: Any, eager: bool = EAGER_TASKS is not None) -> bool:
    """Replace the kernel's shell-stream callback (set by ipykernel's ``Kernel.start``) with one
    that runs ``shell_main`` as a single task (an eager one where ``eager`` and Python has them);
    False (and nothing changed) for a kernel that reads its shell socket on ipykernel's shell
    channel thread, has no shell stream, or whose callback is not the one described in the
    module's docstring (another ipykernel 7.x may set up its shell otherwise: its own path then
    stays, two tasks a request, as before). Applied again, it replaces its own callback (which
    wraps the same ``shell_main`` as ipykernel's), so ``benchmarks/eager_requests.py`` can turn
    the eager start off and on in a running rank."""
    stream = getattr(kernel, "shell_stream", None)
    if not stream or kernel.shell_channel_thread:
        return False
    if not _ipykernels_callback(kernel, getattr(stream, "_recv_callback", None)):
        logger.debug("the shell stream's callback is not ipykernel 7's: each request keeps its two tasks")
        return False
    context = copy_context()
    shell_main = partial(kernel.shell_main, None)

    if eager and EAGER_TASKS is not None:
        start = EAGER_TASKS

        def on_recv(msg: list[Any]) -> asyncio.Task | None:
            task = start(asyncio.get_running_loop(), shell_main(msg), context=context)
            if task.done() and not task.cancelled() and task.exception() is None:
                return None  # over and fine: nothing for ZMQStream to wait for or log
            return task
    else:
        def on_recv(msg: list[Any]) -> asyncio.Task | None:
            return asyncio.get_running_loop().create_task(shell_main(msg), context=context)

    on_recv.__wrapped__ = shell_main  # type: ignore[attr-defined]  # what ipykernel's wraps (see _ipykernels_callback)
    stream.on_recv(on_recv, copy=False)
    return True


def _ipykernels_callback(kernel: Any, callback: Any) -> bool:
    """Whether ``callback`` is what ipykernel 7's ``Kernel.start`` installs without a shell channel
    thread: ``_async_in_context(partial(self.shell_main, None))`` (``functools.wraps`` keeps the
    partial as ``__wrapped__``), or this module's own callback in its place."""
    inner = getattr(callback, "__wrapped__", None)
    return isinstance(inner, partial) and inner.func == kernel.shell_main and inner.args == (None,)
