"""Name a rank's cell files in faulthandler's stacks as the notebook names the cells: ``Cell In[12]``.

A rank's kernel compiles each cell into a file named by ipykernel's compiler: a hash of the cell's
text, in a folder the rank chose (``/tmp/clorch_cells_1000/2936192014.py``, the same on every
rank of the user's, :mod:`clorch_repl.kernel.cell_files`; ipykernel's own ``<tmp>/ipykernel_<pid>/``
where that one is not safe to use). A file is known by its name alone, the hash of a cell this
notebook sent that rank, whatever its folder: the notebook need not know the rank's. IPython's own
tracebacks, and the hang check's stacks (taken by the rank itself, see
:mod:`clorch_repl.diagnosis.probe`), turn that back into ``Cell In[12]``. faulthandler cannot: it
writes from a C signal handler, the only stack a rank gives while native code holds its Python
lock (a stuck rank's report, the hang check's fallback) or as it crashes (a death report). Those
texts reach the notebook, which knows what it sent as each cell, so it names them there.

The hash is computed only when a stack names such a file (rarely), newest cell first; a cell run
again under a new number takes the newer one, as IPython's own naming does. Per rank: the same
text run as cell 3 on every rank and as cell 4 on rank 1 alone (``--ranks 1``) is cell 3 on rank 0.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable

logger = logging.getLogger(__name__)

#: Cells remembered (their text is held, hashed only when a stack needs a name): a stack names the
#: cell that runs and those whose functions it calls, seldom one from hundreds of cells ago.
KEPT = 300

#: faulthandler's frame line of a file named as a cell's: ``  File "/tmp/clorch_cells_1000/2936192014.py",
#: line 3 in <module>`` (renamed only where the number is the hash of a cell the rank ran)
_CELL_FILE = re.compile(r'File "([^"]*[/\\](\d+)\.py)", line (\d+)')


def _cell_hash(code: str) -> int | None:
    """The number ipykernel's compiler names the cell's file by (see ``ipykernel.compiler``)."""
    try:
        from ipykernel.compiler import get_tmp_hash_seed, murmur2_x86
    except ImportError as exc:  # an ipykernel that names cells otherwise: paths stay as they are
        logger.debug("cannot name cell files: %s", exc)
        return None
    return murmur2_x86(code, get_tmp_hash_seed())


class CellNames:
    """The notebook's recent cells (text, number, ranks), to name their files in a rank's stacks."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        #: text -> rank -> the newest number that rank ran it as; oldest text first
        self._cells: OrderedDict[str, dict[int, int]] = OrderedDict()
        self._hashes: dict[str, int | None] = {}

    def add(self, code: str, number: int, ranks: Iterable[int]) -> None:
        """``code`` ran as cell ``number`` on ``ranks`` (called per cell: no hashing here)."""
        self._cells.setdefault(code, {}).update(dict.fromkeys(ranks, number))
        self._cells.move_to_end(code)
        while len(self._cells) > self._kept:
            old, _ = self._cells.popitem(last=False)
            self._hashes.pop(old, None)

    def number_of(self, file_hash: int, rank: int) -> int | None:
        """The number of the newest cell ``rank`` ran whose file carries ``file_hash``."""
        for code in reversed(self._cells):
            numbers = self._cells[code]
            if rank not in numbers:
                continue
            if code not in self._hashes:
                self._hashes[code] = _cell_hash(code)
            if self._hashes[code] == file_hash:
                return numbers[rank]
        return None

    def name(self, text: str, rank: int) -> str:
        """``text`` (a faulthandler stack or a log's tail of ``rank``) with each cell file it
        ran named ``Cell In[N]`` as the notebook shows it; unknown files (cells of another
        client, of clorch itself) keep their path."""
        def named(match: re.Match[str]) -> str:
            number = self.number_of(int(match.group(2)), rank)
            if number is None:
                return match.group(0)
            return f'File "Cell In[{number}]", line {match.group(3)}'
        return _CELL_FILE.sub(named, text)
