"""Issue 24: the rank's log keeps everything of a flood, bounded on disk (host/logcap.py),
driven through a real notebook kernel: with ``CLORCH_LOG_CAP`` set small, a flood many times the
cap leaves each rank's log under the cap plus slack, ``%clorch logs`` says how much of the oldest
output was dropped, and its newest lines, up to the last one, are all there."""

from __future__ import annotations

import os
import re
from typing import Iterator

import pytest

from clorch_repl.host import logcap

from notebook_kernel import NotebookKernel

CAP = 256 * 1024
LINES = 200_000  # about 5 MiB a rank: twenty times the cap
#: what the kernel may write between two looks of its supervisor (every 20 ms while the log grows),
#: with room for this shared 2-core machine making a look late
SLACK = 1024 * 1024


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    kernel = NotebookKernel(env={logcap.CAP_ENV: "256k"})
    try:
        assert kernel.run("%load_ext clorch_repl").status == "ok"
        assert kernel.run("%clorch start --nproc 2 --backend gloo").status == "ok"
        yield kernel
        kernel.settle()
        assert kernel.run("%clorch stop").status == "ok"
    finally:
        kernel.shutdown()


def test_a_flood_past_the_cap_leaves_a_bounded_log_that_says_what_was_dropped(nb: NotebookKernel) -> None:
    reply = nb.run(f"%%distributed\nfor i in range({LINES}):\n    print('flood', rank, i, 'y' * 8)", timeout=300)
    assert reply.status == "ok", reply.text[-2000:]
    where = nb.run("from clorch_repl.magics import magics_for\nprint('DIR', magics_for(get_ipython()).session.group.dir)")
    directory = re.search(r"DIR (\S+)", where.text).group(1)
    for rank in (0, 1):
        log = os.path.join(directory, f"rank{rank}.log")
        size = sum(os.path.getsize(p) for p in (log, logcap.older_path(log)) if os.path.exists(p))
        assert size <= CAP + SLACK, (rank, size)
        shown = nb.run(f"%clorch logs {rank} --tail 3").text
        first = shown.splitlines()[0]
        assert re.match(r"\[clorch_repl: the oldest [\d.]+ MiB \(\d+ bytes\) of this log were dropped", first), shown
        assert f"flood {rank} {LINES - 1} yyyyyyyy" in shown, shown
        everything = nb.run(f"%clorch logs {rank} --tail 0").text
        kept = [int(m) for m in re.findall(rf"^flood {rank} (\d+) y+$", everything, re.MULTILINE)]
        assert kept[-1] == LINES - 1 and len(kept) * 24 >= CAP // 2 - 4096, (len(kept), kept[-1:])
        assert "bytes of this log's oldest output were dropped" in everything
    after = nb.run("%%distributed\nprint('clean', rank)")
    assert after.status == "ok" and "clean 0" in after.text and "clean 1" in after.text, after.text
