"""Values between the notebook and its ranks, on the notebook's side.

Everything here runs as silent requests through the session (:meth:`Session.run` with
``silent=True``; written by :func:`.requests.request_code`): the relay's plumbing is unchanged,
the requests get the same checks as a cell (no dead or busy rank) and can be interrupted like
one. What a value may be, how it is written and read live in :mod:`clorch_repl.wire.values`, the rank's half in
:mod:`clorch_repl.kernel.transfer`; see :mod:`clorch_repl.wire.values` for why values travel through the
session's private directory with their digest on the signed channel.

* ``pull``: each chosen rank writes its value to a private file and announces the file and its
  SHA-256 in a display message of a private MIME type; :class:`MimeCollector` takes those messages
  out of the stream (they are never shown) and the notebook reads each file with
  ``torch.load(weights_only=True)``.
* ``push``: the notebook writes the value once; every chosen rank checks the digest and reads it.
* ``gather``: ``pull`` of the value the cell just shown on each rank (its ``Out`` entry).
"""

from __future__ import annotations

import json
import keyword
import logging
import os
import pickle
import re
import secrets
from typing import Any, Callable

from ..common import workdir
from ..common.atomic import remove_quietly
from ..errors import ClorchError, ConfigError, DistributedCellError
from ..wire import values
from .hooks import ShowOutput, plain_output
from .protocol import CellOutcome, RankOutput
from ..wire.requests import request_code
from .session import Session

logger = logging.getLogger(__name__)

#: Time allowed for one transfer request (writing, reading and hashing a value of the default
#: limit takes a few seconds; an interrupt stops it earlier).
TRANSFER_TIMEOUT_S = 600.0


#: Names IPython keeps in a kernel's namespace (its ``user_ns_hidden``, the output history and
#: what ``!cmd`` sets): bound to a value, ``get_ipython`` made every later magic fail.
IPYTHON_NAMES = frozenset({"get_ipython", "display", "exit", "quit", "open", "In", "Out", "_ih", "_oh", "_dh",
                           "_", "__", "___", "_i", "_ii", "_iii", "_exit_code", "_ip"})
_HISTORY = re.compile(r"_i?\d+")  # _5, _i5: IPython's numbered output and input history


def check_name(name: str, what: str = "NAME", where: str = "in the notebook") -> str:
    """``name`` if it may be bound ``where``: the one rule for every name clorch binds in a
    namespace (``%clorch pull``'s and ``--gather``'s in the notebook, ``%clorch push``'s on the
    ranks). A Python name, and not one IPython keeps there (``get_ipython``, ``In``, ``_5``, ...),
    whose binding broke every later magic: refused in one line. A builtin's name (``input``,
    ``sum``) is taken, as an assignment takes it: torch's own code names tensors ``input``, and
    ``pull`` has no other name to give a rank's variable (a review of the first rule, which refused
    them too)."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(f"{what} must be a Python variable name; got {name!r}")
    if name in IPYTHON_NAMES or _HISTORY.fullmatch(name) or (name.startswith("__") and name.endswith("__")):
        raise ConfigError(f"{what} {name!r} is one of IPython's own names (like get_ipython, In, Out, _ih, exit): "
                          f"binding it {where} would break IPython there; choose another name")
    return name


class MimeCollector:
    """Takes the ranks' announcements of one private MIME type out of the output (they are never
    shown: value transfers here, profile summaries in :mod:`clorch_repl.session.profile`) and
    passes everything else on to the display ``show`` makes."""

    def __init__(self, ranks: tuple[int, ...], mime: str = values.MIME, show: ShowOutput = plain_output) -> None:
        self.found: dict[int, dict[str, Any]] = {}
        self.mime = mime
        self.display = show(ranks)

    def output(self, item: RankOutput) -> None:
        data = item.content.get("data") or {}
        if item.kind == "display_data" and self.mime in data:
            self.found[item.rank] = json.loads(data[self.mime])
            return
        self.display.output(item)

    def flush(self, final: bool = False) -> None:
        self.display.flush(final)

    def comm(self, rank: int, deliver: Callable[[], None]) -> None:
        """A rank's widget message during a transfer (a tqdm.auto bar): in order, with its output."""
        self.display.comm(rank, deliver)

    def notice(self, text: str) -> None:
        self.display.notice(text)


def _fail(what: str, outcome: CellOutcome) -> ClorchError:
    return ClorchError(f"{what} failed: {DistributedCellError(outcome).summary()}")


def pull(session: Session, name: str | None, ranks: list[int] | None, limit: int,
         what: str | None = None, *, show: ShowOutput = plain_output) -> dict[int, Any]:
    """``{rank: value}`` of ``name`` on each chosen rank (``None``: the last cell's value); what
    the ranks print meanwhile goes to ``show``'s output hook."""
    what = what or f"%clorch pull {name}"
    workdir.torch_importable(what)  # (reading the values imports it)
    chosen = session.chosen(ranks)
    directory = session.value_dir()
    token = secrets.token_hex(8)
    paths = {r: values.rank_file(directory, token, r) for r in chosen}
    # One request for every rank (one per rank would serialise them): each rank writes the file
    # of its own RANK, by the same rule.
    code = request_code("export_value", name=name, folder=directory, token=token, limit=int(limit))
    collector = MimeCollector(chosen, show=show)
    try:
        outcome = session.run(code, list(chosen), TRANSFER_TIMEOUT_S, collector, silent=True)
        if not outcome.ok:
            raise _fail(what, outcome)
        result: dict[int, Any] = {}
        for rank in chosen:
            note = collector.found.get(rank)
            if note is None or note.get("path") != paths[rank]:
                raise ClorchError(f"{what} failed: rank {rank} did not report its value; "
                                  f"%clorch logs {rank} shows what it printed")
            try:
                result[rank] = values.load(paths[rank], note["sha256"], f"rank {rank}'s value", limit)
            except (values.TransferError, pickle.UnpicklingError) as exc:  # never expected from our ranks
                raise ClorchError(f"{what} failed: {exc}") from None
        return result
    finally:
        for path in paths.values():
            remove_quietly(path)


def push(session: Session, name: str, value: Any, ranks: list[int] | None, limit: int, *,
         show: ShowOutput = plain_output) -> tuple[int, ...]:
    """Give every chosen rank ``value`` as ``name``; returns the ranks."""
    workdir.torch_importable(f"%clorch push {name}")  # (writing the value imports it)
    chosen = session.chosen(ranks)
    path = os.path.join(session.value_dir(), f"value-{secrets.token_hex(8)}-push.pt")
    try:
        try:
            _, digest = values.save(value, path, limit, name)
        except values.TransferError as exc:
            raise ClorchError(f"%clorch push {name}: {exc}") from None
        code = request_code("import_value", name=name, path=path, sha256=digest)
        outcome = session.run(code, list(chosen), TRANSFER_TIMEOUT_S, show(chosen), silent=True)
        if not outcome.ok:
            raise _fail(f"%clorch push {name}", outcome)
        return chosen
    finally:
        remove_quietly(path)
