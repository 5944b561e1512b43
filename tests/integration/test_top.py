"""``%clorch top``: the live rank panel through a real notebook kernel and 2 gloo ranks (updates at
least once a second while a cell runs, showing the running cell and the collective a rank waits
in), ``--once`` and ``--stop``. What a row shows, from hand-made snapshots: tests/unit/test_top_units.py."""

from __future__ import annotations

import html
import re
import time
from queue import Empty

from notebook_kernel import clorch_session


SLOW_BARRIER = """%%distributed
import time, torch.distributed as dist
if rank == 0:
    time.sleep(5)
dist.barrier()
print("through")
"""


def _panel_updates(nb, seconds: float) -> list[tuple[float, str]]:
    """(arrival, the panel's table as text) of every widget update within ``seconds``."""
    out, t0 = [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            msg = nb.kc.get_iopub_msg(timeout=0.2)
        except Empty:
            continue
        nb._held.append(msg)  # the cell's own messages stay for collect()
        value = ((msg["content"].get("data") or {}).get("state") or {}).get("value") \
            if msg["msg_type"] == "comm_msg" else None
        if isinstance(value, str) and "clorch-top" in value:
            out.append((time.monotonic() - t0, html.unescape(re.sub(r"<[^>]+>", " ", value))))
    return out


def test_the_panel_updates_while_a_cell_runs_and_closes() -> None:
    with clorch_session() as nb:
        once = nb.run("%clorch top --once")
        assert once.status == "ok", once.text
        lines = once.text.splitlines()
        assert lines[1].split()[:4] == ["rank", "host", "state", "cell"], once.text
        assert re.match(r"0\s+here\s+idle\s", lines[2]) and re.match(r"1\s+here\s+idle\s", lines[3]), once.text
        opened = nb.run("%clorch top")
        assert opened.status == "ok", opened.text
        # without a widget manager (this client has none) the panel's text is the table, not "VBox(...)"
        assert "VBox(" not in opened.text and opened.text.splitlines()[1].split()[:2] == ["rank", "host"], opened.text
        msg_id = nb.send(SLOW_BARRIER)
        updates = _panel_updates(nb, 5.5)
        ran = nb.collect(msg_id)
        assert ran.status == "ok" and "[ranks 0-1] through" in ran.text, ran.text
        times = [t for t, _ in updates]
        assert len(updates) >= 4, updates
        assert max(b - a for a, b in zip(times, times[1:])) < 1.6, times  # about once a second
        busy = [text for _, text in updates if " busy " in text]
        # the cell column shows the line each rank is at now, not the cell's first line (issue 38)
        assert busy and any("line 3: time.sleep(5)" in t and "line 4: dist.barrier()" in t for t in busy), busy
        # rank 1 waits in the barrier for rank 0: the panel names the collective once it stands still
        assert any(re.search(r"barrier #\d+, group \d+, for \d+s", text) for _, text in updates), updates[-1]
        # the panel follows the session through a restart (it stayed at "the ranks stopped")
        restarted = nb.run("%clorch restart", timeout=180)
        assert restarted.status == "ok", restarted.text
        later = _panel_updates(nb, 3.0)
        assert later and re.search(r" 0\s+here\s+idle ", later[-1][1]), later
        assert "stopped" not in later[-1][1] and "starting at" not in later[-1][1], later[-1][1]
        closed = nb.run("%clorch top --stop")
        assert "closed the %clorch top panel" in closed.text
        after = _panel_updates(nb, 2.5)
        assert after == [], after  # closed: nothing more is sent
        assert "no %clorch top panel is open" in nb.run("%clorch top --stop").text


def test_once_names_a_stuck_collective_its_age_and_the_verdict() -> None:
    """One look (``--once``) has no earlier round to learn from: it showed "#2, group 0, for 0s"
    with no op, no STUCK and no verdict for a collective pending 13 s, where the live panel said it
    all. It now reads them from the ranks' records."""
    stuck = ("%%distributed --timeout 2\nimport time, torch, torch.distributed as dist\nif rank == 1:\n"
             "    while True:\n        try:\n            time.sleep(100)\n        except KeyboardInterrupt:\n"
             "            pass\nelse:\n    dist.all_reduce(torch.ones(2))\n")
    with clorch_session("--nproc 2 --backend gloo --hang-notice 0") as nb:
        assert nb.run(stuck, timeout=60).status == "error"
        time.sleep(max(0.0, 11.0 - 4.0))  # past the panel's STUCK mark (10 s), the cell took about 4 s
        once = nb.run("%clorch top --once")
        assert once.status == "ok", once.text
        assert re.search(r"all_reduce #\d+, group 0, for (1\d|[2-9]\d)s STUCK", once.text), once.text
        assert "hang: " in once.text and "rank 1 never called it" in " ".join(once.text.split()), once.text
        assert nb.run("%clorch restart", timeout=180).status == "ok"
