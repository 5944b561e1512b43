"""What a rank's log gets of what its cells display: ``%clorch logs`` holds everything the rank
wrote, and a cell's ``df.head()`` or ``display(x)`` is written too (streams are echoed where they
are written, :mod:`.output`). :func:`display_log_text` decides (pure); :func:`log_displays` hooks
it into a rank kernel's session, where every iopub message passes.

The same place notes each widget view a cell displays, for the cell's end: the log gets a widget's
text as it reads then (:func:`log_widget_states`), and so does a front end without a widget
manager (:func:`publish_widget_views`).
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
#: model id -> (the msg_id of the request whose output showed its view, the view's text/plain
#: then), for the views shown since the last cell ended (see :func:`publish_widget_views`)
_views: dict[str, tuple[str | None, str | None]] = {}
#: The MIME types of clorch_repl's own messages from a rank to the notebook (a value of
#: ``%clorch pull``, a ``--profile`` summary): taken out of the output, so kept out of the log too.
PRIVATE_MIME_PREFIX = "application/x-clorch-"


def display_log_text(msg_type: str, content: dict[str, Any] | None,
                     request: str | None = None) -> str | None:
    """What the rank's log gets for an iopub message: a display's or a result's ``text/plain``
    (a line ending it), ``<image/png output>`` for one without text; None for anything else
    (streams are echoed where they are written; display updates and widget traffic are not
    output a log reader scrolls for). Why: the README says ``%clorch logs`` holds everything the
    rank wrote, and a cell's ``df.head()`` or ``display(x)`` is written too. A widget view is
    noted too, with ``request`` (the msg_id of the request the message belongs to), for the
    cell's end (:func:`log_widget_states`, :func:`publish_widget_views`)."""
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
        shown = data.get("text/plain")
        _views.setdefault(view["model_id"], (request, shown if isinstance(shown, str) else None))
    return text if text.endswith("\n") else text + "\n"


def _live_widgets() -> dict[str, Any] | None:
    """ipywidgets' table of the widgets alive in this process (model id -> widget); None where
    ipywidgets is not imported or keeps no such table."""
    try:
        from ipywidgets import widgets as _module
    except ImportError:
        return None
    live = getattr(getattr(_module, "widget", None), "_instances", None)
    return live if isinstance(live, dict) else None


def publish_widget_views(shell: Any | None = None) -> int:
    """At a cell's end: for each widget view the cell displayed whose ``text/plain`` changed
    since (a finished tqdm.auto bar: ``100%|##########| 20/20``), an ``update_display_data``
    carrying the view and the widget's text now; returns how many were published.

    Why: a widget's updates are comm messages, which only a front end with a widget manager
    renders; one without (nbclient, ``clorch-notebook``, a terminal) kept the text of the first
    display, a finished bar at 0 %. The update keeps the widget view in the bundle, so JupyterLab
    goes on rendering the live widget. The rank's view was displayed without a display id: the
    notebook kernel routes the update by the view's model id into the slot where it put that view
    (:meth:`clorch_repl.notebook.widget_views.WidgetViews.update`); the display id
    here only makes the message a valid update. A widget closed meanwhile (``tqdm(leave=False)``) is
    skipped: a view of a closed model cannot render. Views shown for other requests (a thread's
    display between cells) are forgotten: their cells' displays are gone."""
    shown = {model_id: _views.pop(model_id, (None, None)) for model_id in list(_views)}
    if not shown:
        return 0
    live = _live_widgets()
    if shell is None:
        from .shell import current_shell

        shell = current_shell()
    if live is None or shell is None:
        return 0
    request = (getattr(shell.display_pub, "parent_header", None) or {}).get("msg_id")
    published = 0
    for model_id, (shown_for, text) in shown.items():
        widget = live.get(model_id)
        if widget is None or shown_for != request:
            continue
        try:
            data, _ = shell.display_formatter.format(widget)  # what display(widget) would show now
            view, now = data.get(WIDGET_VIEW), data.get("text/plain")
            if not isinstance(view, dict) or not isinstance(now, str) or now == text:
                continue
            shell.display_pub.publish({WIDGET_VIEW: view, "text/plain": now}, metadata={},
                                      transient={"display_id": f"clorch-widget-{model_id}"}, update=True)
            published += 1
        except Exception as exc:  # noqa: BLE001 - a widget's own repr failing must not fail the cell's end
            logger.debug("no final view of widget %s: %s", model_id, exc)
    return published


def log_widget_states() -> None:
    """At a cell's end: each widget shown whose text changed since the log got it, as it reads
    now. Why: a widget's updates are comm messages, not output; the log had only the text of its
    first display, so ``%clorch logs`` showed a finished tqdm bar at 0 % (its text is tqdm's own
    meter, ``100%|##########| 20/20``). A widget that is gone is forgotten."""
    if not _widgets:
        return
    live = _live_widgets()
    if live is None:
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
                                        or msg_or_type.get("msg_type", ""), msg_or_type.get("content"),
                                        _request_id(msg_or_type.get("parent_header")))
            else:
                text = display_log_text(str(msg_or_type), content, _request_id(parent))
            if text is not None:
                try:
                    sys.__stdout__.write(text)
                    sys.__stdout__.flush()
                except (OSError, ValueError, AttributeError) as exc:  # no log to write to
                    logger.debug("could not write a display to the rank's log: %s", exc)
        return send(stream, msg_or_type, content, parent, *args, **kwargs)

    kernel.session.send = logged


def _request_id(parent: Any) -> str | None:
    """The msg_id of the request a message answers, from its parent (a whole message or a
    header, as Session.send takes either); None without one."""
    if not isinstance(parent, dict):
        return None
    header = parent.get("header") if isinstance(parent.get("header"), dict) else parent
    msg_id = header.get("msg_id")
    return msg_id if isinstance(msg_id, str) else None
