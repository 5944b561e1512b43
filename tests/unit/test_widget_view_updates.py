"""A rank's widget view brought up to date at its cell's end, for front ends without a widget
manager (nbclient, ``clorch-notebook``): the rank's half (which views it updates, with what) on a
stand-in shell, the notebook's half (where the update goes) on IPython's real shell with its
output captured. tests/integration/test_widgets.py runs both with real ranks and nbclient."""

from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl.kernel import display_log
from clorch_repl.kernel.display_log import display_log_text, publish_widget_views
from clorch_repl.notebook.display import NotebookDisplay
from clorch_repl.session.protocol import RankOutput

VIEW = "application/vnd.jupyter.widget-view+json"


# ------------------------------------------------------------------------------ the rank's half
class _Publisher:
    def __init__(self, request: str) -> None:
        self.parent_header = {"msg_id": request}
        self.published: list[dict[str, Any]] = []

    def publish(self, data: dict[str, Any], metadata: dict[str, Any] | None = None,
                transient: dict[str, Any] | None = None, update: bool = False) -> None:
        self.published.append({"data": data, "transient": transient, "update": update})


class _Formatter:
    def format(self, widget: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"text/plain": widget.text, VIEW: {"model_id": widget.model_id, "version_major": 2}}, {}


class _Shell:
    def __init__(self, request: str) -> None:
        self.display_pub = _Publisher(request)
        self.display_formatter = _Formatter()


class _Widget:
    def __init__(self, model_id: str, text: str) -> None:
        self.model_id, self.text = model_id, text


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Widget]:
    """The process's live widgets, as ipywidgets keeps them; the module's notes start empty."""
    widgets: dict[str, _Widget] = {}
    monkeypatch.setattr(display_log, "_live_widgets", lambda: widgets)
    monkeypatch.setattr(display_log, "_views", {})
    monkeypatch.setattr(display_log, "_widgets", {})
    return widgets


def shown_view(model_id: str, text: str, request: str) -> None:
    """What the rank's session hook sees when the cell displays the widget."""
    display_log_text("display_data", {"data": {"text/plain": text, VIEW: {"model_id": model_id}}}, request)


def test_a_view_whose_text_changed_is_updated_with_its_view_and_new_text(live: dict[str, _Widget]) -> None:
    live["bar"] = _Widget("bar", "steps:   0%|          | 0/20")
    live["slider"] = _Widget("slider", "IntSlider(value=3)")
    shown_view("bar", "steps:   0%|          | 0/20", "cell-1")
    shown_view("slider", "IntSlider(value=3)", "cell-1")
    live["bar"].text = "steps: 100%|##########| 20/20"
    shell = _Shell("cell-1")
    assert publish_widget_views(shell) == 1
    (update,) = shell.display_pub.published
    assert update["update"] is True and update["transient"]["display_id"]  # a valid update_display_data
    assert update["data"] == {"text/plain": "steps: 100%|##########| 20/20",
                              VIEW: {"model_id": "bar", "version_major": 2}}  # the live widget stays
    assert publish_widget_views(shell) == 0  # said once: the next cell's end has nothing to say


def test_closed_widgets_and_views_of_other_requests_are_left_alone(live: dict[str, _Widget]) -> None:
    live["late"] = _Widget("late", "IntText(value=0)")
    shown_view("gone", "bar 0%", "cell-1")  # tqdm(leave=False): closed, no longer live
    shown_view("late", "IntText(value=0)", "cell-0")  # a thread's display, under an earlier cell
    live["late"].text = "IntText(value=100)"
    shell = _Shell("cell-1")
    assert publish_widget_views(shell) == 0
    assert shell.display_pub.published == [] and display_log._views == {}


# --------------------------------------------------------------------------- the notebook's half
@pytest.fixture
def ip_shell(ip: Any) -> Any:
    """publish_display_data needs the shell instance the ip fixture creates."""
    return ip


def bar(rank: int, text: str) -> RankOutput:
    return RankOutput(rank, "display_data", {"data": {VIEW: {"model_id": f"m{rank}", "version_major": 2},
                                                      "text/plain": text}, "metadata": {}})


def final(rank: int, text: str, model_id: str | None = None) -> RankOutput:
    """The rank's update at the cell's end (display_log.publish_widget_views)."""
    model_id = model_id or f"m{rank}"
    return RankOutput(rank, "update_display_data", {
        "data": {VIEW: {"model_id": model_id, "version_major": 2}, "text/plain": text},
        "metadata": {}, "transient": {"display_id": f"clorch-widget-{model_id}"}})


def applied(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cell's outputs with each update applied in place, as nbclient and JupyterLab do."""
    shown: list[dict[str, Any]] = []
    for o in outputs:
        display_id = (o.get("transient") or {}).get("display_id")
        if o.get("update"):
            shown = [dict(o, update=False) if (s.get("transient") or {}).get("display_id") == display_id else s
                     for s in shown]
        elif not str(display_id or "").startswith("clorch-held-"):
            shown.append(o)
    return shown


def run(ranks: tuple[int, ...], items: list[RankOutput]) -> list[dict[str, Any]]:
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=ranks)
        for item in items:
            sink.output(item)
        sink.flush(final=True)
    return applied(cap._outputs)


def test_the_final_text_fills_the_ranks_slot_and_keeps_the_view(ip_shell: Any) -> None:
    shown = run((0, 1), [bar(1, "b 0%"), bar(0, "b 0%"), final(1, "b 100%"), final(0, "b 100%")])
    views = [(o["data"]["text/plain"], o["data"][VIEW]["model_id"]) for o in shown if VIEW in o["data"]]
    assert views == [("[rank 0] b 100%", "m0"), ("[rank 1] b 100%", "m1")]  # in rank order, finished
    assert [o["data"]["text/plain"] for o in shown if VIEW not in o["data"]] == ["[rank 0]", "[rank 1]"]


def test_one_ranks_view_is_updated_in_place_too(ip_shell: Any) -> None:
    shown = run((1,), [bar(1, "b 0%"), final(1, "b 100%")])
    assert [o["data"]["text/plain"] for o in shown] == ["[rank 1] b 100%"]
    assert shown[0]["data"][VIEW]["model_id"] == "m1"


def test_an_update_of_a_view_this_cell_did_not_show_changes_nothing_shown(ip_shell: Any) -> None:
    shown = run((0, 1), [bar(0, "b 0%"), final(1, "other 100%", model_id="m9"), final(1, "b 100%", model_id="m0")])
    # (rank 1's update of rank 0's model id: not a view rank 1 showed, so not rank 0's to change)
    assert [o["data"]["text/plain"] for o in shown] == ["[rank 0]", "[rank 0] b 0%", "", ""]
