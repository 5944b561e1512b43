"""Widgets made on ranks, seen through a real notebook kernel driven by jupyter_client as
JupyterLab drives one: the ranks' comm messages reach the client labelled by rank with distinct
ids, a front end's widget update reaches the rank that owns the widget and no other, tqdm.auto
bars arrive as widget traffic per rank, and the text fallback (what nbclient or a terminal
shows) names each rank. The browser test (tests/browser) checks the rendering in JupyterLab."""

from __future__ import annotations

import re
import time
from queue import Empty
from typing import Any, Iterator

import pytest

from notebook_kernel import NotebookKernel, clorch_session

pytest.importorskip("ipywidgets")
pytest.importorskip("tqdm")

COMM_TYPES = ("comm_open", "comm_msg", "comm_close")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    with clorch_session(stop=False) as kernel:
        yield kernel


def iopub_until_idle(nb: NotebookKernel, msg_id: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Every iopub message the kernel published for request ``msg_id`` up to its idle status
    (comm messages included, which NotebookKernel.collect leaves out)."""
    deadline = time.monotonic() + timeout
    got = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no idle status for {msg_id} within {timeout} s; got {[m['msg_type'] for m in got]}")
        try:
            msg = nb.kc.get_iopub_msg(timeout=left)
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "idle":
                return got
            continue
        got.append(msg)


def run_cell(nb: NotebookKernel, code: str) -> tuple[str, list[dict[str, Any]]]:
    """Run ``code``; returns the execute_reply's status and every iopub message of the cell."""
    msg_id = nb.send(code)
    messages = iopub_until_idle(nb, msg_id)
    reply = nb.kc.get_shell_msg(timeout=10)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = nb.kc.get_shell_msg(timeout=10)
    return reply["content"]["status"], messages


def text_of(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        if m["msg_type"] == "stream":
            parts.append(m["content"]["text"])
        elif m["msg_type"] in ("display_data", "execute_result", "update_display_data"):
            if m["content"]["data"].get("text/plain"):  # (an empty widget slot, filled by an update)
                parts.append(m["content"]["data"]["text/plain"] + "\n")
        elif m["msg_type"] == "error":
            parts.append("\n".join(m["content"]["traceback"]) + "\n")
    return "".join(parts)


def views_by_rank(messages: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Widget views shown, by the rank their label names: {rank: [model_id, ...]} (a view shown
    again in its display, as at the cell's end when its text changed, counts once)."""
    views: dict[int, list[str]] = {}
    for m in messages:
        # (several ranks' views fill slots made in rank order: update_display_data)
        data = m["content"].get("data", {}) if m["msg_type"] in ("display_data", "update_display_data") else {}
        if WIDGET_VIEW in data:
            who = re.match(r"\[rank (\d+)\] ", data.get("text/plain", ""))
            assert who, f"a widget view without a rank label: {data.get('text/plain')!r}"
            shown = views.setdefault(int(who.group(1)), [])
            if data[WIDGET_VIEW]["model_id"] not in shown:
                shown.append(data[WIDGET_VIEW]["model_id"])
    return views


def final_views(messages: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each display id's last widget view, as a front end that applies updates in place ends up
    showing it: {display_id: (text/plain, the widget view)}."""
    last: dict[str, tuple[str, dict[str, Any]]] = {}
    for m in messages:
        if m["msg_type"] not in ("display_data", "update_display_data"):
            continue
        display_id = (m["content"].get("transient") or {}).get("display_id")
        data = m["content"]["data"]
        if display_id and WIDGET_VIEW in data:
            last[display_id] = (data.get("text/plain", ""), data[WIDGET_VIEW])
    return last


def send_comm(nb: NotebookKernel, msg_type: str, content: dict[str, Any]) -> str:
    """What a front end's widget manager sends to the notebook kernel."""
    msg = nb.kc.session.msg(msg_type, content)
    nb.kc.shell_channel.send(msg)
    return msg["header"]["msg_id"]


def test_slider_per_rank_distinct_ids_and_an_update_reaches_its_rank_only(nb: NotebookKernel) -> None:
    status, messages = run_cell(nb, "%%distributed\nimport ipywidgets as w\n"
                                    "s = w.IntSlider(value=10 + rank, description=f'r{rank}')\ndisplay(s)")
    assert status == "ok", text_of(messages)
    opens = {m["content"]["comm_id"]: m["content"] for m in messages if m["msg_type"] == "comm_open"}
    sliders = {cid: c["data"]["state"]["value"] for cid, c in opens.items()
               if c["data"]["state"].get("_model_name") == "IntSliderModel"}
    assert sorted(sliders.values()) == [10, 11], opens  # one slider per rank, distinct comm ids
    views = views_by_rank(messages)
    assert sorted(views) == [0, 1]
    for rank in (0, 1):  # each rank's labelled view shows that rank's own slider
        (model_id,) = views[rank]
        assert sliders[model_id] == 10 + rank
    # every comm message, and the view after its comm_open, came with the cell as parent
    order = [m["msg_type"] for m in messages]
    assert order.index("comm_open") < order.index("display_data")
    assert "[rank 0] IntSlider(value=10" in text_of(messages)  # the text fallback names the rank

    # The front end moves rank 1's slider (ipywidgets' protocol 2 "update"), between cells.
    rank1 = next(cid for cid, v in sliders.items() if v == 11)
    sent = send_comm(nb, "comm_msg", {"comm_id": rank1, "data": {"method": "update", "state": {"value": 42},
                                                                  "buffer_paths": []}})
    answer = iopub_until_idle(nb, sent, timeout=30)
    echoes = [m for m in answer if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == rank1]
    assert echoes and echoes[0]["content"]["data"]["method"] == "echo_update", answer
    assert echoes[0]["content"]["data"]["state"]["value"] == 42

    status, messages = run_cell(nb, "%%distributed\nprint('value', s.value)")
    text = text_of(messages)
    assert status == "ok" and "[rank 0] value 10" in text and "[rank 1] value 42" in text, text


def test_tqdm_auto_bars_are_widgets_per_rank_and_the_cell_ends(nb: NotebookKernel) -> None:
    t0 = time.monotonic()
    status, messages = run_cell(nb, "%%distributed\nimport time\nfrom tqdm.auto import tqdm\n"
                                    "for _ in tqdm(range(20), desc=f'rank{rank}', mininterval=0):\n"
                                    "    time.sleep(0.05)\nprint('trained')")
    took = time.monotonic() - t0
    text = text_of(messages)
    assert status == "ok", text
    assert took < 30, f"the cell took {took:.1f} s"
    views = views_by_rank(messages)
    assert sorted(views) == [0, 1], text  # one bar per rank, under its rank's label
    opens = {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in messages
             if m["msg_type"] == "comm_open"}
    bars = {cid for cid, st in opens.items() if st.get("_model_name") == "FloatProgressModel"}
    assert len(bars) == 2
    # each bar moved to its end through comm_msg updates while the cell ran
    final = {cid: max(m["content"]["data"]["state"]["value"] for m in messages
                      if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == cid
                      and "value" in m["content"]["data"].get("state", {}))
             for cid in bars}
    assert sorted(final.values()) == [20, 20], final
    # every comm of the cell came with the cell's own parent, in order: its open before its messages
    for cid in opens:
        kinds = [m["msg_type"] for m in messages if m["content"].get("comm_id") == cid]
        assert kinds[0] == "comm_open", kinds
    # the text fallback, for front ends without a widget manager: labelled bars, then the merged line
    assert re.search(r"\[rank 0\] rank0: +0%", text) and re.search(r"\[rank 1\] rank1: +0%", text), text
    assert "[ranks 0-1] trained" in text
    # ...and at the cell's end each bar's display is updated to its last text, the view kept in it
    # (issue: a headless run showed the finished bars at 0 %)
    shown = sorted(final_views(messages).values(), key=lambda v: v[0])
    assert [v[1]["model_id"] for v in shown] == [views[0][0], views[1][0]], shown
    for rank, (bar_text, _) in enumerate(shown):
        assert re.match(rf"\[rank {rank}\] rank{rank}: 100%\|.*\| 20/20", bar_text), shown
    # the rank's log ends with the bar's last state, not the 0 % it was displayed at (issue 38)
    logs = nb.run("%clorch logs 1 --tail 5").text
    assert re.search(r"rank1: 100%\|.*\| 20/20", logs), logs


def test_the_kernel_stays_busy_until_a_widget_cell_ends(nb: NotebookKernel) -> None:
    """A control request during the cell (JupyterLab's debugger, Jupyter Server's nudge on a page
    reload) used to publish an idle status: the status bar said Idle while the bars still moved.
    Every status the kernel publishes until the cell's own idle now says busy; the order of the
    ranks' bars is rank order (each fills its slot, made in rank order)."""
    msg_id = nb.send("%%distributed\nimport time\nfrom tqdm.auto import tqdm\n"
                     "for _ in tqdm(range(30), desc=f'rank{rank}', mininterval=0):\n    time.sleep(0.05)")
    time.sleep(0.8)
    control = nb.kc.session.msg("kernel_info_request", {})
    nb.kc.control_channel.send(control)
    states, views = [], []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            msg = nb.kc.get_iopub_msg(timeout=1)
        except Empty:
            continue
        parent = msg["parent_header"].get("msg_id")
        if msg["msg_type"] == "status":
            if parent == msg_id and msg["content"]["execution_state"] == "idle":
                break
            states.append((msg["parent_header"].get("msg_type"), msg["content"]["execution_state"]))
        elif msg["msg_type"] == "update_display_data" and WIDGET_VIEW in msg["content"]["data"]:
            views.append(msg["content"]["data"]["text/plain"].split("]")[0])
    else:
        raise AssertionError("the cell never ended")
    assert ("kernel_info_request", "busy") in states, states  # the control request was answered...
    assert all(state == "busy" for _, state in states), states  # ...without an idle before the cell's end
    # each rank's view, then (at the cell's end, its text changed) the same view with its last text
    assert sorted(views) == ["[rank 0", "[rank 0", "[rank 1", "[rank 1"], views


def test_front_end_close_and_restart_release_the_proxies(nb: NotebookKernel) -> None:
    status, messages = run_cell(nb, "%%distributed\nimport ipywidgets as w\nb = w.Button(description='go')\n"
                                    "display(b)")
    assert status == "ok", text_of(messages)
    buttons = [m["content"]["comm_id"] for m in messages if m["msg_type"] == "comm_open"
               and m["content"]["data"]["state"].get("_model_name") == "ButtonModel"]
    assert len(buttons) == 2
    count = ("import comm\nprint('proxies', sum(c in comm.get_comm_manager().comms for c in %r))")
    assert "proxies 2" in nb.run(count % buttons).text
    # a front end closing rank 0's button: the notebook lets go of it and rank 0's widget is closed
    (rank0,) = views_by_rank(messages)[0]
    assert rank0 in buttons
    sent = send_comm(nb, "comm_close", {"comm_id": rank0, "data": {}})
    iopub_until_idle(nb, sent, timeout=30)
    assert "proxies 1" in nb.run(count % buttons).text
    reply = nb.run("%%distributed\nimport comm\nprint('open', b.model_id in comm.get_comm_manager().comms)")
    assert reply.status == "ok"
    texts = reply.text
    assert ("[rank 0] open False" in texts and "[rank 1] open True" in texts), texts
    assert nb.run("%clorch restart").status == "ok"
    assert "proxies 0" in nb.run(count % buttons).text


def test_a_widget_a_rank_changes_after_its_cell_reaches_the_front_end_while_the_notebook_idles(
        nb: NotebookKernel) -> None:
    """A thread that updates a widget after its cell ended (training on in the background): the
    notebook kernel's event loop forwards the change with no further request from the client."""
    status, messages = run_cell(nb, "%%distributed\nimport threading, time, ipywidgets as w\n"
                                    "late = w.IntText(value=rank)\ndisplay(late)\n"
                                    "threading.Timer(1.0, lambda: setattr(late, 'value', 100 + rank)).start()")
    assert status == "ok", text_of(messages)
    ids = {m["content"]["data"]["state"]["value"]: m["content"]["comm_id"] for m in messages
           if m["msg_type"] == "comm_open" and m["content"]["data"]["state"].get("_model_name") == "IntTextModel"}
    assert sorted(ids) == [0, 1]
    updates: dict[str, int] = {}
    deadline = time.monotonic() + 15
    while len(updates) < 2 and time.monotonic() < deadline:
        try:
            msg = nb.kc.get_iopub_msg(timeout=0.5)
        except Empty:
            continue
        state = msg["content"].get("data", {}).get("state", {}) if msg["msg_type"] == "comm_msg" else {}
        if "value" in state:
            updates[msg["content"]["comm_id"]] = state["value"]
    assert updates == {ids[0]: 100, ids[1]: 101}, updates


def test_a_comm_id_two_ranks_share_is_refused_not_mixed_up(nb: NotebookKernel) -> None:
    status, messages = run_cell(nb, "%%distributed\nimport ipywidgets as w\n"
                                    "dup = w.IntSlider(value=rank, model_id='clorch-test-same-id')\ndisplay(dup)")
    assert status == "ok", text_of(messages)
    opened = [m for m in messages if m["msg_type"] == "comm_open" and m["content"]["comm_id"] == "clorch-test-same-id"]
    assert len(opened) == 1  # the first rank's; the second rank's open is refused
    assert "whose id is already a comm of rank" in text_of(messages)


def test_without_a_widget_manager_the_bars_end_finished_and_the_saved_notebook_has_their_state(
        tmp_path: Any) -> None:
    """nbclient (clorch-notebook, CI) has no widget manager: each rank's bar is its labelled text,
    which the rank brings up to date at the cell's end, so the executed notebook shows the
    finished bars (it showed them at 0 %), still as widget views (JupyterLab renders the widget);
    it also keeps every widget's final state in its metadata."""
    import nbformat
    from nbclient import NotebookClient

    nbk = nbformat.v4.new_notebook()
    nbk.cells = [nbformat.v4.new_code_cell(s) for s in (
        "%load_ext clorch_repl", "%clorch start --nproc 2 --backend gloo",
        "%%distributed\nimport time\nfrom tqdm.auto import tqdm\n"
        "for step in tqdm(range(20), desc=f'rank {rank}'):\n    time.sleep(0.02)\nprint('done')",
        "%clorch stop")]
    NotebookClient(nbk, timeout=180, kernel_name="python3").execute(cwd=str(tmp_path))
    outputs = nbk.cells[2].outputs
    texts = [o.get("text") or o.data.get("text/plain", "") for o in outputs]
    views = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
    assert len(views) == 2, texts
    for rank, shown in enumerate(views):  # in rank order, each its rank's bar as it ended, still a widget view
        assert re.match(rf"\[rank {rank}\] rank {rank}: 100%\|#+\| 20/20 ", shown.data["text/plain"]), texts
    assert not any(re.search(r"\] rank \d: +0%", t) for t in texts), texts
    assert "[ranks 0-1] done\n" in texts
    state = nbk.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [m["state"]["value"] for m in state.values() if m["model_name"] == "FloatProgressModel"]
    assert bars == [20, 20], bars


def test_a_bar_that_removes_itself_is_closed_after_its_view(nb: NotebookKernel) -> None:
    """tqdm(leave=False) closes its widgets when done: each comm_close must reach the front end
    after the view that shows it (a view of a closed model is "Error displaying widget")."""
    status, messages = run_cell(nb, "%%distributed\nfrom tqdm.auto import tqdm\n"
                                    "for _ in tqdm(range(3), leave=False):\n    pass\nprint('gone')")
    assert status == "ok", text_of(messages)
    views = views_by_rank(messages)
    assert sorted(views) == [0, 1]
    for rank, (model_id,) in views.items():
        shown = next(i for i, m in enumerate(messages) if m["msg_type"] in ("display_data", "update_display_data")
                     and m["content"]["data"].get(WIDGET_VIEW, {}).get("model_id") == model_id)
        closed = [i for i, m in enumerate(messages) if m["msg_type"] == "comm_close"
                  and m["content"]["comm_id"] == model_id]
        assert closed and closed[0] > shown, f"rank {rank}: view at {shown}, close at {closed}"


def test_moving_a_dead_ranks_slider_is_dropped_with_a_warning_and_never_hangs(nb: NotebookKernel) -> None:
    status, messages = run_cell(nb, "%%distributed\nimport ipywidgets as w\n"
                                    "gone = w.IntSlider(value=20 + rank)\ndisplay(gone)")
    assert status == "ok", text_of(messages)
    (rank1,) = views_by_rank(messages)[1]
    status, messages = run_cell(nb, "%%distributed --ranks 1\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert status == "error" and "rank 1 died" in text_of(messages), text_of(messages)
    t0 = time.monotonic()
    sent = send_comm(nb, "comm_msg", {"comm_id": rank1, "data": {"method": "update", "state": {"value": 7},
                                                                  "buffer_paths": []}})
    answer = iopub_until_idle(nb, sent, timeout=30)
    assert time.monotonic() - t0 < 10
    assert "rank 1 is not running" in text_of(answer) and "was dropped" in text_of(answer), answer
    assert nb.run("%clorch restart").status == "ok"  # later tests start from live ranks
    after = nb.run("%%distributed\nprint('alive', rank)").text
    assert "[rank 0] alive 0" in after and "[rank 1] alive 1" in after, after
