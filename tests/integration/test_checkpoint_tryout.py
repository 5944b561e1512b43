"""Defects of checkpoints found by a user try-out, in one real notebook session of 2 gloo ranks:

* a refusal agreed between the ranks showed the frame of contextlib that runs clorch's agreement,
  a different line on the rank that failed and on the rank told of it, so the one error was shown
  twice, unmerged (common/user_frames);
* a file that is no checkpoint, loaded into a sharded model, was called "a single-file checkpoint";
* a rank past the saved world size got rank 0's RNG state without a word.

The checkpoints that 1 rank saved are written by this test process (no process group), as a
notebook's own kernel would: loading them on 2 ranks gives rank 1 rank 0's RNG state."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from clorch_repl.distributed import save_checkpoint
from notebook_kernel import clorch_session
from rank_text import lines_of

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))


SETUP = """%%distributed
import os, warnings, torch
import torch.distributed as td
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from clorch_repl import distributed as cdist
os.chdir({root!r})
warnings.simplefilter("always")  # each load's warning, not only the first at a line
def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
model = build(); opt = torch.optim.AdamW(model.parameters())
fsdp = build(); fully_shard(fsdp, mesh=init_device_mesh("cpu", (td.get_world_size(),)))
fopt = torch.optim.AdamW(fsdp.parameters())
"""


def _error(kernel: Any, code: str) -> str:
    reply = kernel.run("%%distributed\n" + code)
    assert reply.status == "error", reply.text
    return ANSI.sub("", reply.text)


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Iterator[tuple[Any, Path]]:
    """One 2-rank session for the module, in a folder holding a data set, a text file and two
    checkpoints saved by 1 rank (this process)."""
    root = tmp_path_factory.mktemp("tryout")
    (root / "ck" / "dataset").mkdir(parents=True)
    (root / "ck" / "dataset" / "images.txt").write_text("not a checkpoint\n")
    (root / "notes.txt").write_text("plain text\n")
    save_checkpoint(root / "one.pt", model=_model(), state={"from": "1 rank"})
    save_checkpoint(root / "one-sharded", model=_model(), sharded=True)
    with clorch_session() as kernel:
        assert kernel.run(SETUP.format(root=str(root))).status == "ok"
        yield kernel, root


def test_an_agreed_refusal_is_shown_once_ending_at_the_call(session) -> None:
    kernel, _ = session
    # rank 0 alone refuses the folder and rank 1 is told: one error, merged, ending at the call
    text = _error(kernel, "cdist.save_checkpoint('ck/dataset', model=fsdp, optimizer=fopt)")
    assert "contextlib" not in text and "clorch_repl" not in text, text
    assert text.count("CheckpointError") == 2 and "---- ranks 0-1 ----" in text, text  # heading + message
    assert "saving the checkpoint failed on rank 0: " in text and "is a folder that holds no checkpoint" in text
    assert text.rstrip().endswith("choose another path; nothing was changed on any rank"), text
    assert "----> 1 cdist.save_checkpoint('ck/dataset'" in text, text
    # the loading refusals go through the same agreement
    text = _error(kernel, "cdist.load_checkpoint('ck/dataset', model=fsdp, optimizer=fopt)")
    assert "contextlib" not in text and "---- ranks 0-1 ----" in text, text
    assert "is a folder without .metadata" in text, text


def test_a_text_file_is_no_checkpoint_for_a_sharded_model_either(session) -> None:
    kernel, root = session
    for args in ("model=fsdp, optimizer=fopt", "model=model, optimizer=opt"):
        text = _error(kernel, f"cdist.load_checkpoint('notes.txt', {args})")
        assert ("CheckpointError: loading the checkpoint failed on ranks 0-1: the checkpoint "
                f"{root}/notes.txt is truncated or not a checkpoint file (File is not a zip file)") in text, text
        assert "single-file checkpoint" not in text, text
    text = _error(kernel, "cdist.load_checkpoint('one.pt', model=fsdp)")  # a real one keeps its advice
    assert (f"ConfigError: {root}/one.pt is a single-file checkpoint (an unsharded model's) and the model "
            "is sharded") in text, text


def test_a_rank_given_rank_0s_rng_state_is_warned_at_its_call(session) -> None:
    kernel, _ = session
    for call in ("cdist.load_checkpoint('one.pt', model=model)", "cdist.load_checkpoint('one-sharded', model=fsdp)"):
        reply = kernel.run(f"%%distributed\nx = 1\n{call}\ntorch.rand(3).tolist()")
        assert reply.status == "ok", reply.text
        warned = [line for line in lines_of(reply.text, 1) if "RuntimeWarning" in line]
        assert len(warned) == 1, reply.text
        assert warned[0].endswith(
            "RuntimeWarning: load_checkpoint: rank 1 resumed rank 0's random state (the checkpoint was saved "
            "by 1 rank), so ranks 0 and 1 now draw the same random numbers (dropout, augmentation); to make "
            "them differ, reseed after loading, e.g. torch.manual_seed(seed + rank)"), warned
        assert ":2: RuntimeWarning" in warned[0], warned  # the cell's line 2: the user's call
        assert not [line for line in lines_of(reply.text, 0) if "RuntimeWarning" in line], reply.text
