"""Line up what every rank answered and name the first collective the ranks disagree on.

Entries are keyed by process group and collective sequence number (torch numbers the collectives
of each group 1, 2, 3... on every rank alike). Per group, the first sequence number at which a
collective is pending on some rank and absent on another (a rank never called it), or at which the
ranks called different ops, shapes or dtypes, is the cause; the ranks' stacks say where the others
are. The comparison of two entries is torch's own (``flight_recorder``'s ``Op.match``); torch's
``build_db`` is not used for the rest because it works on complete dump files of every rank,
prints as it goes, and has no notion of a rank that is alive but outside any collective, which is
exactly what a notebook user needs to hear about.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from ..common.rank_sets import merge_blocks, rank_words
from .deaths import ended_by
from .entries import (Entry, CollectiveProgress, RankEvidence, Verdict, entries_of, group_label, members_of,
                      progress, unrecorded_pending)
from .where import where

#: what other modules take from here: the verdict and the records it is made of
__all__ = ["CollectiveProgress", "RankEvidence", "Verdict", "analyse", "progress"]

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ analysis
def analyse(states: list[RankEvidence]) -> Verdict:
    """The verdict for ranks ``states`` (every rank that runs, or ran, the cell)."""
    by_pg: dict[tuple[str, str], dict[int, dict[int, Entry]]] = {}
    for state in states:
        for entry in entries_of(state):
            by_pg.setdefault((entry.pg, entry.recorder), {}).setdefault(state.rank, {})[entry.seq] = entry
    problems = []
    for (pg, _recorder), per_rank in by_pg.items():
        found = _first_disagreement(pg, per_rank, states)
        if found is not None:
            problems.append(found)
    if problems:
        # The oldest pending collective is the cause; the others usually wait behind it.
        problems.sort(key=lambda p: (not p.hang, p.entered_ns or 0))
        verdict = problems[0]
    else:
        verdict = _pushed_out(states) or _no_collective(states)
    unrecorded = [s for s in states if s.answered and s.answer.get("fr") is None]
    if unrecorded:
        # Said with every verdict it weakens: the rest stands on the ranks' stacks alone.
        why = unrecorded[0].answer.get("fr_missing") or "no flight recorder"
        verdict.sentence += (f" (no collective record from {rank_words([s.rank for s in unrecorded])}: "
                             f"{why}; judged from stacks)")
    return verdict


def _pushed_out(states: list[RankEvidence]) -> Verdict | None:
    """Instead of "no collective is pending", when ranks wait in operations whose entries are gone
    from their flight recorders (see :func:`unrecorded_pending`): which ranks, and where every
    other rank is. No rank is said to be missing from it: which group it is, and so who belongs
    to it, cannot be read back. A hang, but not a sure one (``stuck`` stays false: no live
    notice is given for it); the report of a cell that ends stuck, and ``%clorch why``, say it."""
    waiting = {s.rank: items for s in states if (items := unrecorded_pending(s))}
    if not waiting:
        return None
    first = waiting[min(waiting)][0]
    verb = "waits" if len(waiting) == 1 else "wait"
    clauses = [f"{rank_words(sorted(waiting))} {verb} in an operation whose entries torch's flight recorder no "
               f"longer holds: later entries pushed out every entry of its group ({first.key}; "
               f"TORCH_FR_BUFFER_SIZE={first.capacity} on rank {min(waiting)}, a larger one keeps more)"]
    clauses += by_phrase([s for s in states if s.rank not in waiting], lambda s, many: where(s, many=many))
    by_rank = {s.rank: s for s in states}
    oldest = [int(raw["time_created_ns"]) for r in waiting for raw in by_rank[r].answer["fr"].get("entries", [])
              if raw.get("time_created_ns")]
    ages = [(by_rank[r].answer["now_ns"] - min(oldest)) / 1e9 for r in waiting
            if oldest and "now_ns" in by_rank[r].answer]
    return Verdict(sentence="; ".join(clauses), hang=True, waiting=sorted(waiting),
                   pending_s=min(ages) if ages else None, entered_ns=min(oldest) if oldest else None)


def _first_disagreement(pg: str, per_rank: dict[int, dict[int, Entry]],
                        states: list[RankEvidence]) -> Verdict | None:
    members = members_of(pg, states)
    recorded = [r for r in members if r in per_rank]
    if not recorded:
        return None
    # The ring buffer may have dropped old entries: compare only what every recording rank holds.
    lo = max(min(per_rank[r]) for r in recorded)
    hi = max(max(per_rank[r]) for r in recorded)
    earlier_mismatch: Verdict | None = None
    for seq in range(lo, hi + 1):
        present = {r: per_rank[r][seq] for r in recorded if seq in per_rank[r]}
        pending = sorted(r for r, e in present.items() if not e.completed)
        mismatch = _mismatch(pg, present, members)
        absent = [r for r in members if r not in present]
        if pending:
            verdict = _verdict(pg, seq, present, pending, absent, mismatch, states)
            if earlier_mismatch is not None:
                verdict.sentence += f"; earlier, {earlier_mismatch.sentence}"
                verdict.mismatch = True
            return verdict
        if mismatch is not None and earlier_mismatch is None:
            # It completed anyway (gloo's broadcast does with unequal sizes): worth saying, but a
            # collective still pending later is what holds the cell.
            earlier_mismatch = _verdict(pg, seq, present, pending, absent, mismatch, states)
    return earlier_mismatch


def _mismatch(pg: str, present: dict[int, Entry], members: list[int]) -> str | None:
    """Torch's own comparison of the ranks' entries for one collective; if they differ, a sentence
    that names every rank, grouped by what it called (:func:`mismatch_text`)."""
    if len(present) < 2:
        return None
    groups = alike(present, _comparer(pg, members))
    return mismatch_text([(ranks, present[ranks[0]]) for ranks in groups]) if len(groups) > 1 else None


def _comparer(pg: str, members: list[int]) -> Callable[[Entry, Entry], bool]:
    """Whether two ranks' entries of one collective match: torch's ``Op.match`` where torch is
    already imported, else op and tensors compared ourselves."""
    # Only where torch is already imported: importing it here took the notebook 2.6 s under load,
    # inside the interrupt of a timed-out cell (and ~300 MB of the notebook's memory).
    Op = None  # noqa: N806
    if "torch" in sys.modules:
        try:
            from torch.distributed.flight_recorder.components.types import MatchState, Op
        except ImportError:  # a torch without the analyser: compare op and tensors ourselves
            Op = None  # noqa: N806
    memberships = {pg: set(members)}

    def same(ref: Entry, other: Entry) -> bool:
        if Op is not None:
            try:
                info = Op(_for_torch(ref.raw), memberships, pg).match(Op(_for_torch(other.raw), memberships, pg))
                return info.state in (MatchState.FULLY_MATCHED, MatchState.UNDECIDED,
                                      MatchState.COLLECTIVE_STATE_MISMATCH)
            except (AssertionError, KeyError, ValueError, IndexError, TypeError) as exc:
                logger.debug("torch's Op could not compare %s and %s: %s", ref.raw, other.raw, exc)
        return (ref.op, ref.compared) == (other.op, other.compared)  # (entries.ROOTED_SIDES)
    return same


def alike(present: dict[int, Entry], same: Callable[[Entry, Entry], bool]) -> list[list[int]]:
    """The ranks of ``present`` in groups that called the same (``same`` of the group's lowest
    rank's entry and theirs), in rank order: ``[[0], [1, 2]]`` for a broadcast on rank 0 and an
    all_reduce on ranks 1 and 2. Why groups: compared only with rank 0, the first rank that
    differed was named and a third rank's call was never mentioned."""
    groups: list[list[int]] = []
    for rank in sorted(present):
        home = next((g for g in groups if same(present[g[0]], present[rank])), None)
        if home is None:
            groups.append([rank])
        else:
            home.append(rank)
    return groups


def mismatch_text(groups: list[tuple[list[int], Entry]]) -> str:
    """``rank 0 called broadcast(float32[4]), ranks 1-2 called all_reduce(float32[4])``: each
    group of :func:`alike` with one of its entries. Ops named where they differ; else the
    tensors a broadcast has or another collective was passed, of those its ranks must pass alike
    (a scatter's output, not the list only its source passes: :data:`~.entries.ROOTED_SIDES`)."""
    entries = [entry for _, entry in groups]
    if len({entry.op for entry in entries}) > 1:
        return ", ".join(f"{rank_words(ranks)} called {e.op}({e.tensors})" for ranks, e in groups)
    verb = "has" if entries[0].op == "broadcast" else "passed"
    return ", ".join(f"{rank_words(ranks)} {verb} {e.compared or e.tensors or 'no tensor'}" for ranks, e in groups)


def _for_torch(raw: dict[str, Any]) -> dict[str, Any]:
    """Op wants the dump's field names; the state is our own business (gloo never says started)."""
    event = dict(raw)
    event["state"] = "scheduled"
    event["process_group"] = tuple(raw.get("process_group") or (str(raw.get("pg_id")), ""))
    event.setdefault("frames", [])
    return event


def _verdict(pg: str, seq: int, present: dict[int, Entry], pending: list[int], absent: list[int],
             mismatch: str | None, states: list[RankEvidence]) -> Verdict:
    by_rank = {s.rank: s for s in states}
    ref = present[pending[0]] if pending else present[min(present)]
    group = group_label(pg, states)
    op = ref.op if mismatch is None or "called" not in mismatch else "collective"
    head = f"{op} #{seq} ({ref.tensors + ', ' if ref.tensors and op != 'collective' else ''}{group})"
    clauses = []
    if mismatch is not None:
        clauses.append(mismatch)
    if pending:
        verb = "waits" if len(pending) == 1 else "wait"
        clauses.append(f"{rank_words(pending)} {verb} in it")
    clauses += by_phrase([by_rank[r] for r in absent if r in by_rank],
                         lambda state, many: _absent(state, pg, many))
    ages = [(by_rank[r].answer["now_ns"] - int(present[r].raw.get("time_created_ns") or 0)) / 1e9
            for r in pending if by_rank.get(r) is not None and by_rank[r].answered
            and "now_ns" in by_rank[r].answer]
    return Verdict(sentence=f"{head}: " + "; ".join(clauses), hang=bool(pending), op=op, seq=seq,
                   group=group, waiting=pending, missing=[r for r in absent if r in by_rank],
                   held=[r for r in absent if r in by_rank and (by_rank[r].prompt is not None or by_rank[r].paused)],
                   mismatch=mismatch is not None, pending_s=min(ages) if ages else None,
                   entered_ns=min((int(present[r].raw.get("time_created_ns") or 0) for r in pending), default=None))


def _absent(state: RankEvidence, pg: str, many: bool) -> str:
    """What a member that never called group ``pg``'s pending collective does instead (``many``:
    said of several ranks, see :func:`by_phrase`)."""
    if state.dead is not None or not state.answered:
        return where(state, many=many)
    if state.raised is not None:
        return f"raised {state.raised} before calling it"
    elsewhere = _pending_elsewhere(state, pg)
    if elsewhere is not None:
        return f"never called it and {'wait' if many else 'waits'} in {elsewhere}"
    return f"never called it and {where(state, many=many)}"


def by_phrase(states: list[RankEvidence], phrase: Callable[[RankEvidence, bool], str]) -> list[str]:
    """One clause per set of ranks (of one host) whose phrase is the same, in the order of their
    lowest rank: ``ranks 0-2 are not running a cell`` where the verdicts said ``rank 0 is not
    running a cell; rank 1 is not running a cell; ...`` and the rank that differs drowned in the
    copies. ``phrase(state, many)`` says it of one rank or, ``many``, of several (the verbs in
    the plural); ranks are merged on their singular phrase."""
    by_rank = {s.rank: s for s in states}
    blocks = [(s.rank, (s.host, phrase(s, False))) for s in states]
    return [f"{rank_words(ranks)}{f' on {host}' if host else ''} {phrase(by_rank[ranks[0]], len(ranks) > 1)}"
            for ranks, (host, _) in merge_blocks(blocks)]


def _pending_elsewhere(state: RankEvidence, pg: str) -> str | None:
    for entry in entries_of(state):
        if not entry.completed and entry.pg != pg:
            return f"{entry.op} #{entry.seq} ({group_label(entry.pg, [state])})"
    return None


def _no_collective(states: list[RankEvidence]) -> Verdict:
    dead = [s for s in states if s.dead is not None]
    if dead:
        # A dead peer ends gloo's collectives at once (they fail on the survivors), so nothing is
        # pending any more: name the death, and the last collective the survivors entered in the
        # cell it happened in, or after it (the one rule of deaths.ended_by, which the evidence's
        # "ended, perhaps failed" follows too).
        parts = by_phrase(dead, lambda s, _many: f"died ({s.dead})")
        last: dict[tuple[str, int, str, str], list[int]] = {}
        none = []  # ranks whose cell entered no collective: not waiting for the dead one
        for state in states:
            entries = [e for e in entries_of(state) if ended_by(state, e, dead)]
            if entries:
                e = max(entries, key=lambda x: (int(x.raw.get("time_created_ns") or 0), x.seq))
                last.setdefault((e.pg, e.seq, e.op, e.tensors), []).append(state.rank)
            elif state.dead is None and state.answered and state.answer.get("fr"):
                none.append(state.rank)
        for (pg, seq, op, tensors), ranks in last.items():
            what = f"{op} #{seq} ({tensors + ', ' if tensors else ''}{group_label(pg, states)})"
            parts.append(f"the last collective of {rank_words(ranks)} was {what}")
        if none:
            parts.append(f"{rank_words(none)} had entered no collective in this cell")
        return Verdict(sentence="; ".join(parts), hang=False)
    return Verdict(sentence="no collective is pending: " + "; ".join(by_phrase(states, _outside)), hang=False)


def _outside(state: RankEvidence, many: bool) -> str:
    """Where a rank is while no collective is pending (``many``: see :func:`by_phrase`)."""
    text = where(state, many=many)
    if state.answered and state.answer.get("in_cell") and state.answer.get("cuda_busy"):
        verb = "are" if many else "is"
        text = f"{verb} in native code outside any collective, " + text.removeprefix(f"{verb} ")
    return text
