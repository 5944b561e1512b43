"""IPython's static input transforms, remembered per cell text on a rank (issue 39).

Every cell a rank runs first goes through IPython's ``TransformerManager.transform_cell``: the
cell is split, its prompts and indentation cleaned, ``%%magic`` and ``!``/``%``/``?`` lines
rewritten, and it is tokenized at least once. That is 44 us of the 0.5 ms of CPU that an empty
cell (``pass``) cost a rank on the 2-core box (a scratch timing inside a rank, 2,000 cells), and
it grows with the cell: the whole cell is tokenized. A ``%%distributed`` cell is typically run
again and again (a training step, a check, the benchmark's empty cell), and at 64 ranks on 16
cores every rank's CPU per cell is on the path of every cell.

These transforms are a function of the text alone (IPython's own: prompt strippers, the cell
magic rule, the escaped commands, ``= %`` and ``= !`` assignments, ``?`` help), so their result
for a text seen before is reused. Only while the manager holds exactly the transforms it held
when the memo was installed: a transform a user or an extension registers later may depend on
anything, so from then on every cell is transformed afresh. The dynamic part (IPython's
prefilter: automagic, autocall, macros, which depends on the user's namespace) is not here and
still runs for every single-line cell, in ``InteractiveShell.transform_cell``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: how many distinct cell texts are remembered (the most recently used ones)
ENTRIES = 32
#: longer cells are transformed every time: memory (the text and its result are kept) for a
#: saving that matters little next to running such a cell
MAX_CHARS = 256 * 1024


def _transforms(manager: Any) -> tuple[tuple, tuple, tuple]:
    return (tuple(manager.cleanup_transforms), tuple(manager.line_transforms),
            tuple(manager.token_transformers))


class StaticTransformMemo:
    """Stands in for one ``TransformerManager``'s ``transform_cell`` (an instance attribute over
    the class's method): the remembered result of a text seen before while the manager's
    transforms are the ones it had at :func:`install`, the class's method otherwise."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.transform: Callable[[str], str] = type(manager).transform_cell.__get__(manager)
        self.expected = _transforms(manager)
        #: the most recent texts' results (functools' C cache: thread-safe, a dict look-up a hit)
        self.remembered = functools.lru_cache(maxsize=ENTRIES)(self._transform)

    def _transform(self, cell: str) -> str:
        return self.transform(cell)

    def __call__(self, cell: str) -> str:
        if not isinstance(cell, str) or len(cell) > MAX_CHARS:
            return self.transform(cell)
        if _transforms(self.manager) != self.expected:
            if self.remembered.cache_info().currsize:
                logger.debug("the cell transforms changed: each cell is transformed afresh from now on")
                self.remembered.cache_clear()
            return self.transform(cell)
        return self.remembered(cell)


def install(shell: Any) -> StaticTransformMemo | None:
    """Remember ``shell``'s static transforms per text (see the module's docstring); None where
    the shell has no such manager or it already has a ``transform_cell`` of its own."""
    manager = getattr(shell, "input_transformer_manager", None)
    if manager is None or "transform_cell" in vars(manager) or not hasattr(type(manager), "transform_cell"):
        return None
    memo = StaticTransformMemo(manager)
    manager.transform_cell = memo
    return memo
