"""What a rank's log gets of what its cells display: ``%clorch logs`` holds everything the rank
wrote, and a cell's ``df.head()`` or ``display(x)`` is written too (streams are echoed where they
are written, :mod:`.output`). :func:`display_log_text` decides (pure); :func:`log_displays` hooks
it into a rank kernel's session, where every iopub message passes.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

#: The messages whose text ``%clorch logs`` shows besides the streams: what the cell displayed.
LOGGED_DISPLAYS = ("display_data", "execute_result")
#: A widget's view in a display (a tqdm.auto bar, a slider): its model id names the widget.
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
#: model id -> the text the log last got for that widget (see :func:`log_widget_states`)
_widgets: dict[str, str] = {}
#: The MIME types of clorch_repl's own messages from a rank to the notebook (a value of
#: ``%clorch pull``, a ``--profile`` summary): taken out of the output, so kept out of the log too.
PRIVATE_MIME_PREFIX = "application/x-clorch-"


def display_log_text(msg_type: str, content: dict[str, Any] | None) -> str | None:
    """What the rank's log gets for an iopub message: a display's or a result's ``text/plain``
    (a line ending it), ``<image/png output>`` for one without text; None for anything else
    (streams are echoed where they are written; display updates and widget traffic are not
    output a log reader scrolls for). Why: the README says ``%clorch logs`` holds everything the
    rank wrote, and a cell's ``df.head()`` or ``display(x)`` is written too."""
    if msg_type not in LOGGED_DISPLAYS or not isinstance(content, dict):
        return None
    data = content.get("data") or {}
    if data and all(mime.startswith(PRIVATE_MIME_PREFIX) for mime in data):
        return None  # clorch_repl's own announcements (a pulled value, a profile summary): never shown
    text = data.get("text/plain")
    if not isinstance(text, str):
        text = f"<{', '.join(sorted(data)) or 'empty'} output>"
    view = data.get(WIDGET_VIEW)
    if isinstance(view, dict) and isinstance(view.get("model_id"), str):
        _widgets[view["model_id"]] = text  # its later state is logged at the cell's end
    return text if text.endswith("\n") else text + "\n"


def log_widget_states() -> None:
    """At a cell's end: each widget shown whose text changed since the log got it, as it reads
    now. Why: a widget's updates are comm messages, not output; the log had only the text of its
    first display, so ``%clorch logs`` showed a finished tqdm bar at 0 % (its text is tqdm's own
    meter, ``100%|##########| 20/20``). A widget that is gone is forgotten."""
    if not _widgets:
        return
    try:
        from ipywidgets import widgets as _module
    except ImportError:
        return
    live = getattr(getattr(_module, "widget", None), "_instances", None)
    if not isinstance(live, dict):
        return
    for model_id, logged in list(_widgets.items()):
        widget = live.get(model_id)
        if widget is None:
            del _widgets[model_id]
            continue
        try:
            text = repr(widget)
        except Exception as exc:  # noqa: BLE001 - a widget's own repr failing must not fail the cell's end
            logger.debug("no text of widget %s: %s", model_id, exc)
            continue
        if text != logged:
            _widgets[model_id] = text
            try:
                sys.__stdout__.write(text if text.endswith("\n") else text + "\n")
                sys.__stdout__.flush()
            except (OSError, ValueError, AttributeError) as exc:  # no log to write to
                logger.debug("could not write a widget's state to the rank's log: %s", exc)


def log_displays(kernel: Any) -> None:
    """Echo what the rank displays (display_data, execute_result) into its log as text,
    at the place every iopub message passes (see :func:`display_log_text`); sent from
    this process only (a forked child's go through its pipe, as its prints do)."""
    send = kernel.session.send
    own = os.getpid()

    def logged(stream, msg_or_type, content=None, parent=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.getpid() == own and (stream is kernel.iopub_socket or stream is kernel.iopub_thread):
            if isinstance(msg_or_type, dict):
                text = display_log_text((msg_or_type.get("header") or {}).get("msg_type")
                                        or msg_or_type.get("msg_type", ""), msg_or_type.get("content"))
            else:
                text = display_log_text(str(msg_or_type), content)
            if text is not None:
                try:
                    sys.__stdout__.write(text)
                    sys.__stdout__.flush()
                except (OSError, ValueError, AttributeError) as exc:  # no log to write to
                    logger.debug("could not write a display to the rank's log: %s", exc)
        return send(stream, msg_or_type, content, parent, *args, **kwargs)

    kernel.session.send = logged
