"""What the rank's kernel adds for hang diagnosis: one control message, "where are you" (and,
for hang recovery, "abort your groups": :func:`clorch_repl.kernel.regroup.abort`).

ipykernel serves its control channel on a thread of its own, so a handler registered there runs
while the main thread is blocked in a cell (a collective waiting for another rank, a long native
call that released the GIL). That is what lets the notebook explain a hang live, over the rank's
own signed channel, without interrupting anything.

The handler is registered on the running kernel (:func:`install`, called when the rank joins its
process group, :mod:`.group`) rather than in the kernel class (:mod:`.rank_kernel`): ipykernel
looks control handlers up per message in ``control_handlers``, so adding one there is all a
subclass would do, and a kernel answers probes only once it is a rank of a group.
"""

from __future__ import annotations

import logging
from typing import Any

from ..diagnosis.probe import answer
from ..wire.probe import PROBE_REPLY, PROBE_REQUEST, ProbeRequest

logger = logging.getLogger(__name__)


def probe_request(kernel: Any, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
    """Answer ``clorch_probe_request`` (on the control thread) with :func:`answer`'s dict."""
    request = ProbeRequest.read(parent.get("content"))
    try:
        if request.abort:  # hang recovery: free every call waiting in a group (kernel.regroup)
            from .regroup import abort

            content = {"aborted": abort()}
        else:
            content = answer(request)
    except Exception as exc:  # noqa: BLE001 - the notebook must get an answer, with the cause
        logger.exception("clorch probe failed")
        content = {"error": f"{type(exc).__name__}: {exc}"}
    kernel.session.send(stream, PROBE_REPLY, content, parent, ident)


def install(kernel: Any) -> bool:
    """Make ``kernel`` (an ipykernel Kernel) answer probes; False when it has no control handlers."""
    handlers = getattr(kernel, "control_handlers", None)
    if not isinstance(handlers, dict):
        logger.warning("this kernel has no control handlers; hang diagnosis falls back to stacks")
        return False
    handlers[PROBE_REQUEST] = lambda stream, ident, parent: probe_request(kernel, stream, ident, parent)
    return True
