"""The rank's half of a value transfer (``%clorch pull/push``, ``--gather``): the rank writes a
value of its namespace to a private file and announces it, or reads the notebook's file into its
namespace. What may travel and how it is written and read is :mod:`clorch_repl.wire.values`
(shared with the notebook); the notebook's half is :mod:`clorch_repl.session.transfer`.
"""

from __future__ import annotations

import json
import logging
import os

from ..wire.values import MIME, load, rank_file, save
from .shell import rank_shell

logger = logging.getLogger(__name__)


def export_value(name: str | None, folder: str, token: str, limit: int) -> None:
    """Write the rank's ``name`` (or, for ``None``, the value of its last cell) to its own file
    of this pull (:func:`~clorch_repl.wire.values.rank_file` of its ``RANK``: one request
    serves every rank) and announce it, with its digest, in a private display message the
    notebook consumes."""
    path = rank_file(folder, token, os.environ["RANK"])
    shell = rank_shell("a value's export")
    if name is None:
        count = shell.execution_count - 1  # the cell that just ran (silent requests do not count)
        value = shell.user_ns.get("Out", {}).get(count)
        where = "the cell's value"
    else:
        if name not in shell.user_ns:
            raise NameError(f"name {name!r} is not defined")
        value = shell.user_ns[name]
        where = name
    nbytes, digest = save(value, path, limit, where)
    shell.display_pub.publish(data={MIME: json.dumps({"path": path, "sha256": digest, "nbytes": nbytes})},
                              metadata={})


def import_value(name: str, path: str, sha256: str) -> None:
    """Put the value the notebook wrote to ``path`` into the rank's namespace as ``name``."""
    shell = rank_shell("a value's import")
    shell.user_ns[name] = load(path, sha256, name)
