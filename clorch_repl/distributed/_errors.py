"""Errors specific to collectives and batch jobs; all derive from :class:`ClorchError`.

They live here rather than in ``clorch_repl.errors`` because only this subpackage raises them; the
package's base classes stay the one thing callers must know to catch everything.
"""

from __future__ import annotations

from ..errors import ClorchError


class CollectiveError(ClorchError):
    """A collective failed; the message says which one, on which rank, and what to look at."""


class CollectiveMismatch(CollectiveError):
    """Ranks called a collective with tensors that do not fit together.

    ``ranks`` lists the ranks whose call differs from the others (empty when the problem was found
    locally, before anything was sent).
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class CollectiveTimeout(CollectiveError, TimeoutError):
    """``work.wait(timeout=...)`` ran out, or the process group's own timeout expired."""


class NoProcessGroup(ClorchError):
    """A collective was called outside any process group."""


class JobTimeout(ClorchError, TimeoutError):
    """A batch job ran past its ``timeout_ms`` and was stopped."""


class JobStopped(ClorchError):
    """A batch job was ended by ``job.stop()`` before its ranks finished."""
