"""Exceptions that reach users.

Every error clorch_repl raises on purpose derives from :class:`ClorchError`, so callers can catch
the package's failures without catching programming mistakes. Messages follow one rule: say what
went wrong, on which rank where there is one, and what to do next.
"""

from __future__ import annotations


class ClorchError(RuntimeError):
    """Base class of every error clorch_repl raises on purpose."""


class ConfigError(ClorchError, ValueError):
    """Bad input, refused before any process starts."""


class RankFailure(ClorchError):
    """One or more ranks failed; ``rank`` is the first that failed (the cause, not the cascade)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
