"""Rank widgets' states kept in the notebook kernel for a front end that reconnects (a reload, a
second tab): what the bridge forwards builds them, and the answer to ipywidgets' request_states
carries them in ipywidgets' format (clorch_repl.notebook.widget_states). The page itself:
tests/browser/test_lab_glance.py."""

from __future__ import annotations

from typing import Any

from clorch_repl.notebook import widget_states
from clorch_repl.notebook.widget_states import WidgetStates


def _open(model: str, **state: Any) -> dict[str, Any]:
    return {"target_name": "jupyter.widget", "data": {"state": {"_model_name": model, "_model_module": "@jupyter-widgets/controls",
                                                                  "_model_module_version": "2.0.0", **state},
                                                        "buffer_paths": []}}


def test_the_state_follows_opens_updates_from_both_sides_and_closes() -> None:
    states = WidgetStates()
    states.opened("a", _open("IntSliderModel", value=10), None)
    states.opened("b", _open("FloatProgressModel", value=0.0), None)
    states.opened("c", {"target_name": "other", "data": {"state": {}}}, None)  # not a widget: not kept
    states.updated("a", {"method": "update", "state": {"value": 16}, "buffer_paths": []}, None)  # the user's
    states.updated("b", {"method": "echo_update", "state": {"value": 40.0}, "buffer_paths": []}, None)  # the rank's
    states.updated("b", {"method": "custom", "content": {}}, None)  # a custom message changes no state
    states.opened("d", _open("ImageModel", value=None, buffer_paths=[]), None)
    states.updated("d", {"method": "update", "state": {"value": None}, "buffer_paths": [["value"]]}, [b"png"])
    states.closed("gone")
    full = states.full_state()
    assert sorted(full) == ["a", "b", "d"]
    assert full["a"]["state"]["value"] == 16 and full["a"]["model_name"] == "IntSliderModel"
    assert full["b"]["state"]["value"] == 40.0 and full["d"]["state"]["value"] == b"png"
    states.closed("b")
    assert sorted(states.full_state()) == ["a", "d"]


def test_the_answer_adds_the_ranks_widgets_to_the_notebooks_own_with_their_buffers() -> None:
    states = WidgetStates()
    states.opened("rank-widget", _open("IntSliderModel", value=51), None)
    states.opened("image", _open("ImageModel", value=None), None)
    states.updated("image", {"method": "update", "state": {"value": None}, "buffer_paths": [["value"]]}, [b"png"])
    widget_states._live.append(states)
    try:
        own = {"method": "update_states", "states": {"panel": {"model_name": "HTMLModel", "state": {"value": "t"}}},
               "buffer_paths": [["panel", "state", "x"]]}
        data, buffers = widget_states._merged(own, [b"own"])
    finally:
        widget_states.unregister(states)
    assert sorted(data["states"]) == ["image", "panel", "rank-widget"]
    assert data["states"]["rank-widget"]["state"]["value"] == 51
    assert data["buffer_paths"] == [["panel", "state", "x"], ["image", "state", "value"]] and buffers == [b"own", b"png"]
    assert data["states"]["image"]["state"]["value"] is None  # the buffer travels apart, as ipywidgets sends it
