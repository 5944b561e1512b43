"""The two DCP storage writers a sharded save uses: a blocking save writes in the rank
(:class:`RecordingWriter`), an asynchronous one through the rank's writer process
(:class:`ProcessWriter`, :mod:`.writer_process`). Both keep, on the coordinator, what every rank
wrote (:attr:`RecordingWriter.written`), which rank zero then finds on disk before it commits
(:func:`.commit.missing_files`), without reading the ``.metadata`` back through the allow-listing
unpickler, which is pure Python and would hold the GIL on the writing thread for 0.1 s or more.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .host_arena import HostArena
from .writer_process import Item, WriterProcess, tensor_bytes

logger = logging.getLogger(__name__)

__all__ = ["RecordingWriter", "ProcessWriter"]

#: DCP's name for a rank's shard file: its prefix (``__<rank>_``), a count, this suffix
SHARD_SUFFIX = ".distcp"


class RecordingWriter(FileSystemWriter):
    """DCP's file writer (fsynced), keeping the write results it is finished with."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=True)
        self.written: list[list[WriteResult]] = []

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        self.written = results
        super().finish(metadata, results)

    def files(self) -> Any:
        """What every rank wrote, in the shape :func:`.commit.missing_files` reads (coordinator only)."""
        return SimpleNamespace(storage_data={r.index: r.storage_data for results in self.written for r in results})


class ProcessWriter(RecordingWriter):
    """Writes this rank's shard file in the writer process, from the staged block ``arena``."""

    def __init__(self, path: str, process: WriterProcess, arena: HostArena) -> None:
        super().__init__(path)
        self._process = process
        self._arena = arena

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = f"{plan.storage_data.prefix}0{SHARD_SUFFIX}"  # one file per rank, as DCP's default
        items = [self._item(planner, write_item) for write_item in plan.items]
        spans = self._process.write(os.path.join(os.fspath(self.path), file_name), items, self._arena,
                                    self.sync_files)
        results = [WriteResult(index=write_item.index, size_in_bytes=length,
                               storage_data=_StorageInfo(file_name, offset, length))
                   for write_item, (offset, length) in zip(plan.items, spans)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _item(self, planner: SavePlanner, write_item: Any) -> Item:
        data = planner.resolve_data(write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            return ("b", bytes(data.getbuffer()))
        offset = self._arena.locate(data)
        if offset is None:  # not staged in the block (an empty tensor, a view): its bytes, saved here
            return ("b", tensor_bytes(data.detach().cpu()))
        return ("t", offset, str(data.dtype).rpartition(".")[2], tuple(data.shape))
