"""How a rank's kernel takes each shell request off its socket: one asyncio task a request.

ipykernel (7.x, without its shell channel thread, as a rank runs: :mod:`.app`) hands each request
to ``shell_main`` through ``_async_in_context``: a coroutine that creates a second task, in the
kernel's persistent context, and awaits it. Two tasks a request, each its own turn of the event
loop and its own done callback, for one request's work. Here the one task is created directly in
that same persistent context (``asyncio``'s ``create_task(context=...)`` runs the coroutine in
the context given, not a copy, as ``_async_in_context`` does), so what a request sets in it (the
shell parent, ipykernel's context variables) is seen by the next request exactly as before.
ZMQStream takes the task as the callback's awaitable and logs its failure as it did the outer
coroutine's.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import copy_context
from functools import partial
from typing import Any

logger = logging.getLogger(__name__)


def one_task_per_request(kernel: Any) -> bool:
    """Replace the kernel's shell-stream callback (set by ipykernel's ``Kernel.start``) with one
    that runs ``shell_main`` as a single task; False (and nothing changed) for a kernel that
    reads its shell socket on ipykernel's shell channel thread, has no shell stream, or whose
    callback is not the one described in the module's docstring (another ipykernel 7.x may set
    up its shell otherwise: its own path then stays, two tasks a request, as before)."""
    stream = getattr(kernel, "shell_stream", None)
    if not stream or kernel.shell_channel_thread:
        return False
    if not _ipykernels_callback(kernel, getattr(stream, "_recv_callback", None)):
        logger.debug("the shell stream's callback is not ipykernel 7's: each request keeps its two tasks")
        return False
    context = copy_context()
    shell_main = partial(kernel.shell_main, None)

    def on_recv(msg: list[Any]) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(shell_main(msg), context=context)

    stream.on_recv(on_recv, copy=False)
    return True


def _ipykernels_callback(kernel: Any, callback: Any) -> bool:
    """Whether ``callback`` is what ipykernel 7's ``Kernel.start`` installs without a shell channel
    thread: ``_async_in_context(partial(self.shell_main, None))`` (``functools.wraps`` keeps the
    partial as ``__wrapped__``)."""
    inner = getattr(callback, "__wrapped__", None)
    return isinstance(inner, partial) and inner.func == kernel.shell_main and inner.args == (None,)
