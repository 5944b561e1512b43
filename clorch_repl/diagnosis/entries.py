"""What the ranks' answers hold, read into plain records: what each rank answered (:class:`RankEvidence`),
its flight-recorder entries (:class:`Entry`, :func:`entries_of`), collectives it started that the
recorder dropped (:func:`unrecorded_pending`), how far its groups got (:class:`CollectiveProgress`), and the
names the reports use for ops, tensors and groups. :mod:`.analyse` lines these up into a
:class:`Verdict`; :mod:`.render` and the rank panel show them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..common.rank_sets import ranks_text

logger = logging.getLogger(__name__)

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


@dataclass
class RankEvidence:
    """One rank as the analysis sees it: its answer, or why there is none."""

    rank: int
    answer: dict[str, Any] | None = None
    dead: str | None = None         # "exit code 3", "killed by signal SIGKILL"
    fallback_stack: str | None = None  # faulthandler's stack when the rank did not answer
    #: the prompt the rank waits at for an answer from the notebook (clorch_repl.session.stdin):
    #: held by the user, in pdb or input(), not hung
    prompt: str | None = None
    #: paused by JupyterLab's debugger panel (a breakpoint or a step; clorch_repl.notebook.debugger)
    paused: bool = False
    #: the rank's host when the session spans hosts ("" on the notebook's own)
    host: str = ""
    #: a dead rank's: per other rank, when (its clock, ns) the cell it was running when this death
    #: was first seen began; a collective called before it cannot have failed of this death
    #: (clorch_repl.diagnosis.deaths)
    died_in: dict[int, int] = field(default_factory=dict)
    #: what the rank's code raised in the cell being diagnosed (``RuntimeError (data file missing
    #: on rank 1)``): the notebook has it from the rank's reply (:func:`.render.with_raised`); the
    #: probe cannot tell, the rank being back at its prompt. Such a rank is the cause of the wait
    #: of the others, not "not running a cell" beside it
    raised: str | None = None

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

    @property
    def compared(self) -> str:
        """What every rank of the group must pass alike (:func:`compared_tensors`)."""
        return compared_tensors(self.raw)


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
    #: ranks waiting at a prompt for the user's answer (see RankEvidence.prompt)
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
def entries_of(state: RankEvidence) -> list[Entry]:
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


def unrecorded_pending(state: RankEvidence) -> list[Unrecorded]:
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
    raw = _entry_at(answer, key, number)
    return op_name(raw) if raw is not None else None


def age_at(answer: dict[str, Any] | None, key: str, number: int) -> float | None:
    """Seconds since the entry of :func:`op_at` was recorded, by the rank's own clock (its answer's
    ``now_ns``): how long a collective has been pending, from one answer (``%clorch top --once``,
    which has no earlier round to date it from); None when the ring does not hold it."""
    raw = _entry_at(answer, key, number)
    now_ns, created = (answer or {}).get("now_ns"), (raw or {}).get("time_created_ns")
    return max(0.0, (int(now_ns) - int(created)) / 1e9) if now_ns and created else None


def _entry_at(answer: dict[str, Any] | None, key: str, number: int) -> dict[str, Any] | None:
    """The newest entry of a rank's whole answer that group ``key`` numbers ``number``."""
    for raw in reversed(((answer or {}).get("fr") or {}).get("entries") or []):
        if _status_key(raw) == key and _status_number(raw) == number:
            return raw
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
class CollectiveProgress:
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

    def stood_still(self, before: CollectiveProgress | None) -> bool:
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


def progress(answer: dict[str, Any]) -> CollectiveProgress | None:
    """A rank's :class:`CollectiveProgress`, or None when its answer is an error."""
    if "error" in answer:
        return None
    status = (answer.get("fr") or {}).get("pg_status") or {}
    marks = tuple(sorted((str(key), int(v.get("last_enqueued_collective", -1)),
                          int(v.get("last_completed_collective", -1))) for key, v in status.items()))
    return CollectiveProgress(marks, _inside_torch_distributed(answer.get("stack") or []))


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


#: The sides of an op's tensors that differ among the ranks of its group by design, left out where
#: the ranks' calls are compared (:func:`compared_tensors`): a scatter's list (its input) is passed
#: by the source alone, a gather's (its output) is received by the destination alone, and an
#: all_to_all may be split unevenly. Recorded on 2 and 3 gloo ranks (torch 2.13): a scatter's
#: input is ``[]`` on every rank but the source and a gather's output ``[]`` on every rank but the
#: destination; reduce and broadcast record the same sizes on every rank, and the object
#: collectives are made of these, their bytes padded to one size on every rank
#: (scatter_object_list: broadcast, scatter, scatter; gather_object: all_gather, gather;
#: all_gather_object: all_gather twice; broadcast_object_list: broadcast twice). The sides torch's
#: own comparison (flight_recorder's ``Op.match``) leaves out; this is the rule where it is not
#: used (the notebook has not imported torch). Before it, every healthy session that scattered
#: was said to hold a mismatch ("rank 0 passed float32[2, 2], rank 1 passed no tensor").
ROOTED_SIDES: dict[str, frozenset[str]] = {"scatter": frozenset({"input"}), "gather": frozenset({"output"}),
                                           "all_to_all": frozenset({"input", "output"})}


def compared_tensors(raw: dict[str, Any]) -> str:
    """What every rank of the group must pass alike for the entry's collective, as
    :func:`describe_tensors` names it: its input tensors, a scatter's output (what each rank
    receives), nothing of an all_to_all's (see :data:`ROOTED_SIDES`)."""
    left_out = ROOTED_SIDES.get(op_name(raw), frozenset())
    if "input" not in left_out:
        return describe_tensors(raw)
    return "" if "output" in left_out else describe_tensors(raw, side="output")


def describe_tensors(raw: dict[str, Any], side: str = "input") -> str:
    """``float32[4], int64[1]``: the entry's input tensors (``side="output"``: its outputs)."""
    if op_name(raw) == "barrier":
        return ""  # NCCL's one-element stand-in tensor is torch's, not the user's
    sizes = raw.get(f"{side}_sizes") or []
    dtypes = raw.get(f"{side}_dtypes") or []
    parts = []
    for i, shape in enumerate(sizes):
        dtype = _DTYPES.get(dtypes[i] if i < len(dtypes) else "", (dtypes[i] if i < len(dtypes) else "?"))
        parts.append(f"{dtype}[{', '.join(str(d) for d in shape)}]")
    return ", ".join(parts)


def group_label(pg: str, states: list[RankEvidence]) -> str:
    for state in states:
        info = (state.answer or {}).get("groups", {}).get(pg) if state.answered else None
        if info:
            if info.get("default"):
                return "default group"
            return f"group {pg} of ranks {ranks_text(info.get('ranks', []))}"
    return "default group" if pg == "0" else f"group {pg}"


def members_of(pg: str, states: list[RankEvidence]) -> list[int]:
    for state in states:
        info = (state.answer or {}).get("groups", {}).get(pg) if state.answered else None
        if info and info.get("ranks"):
            return [r for r in info["ranks"] if any(s.rank == r for s in states)]
    return [s.rank for s in states]


def out_of_step(answers: dict[int, dict[str, Any] | None]) -> str | None:
    """Why the ranks' groups no longer line up, from their light answers (the flight recorder's
    group status), or None while they do (or where the recorder cannot say).

    Every member of a group numbers its collectives on it in the order it calls them; a collective
    is matched across ranks by that number. When a failed cell left one member further on than
    another (a collective that timed out on rank 0 while rank 1 never called it: gloo's own
    timeout, ``%clorch start --timeout``), every later collective on that group pairs the wrong
    calls, and gloo has closed its connections besides: the group is broken for good, though
    every rank is idle and nothing looks stuck. Point-to-point calls (send, recv) are numbered
    apart and never compared; ranks that did not answer are left out."""
    called: dict[str, dict[int, int]] = {}
    for rank, answer in answers.items():
        if not answer or "error" in answer:
            continue
        for key, values in ((answer.get("fr") or {}).get("pg_status") or {}).items():
            called.setdefault(str(key), {})[rank] = int(values.get("last_enqueued_collective", -1))
    for key, by_rank in sorted(called.items()):
        if len(set(by_rank.values())) > 1:
            pg = key.rsplit("/", 1)[-1]
            name = "the default group" if pg == "0" else f"group {pg}"
            said = ", ".join(f"rank {r} {max(0, n)}" for r, n in sorted(by_rank.items()))
            return f"the ranks' collectives on {name} no longer line up (called so far: {said})"
    return None
