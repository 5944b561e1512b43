"""Values that travel between the notebook and its ranks (``%clorch pull/push``, ``--gather``):
what may travel, how it is written and read. The notebook's half of a transfer is
:mod:`clorch_repl.session.transfer`, the rank's :mod:`clorch_repl.kernel.transfer`.

Both the notebook and every rank import this module, so the rules about what may travel live in
one place:

* **Only data, never code.** A value is written with ``torch.save`` and read back with
  ``torch.load(weights_only=True)``, whose unpickler builds tensors, numbers, strings, bytes,
  ``None``, dicts, lists, tuples and sets and refuses everything else, so loading a file cannot
  run code. :func:`check_sendable` refuses other types before anything is written, with the
  path inside the value (``value['model']``) and the type, so the user learns what to convert.
* **Through the session's private directory.** The bytes go through a file in the session's
  0700 directory (created 0600, exclusively), not through the channels: a 256 MB tensor as
  base64 JSON would hold the notebook's event loop for seconds and quadruple its memory. The
  file's SHA-256 travels over the HMAC-signed channel and is checked before the file is read.
* **Bounded.** :func:`estimate_bytes` refuses a value over the limit before it is written, and
  the written size is checked again.

Tensors travel on the CPU: a rank moves them off its GPU before saving, so the notebook (which
must not initialise CUDA) never sees a CUDA tensor; views are copied so that a small slice of a
huge tensor does not carry the whole storage.
"""

from __future__ import annotations

import collections
import hashlib
import io
import logging
import os
from typing import Any

from ..common.atomic import remove_quietly

logger = logging.getLogger(__name__)

#: Private MIME type of the display message in which a rank reports a value it wrote. The
#: notebook's transfer sink consumes it; it is never shown.
MIME = "application/x-clorch-value+json"
#: Default limit on one rank's value, in bytes (``--max-mb`` changes it per command).
DEFAULT_LIMIT_BYTES = 256_000_000

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set)
SENDABLE = ("tensors, numbers, strings, bytes, None, torch.Size/dtype/device, and dicts, lists, "
            "tuples and sets of these")


class TransferError(Exception):
    """A value that cannot travel: the wrong type, too large, or a file that does not match."""


def check_sendable(value: Any, where: str) -> None:
    """Raise :class:`TransferError` naming the first part of ``value`` that may not travel."""
    import torch

    stack: list[int] = []

    def visit(obj: Any, path: str) -> None:
        kind = type(obj)
        if kind in _SCALARS or kind in (torch.Size, torch.dtype, torch.device):
            return
        if isinstance(obj, torch.Tensor):
            if kind not in (torch.Tensor, torch.nn.Parameter):
                raise TransferError(f"{path} is a {_type_name(obj)}, a tensor subclass, which cannot be sent; "
                                    "send a plain tensor (e.g. .full_tensor() or .to_local()) instead")
            return
        if kind not in _CONTAINERS:
            raise TransferError(f"{path} is a {_type_name(obj)}, which cannot be sent: only {SENDABLE} can "
                                "(convert it first, e.g. torch.from_numpy(a), or obj.state_dict())")
        if id(obj) in stack:
            raise TransferError(f"{path} contains itself, which cannot be sent")
        stack.append(id(obj))
        if isinstance(obj, dict):
            for key, item in obj.items():
                visit(key, f"a key of {path}")
                visit(item, f"{path}[{key!r}]")
        else:
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]")
        stack.pop()

    visit(value, where)


def estimate_bytes(value: Any) -> int:
    """About what ``torch.save`` will write for a value that passed :func:`check_sendable`."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(estimate_bytes(k) + estimate_bytes(v) + 16 for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return sum(estimate_bytes(v) + 8 for v in value)
    return 16


def check_size(nbytes: int, limit: int, where: str) -> None:
    if nbytes > limit:
        raise TransferError(f"{where} is {_mb(nbytes)}, over the limit of {_mb(limit)}; send less "
                            "(a slice, a summary) or raise the limit with --max-mb")


def to_cpu(value: Any) -> Any:
    """The value with every tensor detached, on the CPU, and owning only its own elements."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view: do not carry the rest of its storage
        return tensor
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return type(value)(to_cpu(v) for v in value)
    return value


def save(value: Any, path: str, limit: int, where: str) -> tuple[int, str]:
    """Check, then write ``value`` to a new private file; returns its size and SHA-256."""
    import torch

    check_sendable(value, where)
    check_size(estimate_bytes(value), limit, where)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(to_cpu(value), fh)
        nbytes = os.path.getsize(path)
        check_size(nbytes, limit, where)
        return nbytes, _sha256(path)
    except BaseException:
        remove_quietly(path)
        raise


def load(path: str, sha256: str, where: str, limit: int | None = None) -> Any:
    """Read a value written by :func:`save`, after checking it is the file that was announced.

    The file is read once: the bytes that were hashed are the bytes that are loaded, so the file
    cannot change between the check and the load. With ``limit``, a file over it is refused
    before it is read (the side that reads it must not trust the writer's own check).
    """
    import torch

    with open(path, "rb") as fh:
        if limit is not None:
            check_size(os.fstat(fh.fileno()).st_size, limit, where)
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise TransferError(f"{where}: the file {path} does not match what was sent (changed on disk?)")
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def rank_file(folder: str, token: str, rank: int | str) -> str:
    """Where rank ``rank`` writes its value of one ``%clorch pull`` (``token``: that pull's), in
    the session's private ``folder``: the notebook names the files it will read, each rank the
    one it writes (:func:`clorch_repl.kernel.transfer.export_value`), from the same rule."""
    return os.path.join(folder, f"value-{token}-rank{rank}.pt")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"
