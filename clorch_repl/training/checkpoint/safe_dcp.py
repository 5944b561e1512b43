"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

DCP reads a folder's ``.metadata`` with plain ``pickle.load`` and every non-tensor value (an
optimizer's ``lr``, its ``betas``) with ``torch.load(weights_only=False)``, so a crafted
checkpoint runs whatever it likes when loaded. Here both go through allow-lists instead:

* :class:`MetadataUnpickler` resolves only the classes DCP's metadata is made of (its own
  dataclasses, ``torch.Size``, dtypes, layouts, a path) and refuses every other global with a
  CheckpointError naming the file: ``weights_only=True``'s rule, for the metadata file; and
  pickle never reaches a real object it could change (see its docstring).
* :class:`SafeLoadPlanner` reads non-tensor values with ``torch.load(weights_only=True)``;
  tensors DCP's own reader already loads with ``weights_only=True``.

:class:`SafeReader` is DCP's FileSystemReader with the metadata read that way; load with
``dcp.load(..., storage_reader=SafeReader(path), planner=SafeLoadPlanner())``.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import logging
import os
import pathlib
import pickle
import stat
import threading
from collections import OrderedDict
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


_MISSING = object()


class _Load:
    """What one metadata read made: the stand-ins of DCP's dataclasses to turn into the real
    classes at the end, and how many values (enum members, paths) were asked for and not yet
    put in place."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.built: list[Any] = []
        self.unplaced = 0


_CURRENT = threading.local()  # the read in progress on this thread (stand-ins reach it from pickle's calls)


def _current() -> _Load:
    load: _Load | None = getattr(_CURRENT, "load", None)
    if load is None:  # a stand-in used outside a read: nothing of ours calls them so
        raise CheckpointError("a checkpoint metadata stand-in was used outside a metadata read")
    return load


def _refuse_build(what: str) -> CheckpointError:
    return CheckpointError(f"refused to load {_current().path}: it sets attributes of {what}, which a "
                           "checkpoint's metadata never does. Only load checkpoints written by "
                           "save_checkpoint or torch.distributed.checkpoint")


class _Value:
    """A stand-in for a call of an allowed global that is no dataclass (an enum member, a layout, a
    path): recorded while unpickling, made real when the dataclass holding it is built, and never
    handed to pickle's BUILD (which on the real object, an enum member shared by the whole
    process, would change it for everyone). Made by :func:`_value_stand_in`, one class a global."""

    __slots__ = ("args", "value")

    def __new__(cls, *args: Any) -> "_Value":  # pickle's REDUCE and NEWOBJ both come here
        made = object.__new__(cls)
        made.args, made.value = args, _MISSING
        _current().unplaced += 1
        return made

    def made(self) -> Any:
        """The real value, made once (pickle's memo hands one stand-in to every place it is in)."""
        if self.value is _MISSING:
            self.value = type(self).make(*self.args)  # type: ignore[attr-defined]  # set by _value_stand_in
            _current().unplaced -= 1
        return self.value


def _placed(value: Any) -> Any:
    return value.made() if isinstance(value, _Value) else value


def _dataclass_stand_in(real: type) -> type:
    """A subclass of one of DCP's metadata dataclasses whose instances the unpickler makes (its
    NEWOBJ) and whose BUILD comes here: the state is applied as pickle would apply it (or by the
    class's own ``__setstate__``) on that fresh instance only, with the stand-ins of values it
    holds made real; BUILD on the class itself is refused. Each instance becomes the real class
    once the file is read."""
    own_setstate = real.__dict__.get("__setstate__")

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # pickle's NEWOBJ (a dataclass's way) and REDUCE
        made = object.__new__(cls)
        _current().built.append(made)  # (a dataclass without fields gets no BUILD at all)
        return made

    def __setstate__(self: Any, state: Any = _MISSING) -> None:
        if state is _MISSING:  # pickle's BUILD on the class: called unbound, the state as ``self``
            raise _refuse_build(f"{real.__name__} itself")
        slots = None
        if own_setstate is None and type(state) is tuple and len(state) == 2:  # pickle's (dict, slots) form
            state, slots = state
        if type(state) is dict:
            for key, value in state.items():
                if isinstance(value, _Value):
                    state[key] = value.made()
        elif type(state) is tuple:
            state = tuple(v.made() if isinstance(v, _Value) else v for v in state)
        if own_setstate is not None:
            own_setstate(self, state)  # the class's own, on the fresh instance (TensorProperties')
        elif state:
            if type(state) is not dict:
                raise CheckpointError(f"the checkpoint metadata {_current().path} holds a {real.__name__} "
                                      "with a state pickle cannot apply")
            self.__dict__.update(state)
        if slots:
            if type(slots) is not dict:
                raise CheckpointError(f"the checkpoint metadata {_current().path} holds a {real.__name__} "
                                      "with a state pickle cannot apply")
            for key, value in slots.items():
                object.__setattr__(self, key, _placed(value))

    return type(real.__name__, (real,), {"__new__": __new__, "__setstate__": __setstate__, "_real": real,
                                         "__module__": __name__})


def _value_stand_in(real: Any, name: str) -> type:
    def __setstate__(self: Any, state: Any = _MISSING) -> None:
        raise _refuse_build(f"a shared {name}" if state is not _MISSING else f"{name} itself")

    def make(*args: Any) -> Any:  # a closure: staticmethod(real) would write __annotations__ into real
        return real(*args)

    return type(name, (_Value,), {"__slots__": (), "make": staticmethod(make), "__setstate__": __setstate__,
                                  "__module__": __name__})


def _resolve(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


#: What :class:`MetadataUnpickler` hands pickle for each allowed global (see its docstring)
_STAND_INS: dict[tuple[str, str], Any] = {}


def _stand_in(module: str, name: str) -> Any:
    key = (module, name)
    found = _STAND_INS.get(key)
    if found is None:
        real = _resolve(module, name)
        if key in _IMMUTABLE:
            found = real
        elif dataclasses.is_dataclass(real):
            found = _dataclass_stand_in(real)
        else:
            found = _value_stand_in(real, name)
        _STAND_INS[key] = found
    return found


#: Allowed globals pickle may have as they are: types whose attributes cannot be set (CPython's
#: "immutable type") and whose instances have no attributes to set either, or are made fresh
_IMMUTABLE = frozenset({("torch", "Size"), ("collections", "OrderedDict")})


class MetadataUnpickler(pickle.Unpickler):
    """Reads a DCP metadata file without running code from it or changing anything that exists.

    Pickle can only reach what :meth:`find_class` gives it, and this gives it none of the real
    objects it could change: DCP's metadata dataclasses come as subclasses whose pickle BUILD
    applies the state to the fresh instance only and refuses the class itself (they become the
    real classes once the file is read); an enum member, a layout or a path comes as a stand-in
    of the call, made real inside the dataclass that holds it, so that BUILD never reaches the
    shared enum member that calling the enum returns; ``torch.Size``, ``OrderedDict`` (immutable
    types) and dtypes (no attributes to set) come as they are. Any other global is refused.

    C's unpickler, not the pure-Python one that could check each BUILD itself: that one took
    about 10x plain pickle's time (73 ms for a 40-layer model's metadata on the CPU box, more than
    a third of the load's gap to ``dcp.load`` on the GPU box)."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _stand_in(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # not torch's lazy __getattr__
            return vars(torch)[name]
        raise CheckpointError(f"refused to load {self._path}: it names the Python object {module}.{name}, "
                              "which a checkpoint's metadata never holds, and unpickling it could run code. "
                              "Only load checkpoints written by save_checkpoint or torch.distributed.checkpoint")

    def load(self) -> Any:
        read, outer = _Load(self._path), getattr(_CURRENT, "load", None)
        _CURRENT.load = read
        try:
            metadata = super().load()
        finally:
            _CURRENT.load = outer
        if read.unplaced:
            raise CheckpointError(f"refused to load {self._path}: it holds {read.unplaced} value(s) outside "
                                  "the fields of DCP's metadata classes, where a checkpoint's metadata never has them")
        for made in read.built:
            # the real dataclass (the same layout, its state in place); past a frozen one's __setattr__
            object.__setattr__(made, "__class__", type(made)._real)
        _check_values(metadata, self._path)
        return metadata


#: What a DCP metadata holds besides containers and its dataclasses: values with nothing in them
#: to check (a torch.Size holds ints: its constructor takes nothing else)
_PLAIN = frozenset({str, int, float, bool, type(None), bytes, torch.dtype, torch.layout, torch.memory_format,
                    torch.Size})


def _check_values(metadata: Any, path: str) -> None:
    """Refuse a result that holds anything but plain values, containers, paths and DCP's own
    dataclasses: a class (pickle can put a global anywhere as a value, and DCP sets attributes on
    what it finds, ``storage_meta.load_id``) or a stand-in of this reader (a value placed in a
    dataclass and, through pickle's memo, somewhere else as well)."""
    allowed = {cls._real for cls in _STAND_INS.values() if isinstance(cls, type) and hasattr(cls, "_real")}
    seen: set[int] = set()
    stack = [metadata]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in _PLAIN or id(value) in seen:
            continue
        seen.add(id(value))
        if kind is dict or kind is OrderedDict:
            stack.extend(value.keys())
            stack.extend(value.values())
        elif kind is list or kind is tuple:
            stack.extend(value)
        elif kind in allowed:
            stack.extend(vars(value).values())
        elif not isinstance(value, pathlib.PurePath):
            raise CheckpointError(f"refused to load {path}: it holds a {kind.__qualname__} where DCP's metadata "
                                  "never has one. Only load checkpoints written by save_checkpoint or "
                                  "torch.distributed.checkpoint")


def read_metadata(folder: str, name: str | None = None) -> Any:
    """The DCP ``Metadata`` of ``folder``, unpickled through :class:`MetadataUnpickler`; messages
    name the folder as ``name`` (the user's path, where ``folder`` is a pinned alias of it)."""
    path = os.path.join(folder, METADATA_FILE)
    if name is not None:
        return _renamed(lambda: read_metadata(folder), folder, name)
    try:
        with open(path, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise CheckpointError(f"{path} is not a regular file, so not a checkpoint's metadata")
            metadata = MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is a folder without {METADATA_FILE}, so not a finished sharded "
                              "checkpoint; check the path, or save one first") from None
    except Exception as exc:  # noqa: BLE001 - a crafted file reaches many errors (MemoryError for a huge length, OverflowError, TensorProperties' RuntimeError): each is a bad file
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
