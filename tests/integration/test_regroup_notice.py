"""What ``%clorch restart --ranks`` says it did not carry over to the re-formed group, in a real
notebook kernel driving two real gloo ranks: the groups the user made (``dist.new_group``, a
DeviceMesh's) and must make again, never clorch's own (the sharded checkpoints' gloo group, which
clorch makes again by itself: README, "groups made again").

Before, a sharded save followed by a rank's death and ``%clorch restart --ranks 1`` printed
``not carried over to the re-formed group: the group '1' of ranks [0, 1] (made by dist.new_group
or a DeviceMesh)``: the checkpoints' group, under a number the user never saw."""

from __future__ import annotations

import re

import pytest

from notebook_kernel import clorch_session
from rank_text import lines_of

pytestmark = pytest.mark.slow

NOTICE = "not carried over to the re-formed group"

SAVE = """%%distributed
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from clorch_repl import distributed as cdist
cdist.save_checkpoint({path!r}, model=fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh("cpu", (world_size,))))
{extra}print('saved', flush=True)
"""

KILL = "%%distributed --ranks 1\nimport os\nos.kill(os.getpid(), 9)\n"

LOAD = """%%distributed
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from clorch_repl import distributed as cdist
cdist.load_checkpoint({path!r}, model=fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh("cpu", (world_size,))))
t = torch.ones(1)
dist.all_reduce(t)
print('loaded', t.item(), flush=True)
"""


def _plain(text: str) -> str:
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def _restart_after_a_death(nb, path: str, extra: str = "") -> str:
    saved = nb.run(SAVE.format(path=path, extra=extra), timeout=120)
    assert saved.status == "ok", saved.text
    assert [lines_of(saved.text, r) for r in range(2)] == [["saved"]] * 2, saved.text
    died = nb.run(KILL, timeout=90)
    assert died.status == "error" and "rank 1" in _plain(died.text), died.text
    back = nb.run("%clorch restart --ranks 1", timeout=120)
    assert back.status == "ok", back.text
    assert "rank 1 started afresh and the group formed again" in _plain(back.text), back.text
    return _plain(back.text)


def test_the_checkpoints_own_group_is_not_named_and_a_users_group_is(tmp_path) -> None:
    with clorch_session("--nproc 2 --backend gloo") as nb:
        # a sharded save alone made no group of the user's (the 1-D mesh over every rank is the
        # session's own group, carried over): nothing to make again, so no notice at all
        text = _restart_after_a_death(nb, str(tmp_path / "s8"))
        assert NOTICE not in text, text
        assert "group '1'" not in text, text
        loaded = nb.run(LOAD.format(path=str(tmp_path / "s8")), timeout=120)
        assert loaded.status == "ok", loaded.text
        assert [lines_of(loaded.text, r) for r in range(2)] == [["loaded 2.0"]] * 2, loaded.text

        # the user's own dist.new_group beside a sharded save: named, by its ranks and its maker,
        # and the checkpoints' group still is not
        text = _restart_after_a_death(nb, str(tmp_path / "s9"), extra="mine = dist.new_group([0, 1])\n")
        assert NOTICE in text, text
        notice = text[text.index(NOTICE):]
        assert "ranks [0, 1]" in notice and "dist.new_group" in notice, notice
        assert notice.count("ranks [0, 1]") == 1, notice  # one group: the user's, not clorch's too
        loaded = nb.run(LOAD.format(path=str(tmp_path / "s9")), timeout=120)
        assert loaded.status == "ok", loaded.text
        assert [lines_of(loaded.text, r) for r in range(2)] == [["loaded 2.0"]] * 2, loaded.text
