"""Old home of the collectives' and jobs' errors, now in :mod:`clorch_repl.errors`; kept only until
``distributed/launch.py`` imports them from there (then delete this file)."""
from ..errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, JobStopped, JobTimeout, NoProcessGroup  # noqa: F401
