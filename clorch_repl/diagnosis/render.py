"""The verdict and its evidence as text: what the live notice, the failure reports and
``%clorch why`` print."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

from ..common.human import headline
from ..host.rankfiles import report_stack
from ..common.rank_sets import merge_blocks, rank_words
from .deaths import lost_members
from .entries import Entry, RankEvidence, Verdict, describe_tensors, entries_of, unrecorded_pending
from .where import frame_label, own_frame, reporting_error

logger = logging.getLogger(__name__)

#: Collectives listed per rank as evidence.
RECENT = 5
#: Stack frames listed per rank (innermost); a cell's stack is rarely deeper.
FRAMES = 12
#: Characters of a raised exception's message said in a verdict (:func:`with_raised`).
RAISED_CHARS = 100


def notice(verdict: Verdict) -> str:
    """The one line printed into a running cell."""
    if verdict.held and set(verdict.missing) <= set(verdict.held):
        # Only ranks the user holds at a prompt keep the others waiting: no hang.
        return f"clorch: not a hang, waiting for your answer; {verdict.sentence}"
    return f"clorch: no progress on any rank; {verdict.sentence}"


def evidence(states: list[RankEvidence], *, all_threads: bool = False, recent: int = RECENT,
             shown: list[int] | None = None) -> list[str]:
    """Per rank: its last collectives (op, sequence number, tensors, state) and its stack; ranks
    of one host whose evidence reads the same (three ranks waiting in the same all_reduce at the
    same line) once, under one heading (``---- ranks 0,2-3 ----``), so the rank that differs is
    not buried between copies. ``states``: every rank's evidence, which a rank's reads are
    weighed against (a peer's death); ``shown``: the ranks whose evidence is shown (None: all)."""
    blocks = [(state.rank, (state.host, tuple(_block(state, all_threads=all_threads, recent=recent,
                                                      lost=lambda e, s=state: lost_members(s, e, states)))))
              for state in states if shown is None or state.rank in shown]
    lines: list[str] = []
    for ranks, (host, body) in merge_blocks(blocks):
        lines.append(f"---- {rank_words(ranks)}{f' on {host}' if host else ''} ----")
        lines.extend(body)
    return lines


def _block(state: RankEvidence, *, all_threads: bool, recent: int,
           lost: Callable[[Entry], list[int]] = lambda e: []) -> list[str]:
    """One rank's evidence, below its heading; ``lost(entry)``: the dead members of the entry's
    group whose death may have ended it (:func:`~.deaths.lost_members`)."""
    lines: list[str] = []
    if state.dead is not None:
        return [f"  died ({state.dead})"]
    if not state.answered:
        err = (state.answer or {}).get("error")
        lines.append(f"  did not answer{f': {err}' if err else ''}")
        if state.fallback_stack:
            lines.append("  its stack (faulthandler):")
            lines.extend("    " + line for line in report_stack(state.fallback_stack))
        return lines
    ans: dict[str, Any] = state.answer or {}
    if ans.get("fr") is None:
        lines.append(f"  collectives: unknown ({ans.get('fr_missing')})")
    else:
        entries = entries_of(state)[-recent:]
        lines.append("  last collectives:" if entries else "  no collective recorded")
        last = {e.pg: e for e in entries}
        for e in entries:
            state_word = _state_word(e, lost(e) if last[e.pg] is e else [])
            lines.append(f"    {e.op} #{e.seq} ({describe_tensors(e.raw) or 'no tensor'}) "
                         f"group {e.pg}: {state_word}")
        for gone in unrecorded_pending(state):
            lines.append(f"    {gone.key}: operation {gone.enqueued} (its group's own count) pending, every "
                         f"entry of the group gone from the recorder (last completed: {gone.completed})")
    stack = ans.get("stack") or []
    others = [f for f in stack if not own_frame(f)]  # (clorch's own frames are never shown)
    if ans.get("in_cell") and reporting_error(stack):
        lines.append("  its cell had already failed (its traceback is among the cell's errors)")
    elif ans.get("in_cell") and others and all(f.get("library") for f in others):
        # IPython formatting the cell's traceback, say: a dozen frames of pygments or
        # stack_data would bury the other ranks' evidence; the two ends say where it is.
        inner = f" ... {frame_label(others[-1])}" if len(others) > 1 else ""
        lines.append(f"  in library code outside its cell's lines: {frame_label(others[0])}{inner}")
    elif ans.get("in_cell"):
        lines.extend(_stack_lines("  stack", stack, order=" (most recent call last)"))
    else:
        lines.append("  idle: not running a cell")
    if ans.get("cuda_busy") is not None:
        lines.append(f"  CUDA stream busy: {'yes' if ans['cuda_busy'] else 'no'}")
    if all_threads:
        for thread in ans.get("threads") or []:
            lines.extend(_thread_lines(thread))
    return lines


def _state_word(entry: Entry, lost: list[int]) -> str:
    """``completed``, ``scheduled``...; for a rank's last collective of a group that lost members
    (``lost``, dead ranks), ``ended`` and why it may have failed: gloo fails a collective whose
    peer died, and torch's flight recorder retires a failed collective as it does a finished
    one, so "completed" beside "rank 1 died" read as if the collective had worked."""
    if not entry.completed:
        return str(entry.raw.get("state") or "scheduled")
    if lost:
        return f"ended, perhaps failed ({rank_words(lost)} of its group died)"
    return "completed"


def _thread_lines(thread: dict[str, Any]) -> list[str]:
    """One thread of ``--all-threads``: its stack without clorch_repl's frames, by the one test
    the main thread's stack uses (:func:`own_frame`, in :func:`_stack_lines`).

    A thread doing only clorch's own work (clorch frames, and no line of the user's code: the
    control thread answering this very probe, a watcher of the rank's kernel) is summarised in one
    line rather than left out: its name still says it is there, and where it waits when that is a
    library's line (a save thread inside torch, say); its stack, clorch's frames left out, would be
    threading's and zmq's bare frames, which say nothing and bury the user's threads."""
    name = thread.get("name")
    stack = thread.get("stack") or []
    if any(own_frame(f) for f in stack) and all(f.get("library") or own_frame(f) for f in stack):
        inner = stack[-1]
        at = "" if own_frame(inner) else f", now at {frame_label(inner)}"
        return [f"  thread {name}: clorch_repl's own work (its frames not shown){at}"]
    return _stack_lines(f"  thread {name}", stack)


def _stack_lines(name: str, stack: list[dict[str, Any]], order: str = "") -> list[str]:
    """``name`` and ``order`` (`` (most recent call last)``) as a heading, then the stack's
    innermost :data:`FRAMES` frames, clorch's own left out; where none is left, one line saying
    why (``name: ...``): a heading with nothing under it read as evidence lost (a try-out's
    report of a survivor)."""
    frames = [f for f in stack if not own_frame(f)][-FRAMES:]
    if not frames:
        why = ("only clorch_repl's own frames (not shown)" if stack else
               "no frame of its cell's code (the cell had not begun it, or had just left it)")
        return [f"{name}: {why}"]
    out = [f"{name}{order}:"]
    for frame in frames:
        out.append(f"    {frame_label(frame)}")
        if frame.get("code"):
            out.append(f"      {frame['code']}")
    return out


def report(verdict: Verdict, states: list[RankEvidence], *, all_threads: bool = False,
           shown: list[int] | None = None) -> str:
    """Verdict, then evidence: the text of ``%clorch why`` and of a failed cell's diagnosis.
    ``states``: every rank's, as the verdict was made of; ``shown``: whose evidence is shown
    (``%clorch why --rank``; None: every rank's)."""
    return "\n".join([verdict.sentence, *evidence(states, all_threads=all_threads, shown=shown)])


def with_raised(states: list[RankEvidence], raised: dict[int, tuple[str, str]]) -> list[RankEvidence]:
    """``states`` with what ranks raised in the cell (``raised``: rank -> exception name and
    message, from their replies), for the verdict to say "rank 1 raised RuntimeError (data file
    missing on rank 1) before calling it" where the probe alone, asking after the rank had gone
    back to its prompt, said "rank 1 never called it and is not running a cell", and the cause
    was found only below every rank's evidence (a try-out)."""
    return [replace(s, raised=_raised_words(*raised[s.rank])) if s.rank in raised else s for s in states]


def _raised_words(ename: str, evalue: str) -> str:
    """``RuntimeError (data file missing on rank 1)``: the exception's name and its message's first
    line, cut to a verdict's measure (the whole traceback is shown with the cell's errors)."""
    message = headline(evalue, limit=RAISED_CHARS)
    return f"{ename or 'an exception'} ({message})" if message else (ename or "an exception")
