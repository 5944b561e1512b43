"""What torch's error messages say when a peer went away, a wait ran out, or tensors did not fit.

One list of each, read in two places: :mod:`.collectives` turns a failed collective into an error
that says what probably happened, and a launched rank (:mod:`clorch_repl.jobs._rank_entry`) marks its failure as
a *cascade* (it followed another rank's failure) or a cause, so that the job names the rank that
failed first. Matching is on lower-cased text; standard library only.
"""

from __future__ import annotations

__all__ = ["PEER_GONE", "TIMED_OUT", "MISMATCH", "peer_gone", "timed_out", "looks_like_cascade"]

#: A peer vanished (crashed, raised, was stopped) or its connection broke.
PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "connection closed",
             "was aborted", "remote process exited", "nccl communicator", "went away", "socket", "no route")
#: A collective or wait timed out, usually because a peer never came.
TIMED_OUT = ("timed out", "timeout")
#: The tensors' shapes, dtypes or split sizes did not fit the collective.
MISMATCH = ("size", "shape", "split", "type", "dtype", "mismatch", "check failed", "expected")


def peer_gone(text: str) -> bool:
    low = text.lower()
    return any(marker in low for marker in PEER_GONE)


def timed_out(text: str) -> bool:
    low = text.lower()
    return any(marker in low for marker in TIMED_OUT)


def looks_like_cascade(error_type: str, message: str) -> bool:
    """True when a rank's error usually follows another rank's failure rather than causes one."""
    text = f"{error_type} {message}"
    return peer_gone(text) or timed_out(text)
