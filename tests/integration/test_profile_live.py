"""``%%distributed --profile``: a real 3-rank gloo session, one rank slowed on purpose (extra matmuls
on rank 2): the verdict names rank 2 and the operator, the merged trace is JSON with one process
per rank. The verdict's logic on recorded summaries: tests/unit/test_profile.py."""

from __future__ import annotations

import json
import os
import re

from notebook_kernel import clorch_session


SLOW_RANK_CELL = """%%distributed --profile {folder}
import torch, torch.distributed as dist
a = torch.randn(384, 384)
for _ in range(120 if rank == 2 else 10):
    b = a @ a
t = torch.ones(4)
dist.all_reduce(t)
print("sum", t.sum().item())
"""


def test_profile_names_the_slow_rank_and_its_operator(tmp_path) -> None:
    folder = str(tmp_path / "prof")
    with clorch_session("--nproc 3 --backend gloo") as nb:
        reply = nb.run(SLOW_RANK_CELL.format(folder=folder), timeout=240)
        assert reply.status == "ok", reply.text
        assert "[ranks 0-2] sum 12.0" in reply.text, reply.text
        assert re.search(r"rank 2 is the straggler: \d+ ms more compute than the others .* most of it in "
                         r"aten::mm \(\+\d+ ms\)", reply.text), reply.text
        assert re.search(r"ranks 0-1 wait for it in \S*all_?reduce\S* \(\d+ ms\)", reply.text), reply.text
        for r in range(3):
            assert re.search(rf"rank {r}: \d+ ms profiled; CPU: compute \d+ ms, in collectives \(waiting "
                             rf"included\) \d+ ms", reply.text), reply.text
        assert "other: the cell's time in neither an operator nor a collective" in reply.text, reply.text
        links = [m["content"]["data"]["text/html"] for m in reply.outputs
                 if "text/html" in (m["content"].get("data") or {}) and "trace.json" in m["content"]["data"]["text/html"]]
        assert links and "<a href=" in links[0], links  # the trace as a link (issue 38)
        trace = json.load(open(os.path.join(folder, "trace.json")))
        names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
        assert {e["pid"] for e in trace["traceEvents"] if e.get("name") == "aten::mm"} == {0, 1, 2}
        assert sorted(os.listdir(folder)) == ["rank-0.json", "rank-1.json", "rank-2.json", "trace.json"]
        # a cell that fails under the profiler: its error is shown, the profiler still stops
        failed = nb.run(f"%%distributed --profile {folder}-failed\nraise ValueError('boom')")
        assert failed.status == "error" and "ValueError" in failed.text and "boom" in failed.text, failed.text
        assert sorted(os.listdir(folder + "-failed")) == ["rank-0.json", "rank-1.json", "rank-2.json", "trace.json"]
        # without DIR: under the session's own directory, nothing beside the notebook (issue 38)
        cwd = re.search(r"CWD (.+)", nb.run("import os\nprint('CWD', os.getcwd())").text).group(1).strip()
        before = set(os.listdir(cwd))
        unasked = nb.run("%%distributed --profile\nprint('default', rank)")
        found = re.search(r"one trace of 3 rank\(s\) in (\S+trace\.json)", unasked.text)
        assert unasked.status == "ok" and found and "/profiles/cell-" in found.group(1), unasked.text
        assert set(os.listdir(cwd)) == before and os.path.exists(found.group(1)), sorted(set(os.listdir(cwd)) - before)
        # the next cell is not profiled, and the ranks are fine
        after = nb.run("%%distributed\nprint('after', rank)")
        assert after.status == "ok" and "clorch profile" not in after.text and "[rank 2] after 2" in after.text
