"""Rank widgets' current state, kept in the notebook kernel, so that a page reload (or a second tab)
shows them again: the front end asks the kernel for every widget's state, and the notebook kernel
answers for the ranks' widgets too.

Why: JupyterLab's widget manager, on connecting to a kernel (a reload, a second tab), opens a comm
on the ``jupyter.widget.control`` target and sends ``request_states``; ipywidgets answers with the
widgets of its own process (``update_states``), and the manager builds a model for each, then
draws the views the notebook's outputs name. A rank's widget lives in the rank's process: the
notebook kernel's ipywidgets knew nothing of it, so after a reload every rank's bar and slider read
"Error displaying widget: model not found" (jupyter-distributed restores its per-rank widgets on
reconnect). Every rank comm passes through :class:`~.comms.CommBridge`, which tells
:class:`WidgetStates` what it forwards: a widget's open (its whole state), its updates from the
rank and from the front end (``update``/``echo_update``), its close. The answer to
``request_states`` is then the notebook's own widgets (ipywidgets' answer: the ``%clorch top``
panel) and every live rank widget, in ipywidgets' own message format; the models the front end
then makes talk to the ranks through the bridge's proxies, as before the reload.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "jupyter.widget"
CONTROL_TARGET = "jupyter.widget.control"
#: every bridge's states (one per session; a restart makes a new one), answered for together
_live: list[WidgetStates] = []


class WidgetStates:
    """The state of every rank widget a bridge forwards, by comm id (= the widget's model id)."""

    def __init__(self) -> None:
        self.models: dict[str, dict[str, Any]] = {}

    def opened(self, comm_id: str, content: dict[str, Any], buffers: list[Any] | None) -> None:
        data = content.get("data") or {}
        if content.get("target_name") != TARGET or not isinstance(data.get("state"), dict):
            return
        state = dict(data["state"])
        _put_buffers(state, data.get("buffer_paths") or [], buffers or [])
        self.models[comm_id] = state

    def updated(self, comm_id: str, data: dict[str, Any], buffers: list[Any] | None) -> None:
        state = self.models.get(comm_id)
        if state is None or data.get("method") not in ("update", "echo_update") or not isinstance(data.get("state"), dict):
            return
        change = dict(data["state"])
        _put_buffers(change, data.get("buffer_paths") or [], buffers or [])
        state.update(change)

    def closed(self, comm_id: str) -> None:
        self.models.pop(comm_id, None)

    def full_state(self) -> dict[str, dict[str, Any]]:
        """ipywidgets' ``update_states`` entries, buffers still in place."""
        return {comm_id: {"model_name": state.get("_model_name"), "model_module": state.get("_model_module"),
                          "model_module_version": state.get("_model_module_version"), "state": dict(state)}
                for comm_id, state in self.models.items()}


def register(states: WidgetStates) -> None:
    """A bridge's states join the answer, and the control target is the notebook kernel's own."""
    _live.append(states)
    try:
        import comm
    except ImportError:
        return
    try:
        import ipywidgets  # noqa: F401 - imported first: its own registration of the target comes before ours
    except ImportError:
        logger.debug("no ipywidgets in the notebook kernel: rank widgets' states answered alone")
    comm.get_comm_manager().register_target(CONTROL_TARGET, _control_opened)


def unregister(states: WidgetStates) -> None:
    if states in _live:
        _live.remove(states)


def _control_opened(comm: Any, msg: dict[str, Any]) -> None:
    """The front end opened the control comm: ipywidgets answers for the notebook's own widgets
    (where it is installed), and its answer gets the ranks' widgets added on its way out."""
    try:
        from ipywidgets import Widget
    except ImportError:
        Widget = None
    send = comm.send

    def send_with_ranks(data: Any = None, metadata: Any = None, buffers: Any = None) -> Any:
        if isinstance(data, dict) and data.get("method") == "update_states":
            data, buffers = _merged(data, list(buffers or []))
        return send(data, metadata, buffers)

    comm.send = send_with_ranks
    if Widget is not None:
        Widget.handle_control_comm_opened(comm, msg)
        return

    def answer(message: dict[str, Any]) -> None:
        if ((message.get("content") or {}).get("data") or {}).get("method") == "request_states":
            comm.send({"method": "update_states", "states": {}, "buffer_paths": []})
    comm.on_msg(answer)


def _merged(data: dict[str, Any], buffers: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    states = dict(data.get("states") or {})
    paths = list(data.get("buffer_paths") or [])
    for live in _live:
        for model_id, entry in live.full_state().items():
            if model_id in states:
                continue
            found: list[tuple[list[Any], Any]] = []
            entry["state"] = _take_buffers(entry["state"], [], found)
            states[model_id] = entry
            for path, buffer in found:
                paths.append([model_id, "state", *path])
                buffers.append(buffer)
    logger.debug("widget states for a front end: %d models", len(states))
    return dict(data, states=states, buffer_paths=paths), buffers


def _put_buffers(state: dict[str, Any], paths: list[list[Any]], buffers: list[Any]) -> None:
    """ipywidgets' _put_buffers: each binary buffer back at its place in the state."""
    for path, buffer in zip(paths, buffers):
        obj: Any = state
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = buffer


def _take_buffers(value: Any, path: list[Any], found: list[tuple[list[Any], Any]]) -> Any:
    """A copy of ``value`` without its binary buffers, each noted with its path (ipywidgets'
    _remove_buffers)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        found.append((path, value))
        return None
    if isinstance(value, dict):
        return {k: _take_buffers(v, [*path, k], found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_take_buffers(v, [*path, i], found) for i, v in enumerate(value)]
    return value
