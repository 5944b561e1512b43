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
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from ..rank_sets import rank_words, ranks_text

logger = logging.getLogger(__name__)

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


@dataclass
class RankState:
    """One rank as the analysis sees it: its answer, or why there is none."""

    rank: int
    answer: dict[str, Any] | None = None
    dead: str | None = None         # "exit code 3", "killed by signal SIGKILL"
    fallback_stack: str | None = None  # faulthandler's stack when the rank did not answer
    #: the prompt the rank waits at for an answer from the notebook (clorch_repl.session.stdin):
    #: held by the user, in pdb or input(), not hung
    prompt: str | None = None
    #: paused by JupyterLab's debugger panel (a breakpoint or a step; clorch_repl.session.debugger)
    paused: bool = False
    #: the rank's host when the session spans hosts ("" on the notebook's own)
    host: str = ""

    @property
    def name(self) -> str:
        """``rank 1``, or ``rank 1 on hostB``: as death reports and errors name a remote rank."""
        return f"rank {self.rank} on {self.host}" if self.host else f"rank {self.rank}"

    @property
    def answered(self) -> bool:
        return self.answer is not None and "error" not in self.answer


@dataclass
class Entry:
    """One recorded collective of one rank."""

    rank: int
    pg: str
    seq: int
    op: str
    raw: dict[str, Any]
    completed: bool
    #: which of torch's recorders holds it ("fr", "nccl"): each numbers a group's collectives
    #: on its own, so a group run on two backends has two sequences
    recorder: str = ""

    @property
    def tensors(self) -> str:
        return describe_tensors(self.raw)


@dataclass
class Verdict:
    """The analysis: one sentence, whether it is a hang (a collective pending), and the details."""

    sentence: str
    hang: bool
    op: str | None = None
    seq: int | None = None
    group: str | None = None
    waiting: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    mismatch: bool = False
    #: ranks waiting at a prompt for the user's answer (see RankState.prompt)
    held: list[int] = field(default_factory=list)

    @property
    def stuck(self) -> bool:
        """A pending collective some rank is missing from, or called differently: a hang for sure.

        Ranks that all wait in the same, matching collective may just be moving a lot of data:
        the live notice stays quiet for them (a false alarm is worse than a late one)."""
        return self.hang and bool(self.missing or self.mismatch)

    #: how long the collective has been pending on the rank that entered it last (by its own
    #: clock, so hosts need not agree on the time); None when nothing is pending
    pending_s: float | None = None
    #: when the first rank entered it (ns since the epoch, that rank's clock): orders the groups
    entered_ns: int | None = None


# ------------------------------------------------------------------------------ entries
def entries_of(state: RankState) -> list[Entry]:
    """The rank's collectives (point-to-point ops are keyed differently and left out here).

    A collective is complete once torch saw it end (``state``), retired it, or its group's status
    says so. NCCL's recorder says ``scheduled`` until the watchdog finds the collective's end
    event done (``started`` only with ``TORCH_NCCL_ENABLE_TIMING``), so there, as with gloo, "not
    completed" is what pending means; NCCL's calls return at once, so such an entry is a
    collective the rank has enqueued and its GPU has not finished. See :func:`_in_the_call` for
    the one NCCL entry whose ``completed`` is not to be believed.
    """
    if not state.answered or not state.answer.get("fr"):
        return []
    fr = state.answer["fr"]
    status = fr.get("pg_status", {})
    raws = fr.get("entries", [])
    calling = _in_the_call(raws, status, state.answer.get("stack") or [])
    out = []
    for raw in raws:
        if raw.get("is_p2p"):
            continue
        pg = str((raw.get("process_group") or [raw.get("pg_id")])[0])
        seq = int(raw.get("collective_seq_id", 0))
        recorder = raw.get("recorder")
        done_upto = status.get(_status_key(raw), {}).get("last_completed_collective", -1)
        completed = raw.get("state") == "completed" or bool(raw.get("retired")) or _status_number(raw) <= done_upto
        if raw is calling:
            raw = dict(raw, state="scheduled")  # recorded, not yet launched: the call has not returned
            completed = False
        out.append(Entry(state.rank, pg, seq, op_name(raw), raw, completed, str(recorder or "")))
    return out


def _status_number(raw: dict[str, Any]) -> int:
    """The entry's number as its group's status counts: the generic recorder (gloo) counts every
    operation of a group, sends and receives too (the entry's ``op_id``); NCCL's counts its
    collectives (``collective_seq_id``). After a send, a gloo all_reduce is collective #3 and
    operation #5, and the status says 5 (torch 2.13)."""
    if raw.get("recorder") != "nccl" and raw.get("op_id") is not None:
        return int(raw["op_id"])
    return int(raw.get("collective_seq_id", 0))


@dataclass(frozen=True)
class Unrecorded:
    """An operation a rank waits in whose group's entries torch's ring no longer holds."""

    #: the recorder's own key of the group ("fr/1"): its local id, which names no group reliably
    #: (it counts the groups this rank built a backend for, not the groups' names)
    key: str
    #: the group's status: last enqueued and last completed operation, in its own numbering
    enqueued: int
    completed: int
    #: entries the ring keeps (TORCH_FR_BUFFER_SIZE on the rank)
    capacity: int


def unrecorded_pending(state: RankState) -> list[Unrecorded]:
    """Operations a rank waits in whose entries are gone from its flight recorder.

    The ring (2,000 entries by default) is shared by every group of a recorder: while one group's
    collective is stuck, another group (a second stream of work, a thread) may run enough
    collectives to push out every entry of the stuck group, and the records then show nothing
    pending. Said only when nothing else can explain it: the ring is full, it holds no entry of
    that group at all, the group's status has an operation enqueued past the last one completed,
    and the rank's main thread is inside torch.distributed. A group's status alone is no proof:
    its "last completed" is the last one seen to finish (async operations can end out of order),
    and NCCL numbers sends and receives apart from collectives; hence nothing is concluded about
    other ranks (:func:`_pushed_out`), and the sentence only replaces "no collective is pending".
    """
    if not state.answered or not state.answer.get("fr"):
        return []
    fr = state.answer["fr"]
    if not _inside_torch_distributed(state.answer.get("stack") or []):
        return []
    keys = {_status_key(raw) for raw in fr.get("entries", [])}
    out = []
    for key, values in (fr.get("pg_status") or {}).items():
        recorder = key.rpartition("/")[0]
        if not (fr.get("full") or {}).get(recorder) or key in keys:
            continue
        enqueued = int(values.get("last_enqueued_collective", -1))
        completed = int(values.get("last_completed_collective", -1))
        if enqueued > completed:
            out.append(Unrecorded(key, enqueued, completed, int(fr.get("capacity") or 0)))
    return out


def op_at(answer: dict[str, Any] | None, key: str, number: int) -> str | None:
    """The op of the entry that group ``key`` ("fr/0") numbers ``number`` in its status, in a rank's
    whole answer (``%clorch top`` names the collective a rank has pending this way); None when
    the ring does not hold it."""
    for raw in reversed(((answer or {}).get("fr") or {}).get("entries") or []):
        if _status_key(raw) == key and _status_number(raw) == number:
            return op_name(raw)
    return None


def _status_key(raw: dict[str, Any]) -> str:
    recorder = raw.get("recorder")
    return f"{recorder}/{raw.get('pg_id')}" if recorder else str(raw.get("pg_id"))


def _in_the_call(raws: list[dict[str, Any]], status: dict[str, Any],
                 stack: list[dict[str, Any]]) -> dict[str, Any] | None:
    """NCCL's entry for a collective whose call has not returned, if the rank is in one.

    NCCL records a collective before launching it, and its end event is recorded only after the
    launch; an event never recorded reads as done, so the dump calls the entry ``completed``. The
    launch itself can block: a communicator's first collective connects to its peers (NCCL's
    lazy connection set-up) and waits inside the call until they call it too. The group's status
    moves ``last_enqueued_collective`` on only when the call has launched it, so the rank's most
    recent NCCL entry numbered past it, while its main thread is inside torch.distributed, is a
    collective the rank waits in (seen on 2 H200s, torch 2.11, NCCL 2.28: a rank alone in the
    first ``barrier()`` of a session looked finished).
    """
    nccl = [raw for raw in raws if raw.get("recorder") == "nccl"
            or str(raw.get("profiling_name", "")).startswith("nccl:")]
    if not nccl or not _inside_torch_distributed(stack):
        return None
    last = nccl[-1]
    if last.get("is_p2p"):
        return None
    enqueued = status.get(_status_key(last), {}).get("last_enqueued_collective", -1)
    return last if int(last.get("collective_seq_id", 0)) > enqueued else None


@dataclass(frozen=True)
class Progress:
    """Where a rank's collectives stand, from its light answer (the flight recorder's group
    status, no entries): the notebook's periodic hang check compares two of these some seconds
    apart (:meth:`stood_still`), and a rank whose pending collectives moved on is not hung,
    whatever one of them took."""

    #: (recorder/group, last enqueued, last completed collective), per group
    marks: tuple[tuple[str, int, int], ...]
    #: the main thread is inside torch.distributed: NCCL's first collective of a communicator
    #: waits there for its peers before the status counts it (see :func:`_in_the_call`)
    calling: bool

    @property
    def pending(self) -> bool:
        """A collective may be pending: enqueued and not completed, or being called."""
        return self.calling or any(enqueued > completed for _, enqueued, completed in self.marks)

    def stood_still(self, before: Progress | None) -> bool:
        """Whether a collective may have been pending since ``before`` (None: no earlier look):
        a group with one enqueued and not completed whose last completed one is the same as
        then, or the main thread inside torch.distributed both times while some group's status
        did not move. Group by group: a group that keeps moving (a second group's loop, a
        thread's collectives) says nothing about a stuck one, and a group's enqueued count may
        grow behind a stuck collective (async ops), so only its completed count is compared."""
        if before is None:
            return self.pending
        then = {key: (enqueued, completed) for key, enqueued, completed in before.marks}
        for key, enqueued, completed in self.marks:
            if enqueued > completed and key in then and then[key][1] == completed:
                return True
        if self.calling and before.calling:
            return not self.marks or any(then.get(key) == (enqueued, completed)
                                         for key, enqueued, completed in self.marks)
        return False


def progress(answer: dict[str, Any]) -> Progress | None:
    """A rank's :class:`Progress`, or None when its answer is an error."""
    if "error" in answer:
        return None
    status = (answer.get("fr") or {}).get("pg_status") or {}
    marks = tuple(sorted((str(key), int(v.get("last_enqueued_collective", -1)),
                          int(v.get("last_completed_collective", -1))) for key, v in status.items()))
    return Progress(marks, _inside_torch_distributed(answer.get("stack") or []))


def _is_torch_distributed(path: str) -> bool:
    return f"{os.sep}torch{os.sep}distributed{os.sep}" in path


def _inside_torch_distributed(stack: list[dict[str, Any]]) -> bool:
    """Whether the main thread is inside a torch.distributed call (one of its innermost frames)."""
    return any(_is_torch_distributed(f.get("file", "")) for f in stack[-8:])


#: torch's profiling names that mean another op: NCCL's barrier is an all_reduce of one element,
#: recorded (torch >= 2.6) as ``nccl:all_reduce_barrier``; the user called barrier().
_OP_ALIASES = {"all_reduce_barrier": "barrier"}


def op_name(raw: dict[str, Any]) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``; ``nccl:all_reduce_barrier`` -> ``barrier``."""
    name = str(raw.get("profiling_name", "?"))
    name = name.split(":", 1)[-1].split(" ", 1)[0]
    return _OP_ALIASES.get(name, name)


def describe_tensors(raw: dict[str, Any]) -> str:
    if op_name(raw) == "barrier":
        return ""  # NCCL's one-element stand-in tensor is torch's, not the user's
    sizes = raw.get("input_sizes") or []
    dtypes = raw.get("input_dtypes") or []
    parts = []
    for i, shape in enumerate(sizes):
        dtype = _DTYPES.get(dtypes[i] if i < len(dtypes) else "", (dtypes[i] if i < len(dtypes) else "?"))
        parts.append(f"{dtype}[{', '.join(str(d) for d in shape)}]")
    return ", ".join(parts)


def group_label(pg: str, states: list[RankState]) -> str:
    for state in states:
        info = (state.answer or {}).get("groups", {}).get(pg) if state.answered else None
        if info:
            if info.get("default"):
                return "default group"
            return f"group {pg} of ranks {ranks_text(info.get('ranks', []))}"
    return "default group" if pg == "0" else f"group {pg}"


def _members(pg: str, states: list[RankState]) -> list[int]:
    for state in states:
        info = (state.answer or {}).get("groups", {}).get(pg) if state.answered else None
        if info and info.get("ranks"):
            return [r for r in info["ranks"] if any(s.rank == r for s in states)]
    return [s.rank for s in states]


def _ranks_word(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 0,2-3``: the one spelling of :mod:`clorch_repl.rank_sets`."""
    return rank_words(ranks)


# ------------------------------------------------------------------------------ where
def held_at_prompt(state: RankState) -> str:
    """A rank waiting for the user at a prompt: in the debugger (pdb's frames on its stack) or in
    input(), and where."""
    stack = ((state.answer or {}).get("stack") or []) if state.answered else []
    files = [str(f.get("file", "")) for f in stack]
    if not state.answered:  # its faulthandler stack, when it had no time to answer
        files = re.findall(r'File "([^"]+)"', state.fallback_stack or "")
    in_pdb = any(os.path.basename(f) in ("bdb.py", "pdb.py") for f in files)
    what = "is held in the debugger" if in_pdb or state.paused else "is waiting for input"
    user = [f for f in stack if not f.get("library")]
    at = f" at {frame_label(user[-1])}" if user else ""  # (a faulthandler stack's innermost line is the wait)
    if state.prompt is None:
        return f"{what}{at} (paused in the debugger panel)"
    return f"{what}{at} (its prompt {state.prompt!r} waits for your answer in the notebook)"


def where(state: RankState) -> str:
    """Where a rank is, as the notebook names lines: ``Cell In[5], line 3 in <module>``."""
    if state.dead is not None:
        return f"died ({state.dead})"
    if state.prompt is not None or state.paused:
        return held_at_prompt(state)
    if not state.answered:
        why = (state.answer or {}).get("error")
        head = "did not answer" + (f" ({why})" if why else " (native code is holding its Python lock)")
        line = _fallback_line(state.fallback_stack)
        return head + (f"; it is at {line}" if line else "")
    ans = state.answer
    stack = ans.get("stack") or []
    if not ans.get("in_cell"):
        return "is not running a cell"
    user = [f for f in stack if not f.get("library")]
    if not user:
        # Only library frames under run_code: IPython showing the cell's traceback, for example.
        inner = f" ({frame_label(stack[-1])})" if stack else ""
        return f"is in library code outside its cell's lines{inner}"
    text = "is at " + frame_label(user[-1])
    if stack and stack[-1].get("library") and user:
        inner = stack[-1]
        text += f", inside {inner['function']}() ({_short(inner['file'])}:{inner['line']})"
    if ans.get("cuda_busy"):
        text += ", with its CUDA stream still busy"
    return text


def frame_label(frame: dict[str, Any]) -> str:
    func = frame.get("function", "?")
    func = func if func.startswith("<") else f"{func}()"
    if frame.get("cell"):
        return f"{frame['cell']}, line {frame['line']} in {func}"
    return f"{_short(frame['file'])}:{frame['line']} in {func}"


def _short(path: str) -> str:
    """A path as short as still recognisable: from the package root, else relative to the cwd."""
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


#: a faulthandler frame: ``File "/path/x.py", line 3 in step`` (the notebook has named cells'
#: files ``Cell In[12]`` by then: clorch_repl.session.cell_files)
_FAULTHANDLER_FRAME = re.compile(r'File "(.+)", line (\d+) in (.+)$')


def _fallback_line(stack: str | None) -> str | None:
    """The innermost line of a faulthandler stack (most recent call first), named as
    :func:`frame_label` names a frame."""
    for line in (stack or "").splitlines():
        line = line.strip()
        if line.startswith("File "):
            match = _FAULTHANDLER_FRAME.match(line)
            if match is None:
                return line
            path, number, function = match.groups()
            cell = path if path.startswith("Cell In[") else None
            return frame_label({"file": path, "line": number, "function": function, "cell": cell})
    return None


# ------------------------------------------------------------------------------ analysis
def analyse(states: list[RankState]) -> Verdict:
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
        verdict.sentence += (f" (no collective record from {_ranks_word([s.rank for s in unrecorded])}: "
                             f"{why}; judged from stacks)")
    return verdict


def _pushed_out(states: list[RankState]) -> Verdict | None:
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
    clauses = [f"{_ranks_word(sorted(waiting))} {verb} in an operation whose entries torch's flight recorder no "
               f"longer holds: later entries pushed out every entry of its group ({first.key}; "
               f"TORCH_FR_BUFFER_SIZE={first.capacity} on rank {min(waiting)}, a larger one keeps more)"]
    clauses += [f"{s.name} {where(s)}" for s in states if s.rank not in waiting]
    by_rank = {s.rank: s for s in states}
    oldest = [int(raw["time_created_ns"]) for r in waiting for raw in by_rank[r].answer["fr"].get("entries", [])
              if raw.get("time_created_ns")]
    ages = [(by_rank[r].answer["now_ns"] - min(oldest)) / 1e9 for r in waiting
            if oldest and "now_ns" in by_rank[r].answer]
    return Verdict(sentence="; ".join(clauses), hang=True, waiting=sorted(waiting),
                   pending_s=min(ages) if ages else None, entered_ns=min(oldest) if oldest else None)


def _first_disagreement(pg: str, per_rank: dict[int, dict[int, Entry]],
                        states: list[RankState]) -> Verdict | None:
    members = _members(pg, states)
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
    """Torch's own comparison of two ranks' entries for one collective; a sentence if they differ."""
    if len(present) < 2:
        return None
    # Only where torch is already imported: importing it here took the notebook 2.6 s under load,
    # inside the interrupt of a timed-out cell (and ~300 MB of the notebook's memory).
    Op = None  # noqa: N806
    if "torch" in sys.modules:
        try:
            from torch.distributed.flight_recorder.components.types import MatchState, Op
        except ImportError:  # a torch without the analyser: compare op and tensors ourselves
            Op = None  # noqa: N806
    ranks = sorted(present)
    ref = present[ranks[0]]
    memberships = {pg: set(members)}
    for r in ranks[1:]:
        other = present[r]
        if Op is not None:
            try:
                a = Op(_for_torch(ref.raw), memberships, pg)
                b = Op(_for_torch(other.raw), memberships, pg)
                info = a.match(b)
                differs = info.state not in (MatchState.FULLY_MATCHED, MatchState.UNDECIDED,
                                             MatchState.COLLECTIVE_STATE_MISMATCH)
            except (AssertionError, KeyError, ValueError, IndexError, TypeError) as exc:
                logger.debug("torch's Op could not compare %s and %s: %s", ref.raw, other.raw, exc)
                differs = (ref.op, ref.tensors) != (other.op, other.tensors)
        else:
            differs = (ref.op, ref.tensors) != (other.op, other.tensors)
        if differs:
            if ref.op != other.op:
                return (f"rank {ref.rank} called {ref.op}({ref.tensors}), "
                        f"rank {r} called {other.op}({other.tensors})")
            if ref.op == "broadcast":
                return (f"rank {ref.rank} has {ref.tensors or 'no tensor'}, "
                        f"rank {r} has {other.tensors or 'no tensor'}")
            return (f"rank {ref.rank} passed {ref.tensors or 'no tensor'}, "
                    f"rank {r} passed {other.tensors or 'no tensor'}")
    return None


def _for_torch(raw: dict[str, Any]) -> dict[str, Any]:
    """Op wants the dump's field names; the state is our own business (gloo never says started)."""
    event = dict(raw)
    event["state"] = "scheduled"
    event["process_group"] = tuple(raw.get("process_group") or (str(raw.get("pg_id")), ""))
    event.setdefault("frames", [])
    return event


def _verdict(pg: str, seq: int, present: dict[int, Entry], pending: list[int], absent: list[int],
             mismatch: str | None, states: list[RankState]) -> Verdict:
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
        clauses.append(f"{_ranks_word(pending)} {verb} in it")
    for r in absent:
        state = by_rank.get(r)
        if state is None:
            continue
        if state.dead is not None:
            clauses.append(f"{state.name} died ({state.dead})")
            continue
        if not state.answered:
            clauses.append(f"{state.name} {where(state)}")
            continue
        elsewhere = _pending_elsewhere(state, pg)
        if elsewhere is not None:
            clauses.append(f"{state.name} never called it and waits in {elsewhere}")
        else:
            clauses.append(f"{state.name} never called it and {where(state)}")
    ages = [(by_rank[r].answer["now_ns"] - int(present[r].raw.get("time_created_ns") or 0)) / 1e9
            for r in pending if by_rank.get(r) is not None and by_rank[r].answered
            and "now_ns" in by_rank[r].answer]
    return Verdict(sentence=f"{head}: " + "; ".join(clauses), hang=bool(pending), op=op, seq=seq,
                   group=group, waiting=pending, missing=[r for r in absent if r in by_rank],
                   held=[r for r in absent if r in by_rank and (by_rank[r].prompt is not None or by_rank[r].paused)],
                   mismatch=mismatch is not None, pending_s=min(ages) if ages else None,
                   entered_ns=min((int(present[r].raw.get("time_created_ns") or 0) for r in pending), default=None))


def _pending_elsewhere(state: RankState, pg: str) -> str | None:
    for entry in entries_of(state):
        if not entry.completed and entry.pg != pg:
            return f"{entry.op} #{entry.seq} ({group_label(entry.pg, [state])})"
    return None


def _no_collective(states: list[RankState]) -> Verdict:
    dead = [s for s in states if s.dead is not None]
    if dead:
        # A dead peer ends gloo's collectives at once (they fail on the survivors), so nothing is
        # pending any more: name the death, and the last collective the survivors entered.
        parts = [f"{s.name} died ({s.dead})" for s in dead]
        last: dict[tuple[str, int, str, str], list[int]] = {}
        for state in states:
            entries = entries_of(state)
            if entries:
                e = max(entries, key=lambda x: (int(x.raw.get("time_created_ns") or 0), x.seq))
                last.setdefault((e.pg, e.seq, e.op, e.tensors), []).append(state.rank)
        for (pg, seq, op, tensors), ranks in last.items():
            what = f"{op} #{seq} ({tensors + ', ' if tensors else ''}{group_label(pg, states)})"
            parts.append(f"the last collective of {_ranks_word(ranks)} was {what}")
        return Verdict(sentence="; ".join(parts), hang=False)
    parts = []
    for state in states:
        text = where(state)
        if state.answered and state.answer.get("in_cell") and state.answer.get("cuda_busy"):
            text = "is in native code outside any collective, " + text.removeprefix("is ")
        parts.append(f"{state.name} {text}")
    return Verdict(sentence="no collective is pending: " + "; ".join(parts), hang=False)
