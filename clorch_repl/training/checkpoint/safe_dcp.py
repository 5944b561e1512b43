"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

DCP reads a folder's ``.metadata`` with plain ``pickle.load`` and every non-tensor value (an
optimizer's ``lr``, its ``betas``) with ``torch.load(weights_only=False)``, so a crafted
checkpoint runs whatever it likes when loaded. Here both go through allow-lists instead:

* :class:`MetadataUnpickler` resolves only the classes DCP's metadata is made of (its own
  dataclasses, ``torch.Size``, dtypes, layouts, a path) and refuses every other global with a
  CheckpointError naming the file: ``weights_only=True``'s rule, for the metadata file.
* :class:`SafeLoadPlanner` reads non-tensor values with ``torch.load(weights_only=True)``;
  tensors DCP's own reader already loads with ``weights_only=True``.

:class:`SafeReader` is DCP's FileSystemReader with the metadata read that way; load with
``dcp.load(..., storage_reader=SafeReader(path), planner=SafeLoadPlanner())``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["METADATA_FILE", "MetadataUnpickler", "read_metadata", "SafeReader", "SafeLoadPlanner"]

METADATA_FILE = ".metadata"

#: (module, name) of every global a DCP metadata file may name. Dataclasses without code of their
#: own, torch's value types, and the two helpers torch's own pickling of layouts and memory formats
#: goes through (each turns a name into a torch constant).
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})


class MetadataUnpickler(pickle._Unpickler):
    """An unpickler that resolves only :data:`_ALLOWED` globals and torch dtypes, and sets state
    (pickle's BUILD) only on instances of DCP's own metadata dataclasses, which this load made:
    BUILD applied to an allowed class or function itself, or to an object the whole process shares
    (an enum member such as ``_MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST``, which calling the enum
    returns), would change it for everyone. The pure-Python unpickler, since that opcode can only
    be checked there (a metadata file is small)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        kind = type(target)
        if not (dataclasses.is_dataclass(kind) and (kind.__module__, kind.__qualname__) in _ALLOWED):
            what = (f"{getattr(target, '__qualname__', kind.__name__)} itself"
                    if isinstance(target, type) or callable(target) else f"a shared {kind.__name__}")
            raise CheckpointError(f"refused to load {self._path}: it sets attributes of {what}, which a "
                                  "checkpoint's metadata never does. Only load checkpoints written by "
                                  "save_checkpoint or torch.distributed.checkpoint")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"refused to load {self._path}: it names the Python object {module}.{name}, "
                              "which a checkpoint's metadata never holds, and unpickling it could run code. "
                              "Only load checkpoints written by save_checkpoint or torch.distributed.checkpoint")


def read_metadata(folder: str, name: str | None = None) -> Any:
    """The DCP ``Metadata`` of ``folder``, unpickled through :class:`MetadataUnpickler`; messages
    name the folder as ``name`` (the user's path, where ``folder`` is a pinned alias of it)."""
    path = os.path.join(folder, METADATA_FILE)
    if name is not None:
        return _renamed(lambda: read_metadata(folder), folder, name)
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is a folder without {METADATA_FILE}, so not a finished sharded "
                              "checkpoint; check the path, or save one first") from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint metadata {path} is truncated or corrupt ({type(exc).__name__}: "
                              f"{exc}); use an earlier checkpoint") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint metadata file")
    return metadata


def _renamed(read: Any, folder: str, name: str) -> Any:
    try:
        return read()
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace(folder, name)) from None


class SafeReader(FileSystemReader):
    """DCP's file reader, its metadata read through :class:`MetadataUnpickler`.

    ``metadata``, when given, is that folder's metadata already read that way (a load checks the
    checkpoint against it first): unpickling it again is what made a load slower than
    ``dcp.load``, since the allow-listing unpickler is pure Python (about 10x plain pickle's time,
    0.15 s for a 40-layer model's metadata on the CPU box)."""

    def __init__(self, path: str, metadata: Any = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not written by this package
            raise CheckpointError(f"{self.path} holds per-rank metadata files, which clorch_repl does not read")
        metadata = self._metadata if self._metadata is not None else read_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with non-tensor values read as ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"refused to load the value {fqn!r} of the checkpoint: it holds Python "
                                  f"objects beyond plain data, and loading them could run code "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DCP itself uses here

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
