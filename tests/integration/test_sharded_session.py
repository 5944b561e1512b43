"""FSDP2 in the notebook: a sharded model trained in ``%%distributed`` cells on a real 2-rank gloo
session, saved asynchronously while ``%clorch status`` shows the save in flight, loaded back on
the ranks and into an unsharded model in the notebook kernel itself; and the notebook SIGKILLed
in the middle of a save loop, after which the checkpoint at the path is whole."""

from __future__ import annotations

import os
import re
import signal

import psutil
import torch

from clorch_repl.distributed import load_checkpoint
from clorch_repl.common.procs import wait_gone
from tests import sharded_helpers as sh
from notebook_kernel import clorch_session
from rank_text import lines_of

BUILD = """%%distributed
import torch
from tests import sharded_helpers as sh
model = sh.build("fsdp", 0, world_size)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sh.train_step(model, opt, "fsdp")
saved, weights = sh.digest(model, opt), sh.digest(model)
print(weights)
"""

# the write (an asynchronous save's goes through the rank's writer process) is slowed (4 s per
# rank) so that the save is still in flight when the status is asked
SAVE_ASYNC = """%%distributed
import time
from clorch_repl import distributed as cdist
from clorch_repl.training.checkpoint.storage_writers import ProcessWriter
_write = ProcessWriter.write_data
def _slow(self, plan, planner):
    time.sleep(4)
    return _write(self, plan, planner)
ProcessWriter.write_data = _slow
handle = cdist.save_checkpoint(PATH, model=model, optimizer=opt, state={"epoch": 1}, async_save=True)
sh.train_step(model, opt, "fsdp", seed=1)  # training goes on while the save writes
print("returned", handle.done())
"""

WAIT_AND_LOAD = """%%distributed
ProcessWriter.write_data = _write
print("committed", handle.wait() == PATH)
fresh = sh.build("fsdp", 9, world_size)
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
print(cdist.load_checkpoint(PATH, model=fresh, optimizer=fresh_opt), sh.digest(fresh, fresh_opt) == saved)
"""


def on_both_ranks(text: str, line: str) -> bool:
    """``line`` printed by ranks 0 and 1: merged (``[ranks 0-1]``), or each under its own label when
    one rank's copy came later than the display's merge hold (a loaded box: the full suite)."""
    return all(line in lines_of(text, rank) for rank in (0, 1))


def test_fsdp_in_cells_async_save_status_and_load_in_the_notebook(tmp_path) -> None:
    path = str(tmp_path / "fsdp-ckpt")
    with clorch_session() as nb:
        built = nb.run(BUILD)
        assert built.status == "ok", built.text
        digests = [[line for line in lines_of(built.text, rank) if re.fullmatch(r"[0-9a-f]{64}", line)]
                   for rank in (0, 1)]
        assert digests[0] == digests[1] and len(digests[0]) == 1, built.text  # the same full weights on both ranks
        weights = digests[0][0]
        saving = nb.run(SAVE_ASYNC.replace("PATH", repr(path)))
        assert saving.status == "ok" and on_both_ranks(saving.text, "returned False"), saving.text
        status = nb.run("%clorch status")
        assert f"checkpoint save in flight: {path} (ranks 0-1, writing for" in status.text, status.text
        loaded = nb.run(WAIT_AND_LOAD.replace("PATH", repr(path)))
        assert loaded.status == "ok", loaded.text
        assert on_both_ranks(loaded.text, "committed True"), loaded.text
        assert on_both_ranks(loaded.text, "{'epoch': 1} True"), loaded.text
        assert "checkpoint save in flight" not in nb.run("%clorch status").text
        # the notebook kernel has no process group: the checkpoint loads into the plain model there
        here = nb.run("from tests import sharded_helpers as sh\nfrom clorch_repl.distributed import "
                      f"load_checkpoint\nm = sh.build('plain', 5)\nprint(load_checkpoint({path!r}, model=m), "
                      "sh.digest(m))")
        assert here.status == "ok", here.text
        assert f"{{'epoch': 1}} {weights}" in here.text, here.text
        # a torchrun script's destroy_process_group() ends the subgroups, the checkpoints' own too:
        # the next sharded save makes it again
        again = nb.run("%%distributed\nimport torch.distributed as dist\ndist.destroy_process_group()\n"
                       f"print('saved', cdist.save_checkpoint({path + '-2'!r}, model=model, optimizer=opt))")
        assert again.status == "ok" and on_both_ranks(again.text, f"saved {path}-2"), again.text


def test_a_stop_waits_for_the_asynchronous_save_in_flight_and_says_so(tmp_path) -> None:
    """%clorch stop of idle ranks whose asynchronous save still writes: the save is committed
    first (it was thrown away without a word), and the user is told while it waits."""
    path = str(tmp_path / "stopped-while-saving")
    with clorch_session(stop=False) as nb:
        assert nb.run(BUILD).status == "ok"
        saving = nb.run(SAVE_ASYNC.replace("PATH", repr(path)))
        assert saving.status == "ok" and on_both_ranks(saving.text, "returned False"), saving.text
        stopped = nb.run("%clorch stop", timeout=120)
        assert stopped.status == "ok", stopped.text
        flat = " ".join(stopped.text.split())
        assert (f"clorch: waiting for the asynchronous checkpoint save to {path} (ranks 0-1) to be committed "
                "before the ranks end") in flat, stopped.text
        assert "clorch: the checkpoint save was committed" in flat and "stopped 2 rank(s)" in flat, stopped.text
    model = sh.build("plain", 3)
    assert load_checkpoint(path, model=model, restore_rng=False) == {"epoch": 1}  # whole, at the path


def test_a_rank_killed_while_the_stop_waits_for_a_save_ends_the_wait_and_leaves_nothing(tmp_path) -> None:
    """%clorch stop waits for the asynchronous save in flight; rank 1 is SIGKILLed during that wait.
    The stop still ends, says the save was not committed and that rank 1 died, leaves no process
    behind, and the path holds no torn checkpoint: nothing loads from it."""
    path = str(tmp_path / "killed-while-saving")
    with clorch_session(stop=False) as nb:
        assert nb.run(BUILD).status == "ok"
        pids = nb.run("%%distributed\nimport os\nprint('pid', os.getpid())")
        rank1 = int(re.search(r"\[rank 1\] pid (\d+)", pids.text).group(1))
        everything = [c.pid for c in psutil.Process(nb.pid).children(recursive=True)]
        saving = nb.run(SAVE_ASYNC.replace("PATH", repr(path)))
        assert saving.status == "ok" and on_both_ranks(saving.text, "returned False"), saving.text
        msg_id = nb.send("%clorch stop")
        nb.wait_for_output(msg_id, "to be committed before the ranks end", timeout=60)
        os.kill(rank1, signal.SIGKILL)
        stopped = nb.collect(msg_id, timeout=120)
        flat = " ".join(stopped.text.split())
        assert ("clorch: the checkpoint save was not committed: rank 1 died during the wait (killed by signal "
                "SIGKILL") in flat and "the checkpoint there stays the one before" in flat, stopped.text
        assert flat.count("died") == 1 and "clorch: stopped 2 rank(s)" in flat, stopped.text
        assert wait_gone(everything, 30) == [], f"left behind: {stopped.text}"
        assert nb.run("print('the notebook kernel goes on')").status == "ok"
    model = sh.build("plain", 3)
    try:
        load_checkpoint(path, model=model, restore_rng=False)
    except Exception as exc:  # noqa: BLE001 - any refusal will do; what it must not do is load
        assert "no checkpoint at" in str(exc) or "not committed" in str(exc) or "incomplete" in str(exc), exc
    else:
        raise AssertionError(f"a save whose rank died mid-write loaded from {path}")


SAVE_LOOP = """%%distributed
from tests import sharded_helpers as sh
sh.save_versions({"rank": rank, "world_size": world_size, "args": {"path": PATH}})
"""


def test_the_notebook_killed_mid_save_leaves_a_whole_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    with clorch_session(stop=False) as nb:
        msg_id = nb.send(SAVE_LOOP.replace("PATH", repr(path)))
        nb.wait_for_output(msg_id, "saved", count=3, timeout=120)
        ranks = [c.pid for c in psutil.Process(nb.pid).children(recursive=True)]
        os.kill(nb.pid, signal.SIGKILL)
        assert wait_gone(ranks, 30) == [], "a rank outlived the notebook"
    model = sh.build("plain", 3)
    version = load_checkpoint(path, model=model, restore_rng=False)["version"]
    assert version >= 3
    assert all(torch.all(p == float(version)) for p in model.parameters()), version
