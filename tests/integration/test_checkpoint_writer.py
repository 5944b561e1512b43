"""The asynchronous save's writer process (issue 39): what it writes is DCP's format, byte for
byte loadable by torch's own ``dcp.load``; a writer that ended is replaced at the next save; a
write that fails says why; nothing is left running after the rank closes it. Real processes and
real files throughout; no group (one process), as ``save_checkpoint(sharded=True)`` allows."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from clorch_repl.distributed import save_checkpoint
from clorch_repl.errors import CheckpointError
from clorch_repl.training.checkpoint import sharded
from clorch_repl.training.checkpoint.host_arena import HostArena
from clorch_repl.training.checkpoint.writer_process import WriterProcess


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def test_an_asynchronous_save_is_written_by_the_writer_process_in_dcps_format(tmp_path) -> None:
    model, opt = _model()
    path = str(tmp_path / "ckpt")
    handle = save_checkpoint(path, model=model, optimizer=opt, sharded=True, async_save=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on at once: the checkpoint keeps the state at the call
    assert handle.wait(timeout=120) == path
    writer = sharded._WRITER._proc
    assert writer is not None and writer.poll() is None  # a process of its own wrote the shards
    fresh = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load({"model": fresh}, checkpoint_id=path)  # torch's own reader, no clorch part in the way
    assert all(torch.equal(fresh[k], expected[k]) for k in expected)


def test_a_writer_that_ended_is_replaced_at_the_next_save(tmp_path) -> None:
    model, opt = _model()
    save_checkpoint(str(tmp_path / "a"), model=model, optimizer=opt, sharded=True, async_save=True).wait(120)
    first = sharded._WRITER._proc
    first.kill()
    first.wait()
    save_checkpoint(str(tmp_path / "b"), model=model, optimizer=opt, sharded=True, async_save=True).wait(120)
    assert sharded._WRITER._proc is not None and sharded._WRITER._proc.pid != first.pid
    assert os.path.isfile(tmp_path / "b" / ".metadata")


def test_a_failed_write_says_why_and_closing_leaves_no_process(tmp_path) -> None:
    process = WriterProcess()
    arena = HostArena(1024, pin=False)
    block = arena.tensor((4,), torch.float32)
    block.copy_(torch.arange(4.0))
    where = arena.locate(block)
    spans = process.write(str(tmp_path / "shard"), [("t", where, "float32", (4,)), ("b", b"xyz")], arena, True)
    with open(tmp_path / "shard", "rb") as handle:
        data = handle.read()
    (start, length), (b_start, b_length) = spans
    import io
    assert torch.equal(torch.load(io.BytesIO(data[start:start + length]), weights_only=True), torch.arange(4.0))
    assert data[b_start:b_start + b_length] == b"xyz"
    with pytest.raises(CheckpointError, match=r"writing .*missing/shard failed: FileNotFoundError"):
        process.write(str(tmp_path / "missing" / "shard"), [("b", b"x")], arena, False)
    pid = process._proc.pid
    process.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_model_cast_to_another_dtype_is_saved_with_its_new_dtype(tmp_path) -> None:
    """DCP's cached plans compare names and shapes only: the cache key holds the dtypes too."""
    from clorch_repl.training.checkpoint.safe_dcp import read_metadata

    model, _opt = _model()
    path = str(tmp_path / "cast")
    for _ in range(2):  # the second save reuses the first one's plan
        save_checkpoint(path, model=model, sharded=True)
    model.to(torch.bfloat16)  # the same names and shapes
    save_checkpoint(path, model=model, sharded=True)
    saved = read_metadata(path).state_dict_metadata["model.0.weight"]
    assert saved.properties.dtype == torch.bfloat16
    fresh = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(fresh, checkpoint_id=path)
    assert all(torch.equal(fresh["model"][k], v) for k, v in model.state_dict().items())


def _staging_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum("clorch-checkpoint-staging" in line for line in maps)


def test_an_interrupt_does_not_end_the_writer_and_a_new_layout_frees_the_old_block(tmp_path) -> None:
    import signal
    import time

    model, opt = _model()
    save_checkpoint(str(tmp_path / "a"), model=model, optimizer=opt, sharded=True, async_save=True).wait(120)
    writer = sharded._WRITER._proc
    assert _staging_maps(writer.pid) >= 1  # it maps the block the state was staged into
    os.kill(writer.pid, signal.SIGINT)  # what an interrupt of the rank's cell sends its process group
    handle = save_checkpoint(str(tmp_path / "b"), model=model, optimizer=opt, sharded=True, async_save=True)
    assert handle.wait(120) == str(tmp_path / "b")
    assert sharded._WRITER._proc is writer and writer.poll() is None  # the same writer, not a restarted one
    # another layout: the writer lets the old block go before the rank makes the new one
    sharded._STAGER.stage({"model": {"w": torch.ones(1000)}})
    deadline = time.monotonic() + 10
    while _staging_maps(writer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _staging_maps(writer.pid) == 0
