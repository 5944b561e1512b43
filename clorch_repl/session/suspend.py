"""Suspend and resume (issue 37): every GPU given back, every rank's state kept.

Why: a notebook holds its GPUs while its user reads, thinks or sleeps, and ``%clorch stop`` frees
them only by losing the state. The CUDA driver can move a live process's GPU state to host memory
and back (:mod:`clorch_repl.host.cuda_checkpoint`), so the ranks keep their processes, namespaces and
tensors while their GPUs are free for others.

Suspend: refuse what cannot be suspended (:func:`refusal`), abort the session's groups on every
rank (the hang recovery's abort, :func:`clorch_repl.kernel.regroup.abort`: NVIDIA documents that a
process using CUDA IPC cannot be checkpointed, and NCCL between GPUs uses it), checkpoint every
rank's process through the driver, end the warm spares. Resume: check every rank's GPU has room
(naming the processes that hold it where not), restore, form the group again exactly as a
recovery does (the ``regroup`` request, :mod:`.recovery`), start the spares again. A suspend that
fails midway restores what it took and forms the group again: the session runs on as before.

:class:`Suspending` is a part of :class:`~clorch_repl.session.session.Session` (a base class), so
the session alone still moves its :class:`~.lifecycle.Lifecycle`; the I/O lives here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..host import cuda_checkpoint
from ..errors import ClorchError
from ..common.human import size
from ..launchers.spares import end_spares
from ..common.rank_sets import rank_words, ranks_are
from .hooks import SCRIPT_VERBS, Verbs
from .lifecycle import Lifecycle, SessionState
from .protocol import CellRequest
from ..wire import PROTOCOL_VERSION
from ..wire.requests import request_code

if TYPE_CHECKING:
    from ..launchers.base import Launcher
    from ..common.topology import Topology
    from .relay import Relay

logger = logging.getLogger(__name__)

#: How long the ranks get to confirm the abort of their groups.
ABORT_ASK_S = 3.0
#: The re-form's bound (as :data:`.recovery.REGROUP_TIMEOUT_S`).
REGROUP_TIMEOUT_S = 60.0
#: The slowest transfer the driver is allowed before the helper is given up on (bytes/s; measured
#: 1.3 GB/s out, 4 GB/s in on an H200) and a floor for its start-up and cuInit.
SLOWEST_BYTES_S = 0.25e9
HELPER_FLOOR_S = 120.0

Progress = Callable[[str], None]


def cpu_refusal(topology: "Topology", verbs: Verbs = SCRIPT_VERBS) -> str | None:
    """Why ranks of ``topology`` can never be suspended (they run on CPUs), or None: asked before
    a suspend and before one is armed for later (``--suspend-after``, ``suspend --after``), which
    would otherwise be accepted and fail at its time. ``verbs``: the driver's words (the
    refusals of this module name the user's next step as :class:`~.hooks.Verbs` says it)."""
    if topology.uses_gpu:
        return None
    return (f"the ranks run on CPUs ({topology.backend}): they hold no GPU to give back; their memory is "
            f"freed only by {verbs.stop} (which loses their state)")


def refusal(state: SessionState, topology: "Topology", busy: list[int], dead: list[int],
            launcher: "Launcher", verbs: Verbs = SCRIPT_VERBS) -> str | None:
    """Why the session cannot be suspended now, with what to do; None when it can. Pure: the
    driver's own check (:func:`cuda_checkpoint.api_problem`) comes after these. The advice for
    lost ranks is the ``launcher``'s where it cannot restart them (a detached session refuses
    ``%clorch restart``: :meth:`~clorch_repl.launchers.base.Launcher.instead_of_replacing`)."""
    if state is SessionState.SUSPENDED:
        return f"the session is suspended already: {verbs.resume} gives every rank its GPU back"
    if (cpu := cpu_refusal(topology, verbs)) is not None:
        return cpu
    if state is not SessionState.READY:
        # a launcher that cannot replace single ranks (slurm, attach) is never advised --ranks
        single = "" if launcher.instead_of_replacing(dead) else f"{verbs.restart_some} or "
        instead = launcher.instead_of_restarting() or f"{single}{verbs.restart} first"
        return (f"the session is {state.value}: suspend needs every rank alive in its group "
                f"({verbs.status} says why; {instead})")
    if dead:
        instead = (launcher.instead_of_replacing(dead)
                   or f"{verbs.restart_ranks.format(ranks=','.join(map(str, dead)))} first")
        return f"{ranks_are(dead)} dead: {instead}"
    if busy:
        return (f"{ranks_are(busy)} running a cell: wait for it to finish or {verbs.interrupt}, "
                f"then {verbs.suspend}")
    return None


def refuse_cell(life: Lifecycle, then: str = "then run the cell again", verbs: Verbs = SCRIPT_VERBS) -> None:
    """A cell (or a value transfer, or ``then``'s command) while the ranks are suspended: refused,
    saying so and offering the resume (``verbs.resume``)."""
    if life.state in (SessionState.SUSPENDING, SessionState.SUSPENDED, SessionState.RESUMING):
        what = {"suspending": "being suspended", "resuming": "being resumed"}.get(life.state.value, "suspended")
        raise ClorchError(f"the ranks are {what} ({life.why or 'their GPUs given back'}): "
                          f"{verbs.resume} gives them their GPUs back, {then}")


@dataclass(frozen=True)
class Moved:
    """What the helper did to one rank's process."""

    rank: int
    ok: bool
    seconds: dict[str, float]
    error: str = ""


def _where(launcher: "Launcher", rank: int) -> str:
    handle = launcher.ranks[rank]
    return f"rank {rank} on {handle.host or socket.gethostname()}"


def drive(action: str, launcher: "Launcher", ranks: list[int], held_bytes: int,
          verbs: Verbs = SCRIPT_VERBS) -> dict[int, Moved]:
    """``action`` (suspend or resume) on ``ranks``' processes through the helper process (see
    :mod:`clorch_repl.host.cuda_checkpoint` for why not here), run here or, for ranks on other hosts,
    by each rank's nanny there; every rank's result, failures named (the advice in ``verbs``)."""
    timeout = HELPER_FLOOR_S + held_bytes / SLOWEST_BYTES_S
    replies = launcher.checkpoint(action, ranks, timeout)
    if replies is not None:
        return {r: _from_nanny(r, launcher, action, replies.get(r), timeout) for r in ranks}
    pids = {launcher.ranks[r].pid: r for r in ranks}
    if None in pids:
        raise ClorchError(f"{ranks_are([r for p, r in pids.items() if p is None])} without a known process id: "
                          + (launcher.instead_of_restarting() or verbs.restart))
    targets = [f"{pid}={_where(launcher, rank)}" for pid, rank in pids.items()]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # the ranks' GPUs, whichever
    command = [sys.executable, "-m", "clorch_repl.host.cuda_checkpoint", action, *targets]
    helper = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)  # a Ctrl-C of the notebook's group never reaches it
    stdout, stderr = _finish(helper, action, ranks, timeout, verbs)
    moved: dict[int, Moved] = {}
    for line in stdout.splitlines():
        try:
            report: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        rank = pids.get(report.get("pid"))
        if rank is not None:
            moved[rank] = Moved(rank, bool(report["ok"]), report.get("seconds", {}), report.get("error", ""))
    for rank in ranks:
        if rank not in moved:
            moved[rank] = Moved(rank, False, {}, f"{_where(launcher, rank)}: the checkpoint helper said nothing "
                                f"of it (exit {helper.returncode}): {stderr.strip()[-400:]}")
    return moved


def _finish(helper: "subprocess.Popen[str]", action: str, ranks: list[int], timeout: float,
            verbs: Verbs = SCRIPT_VERBS) -> tuple[str, str]:
    """The helper's output once it ends. An interrupt (Ctrl-C) does not stop it: the driver is
    midway through each process, and a process stopped there stays locked; the interrupt is
    logged and the suspend or resume finishes (seconds later), saying what it did."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return helper.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except KeyboardInterrupt:
            logger.warning("clorch_repl: an interrupt during the %s is not taken: the CUDA driver is midway", action)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.communicate()
            raise ClorchError(f"the CUDA driver did not {action} {rank_words(ranks)} within {timeout:.0f} s; "
                              f"{verbs.stop} ends them") from None


def _from_nanny(rank: int, launcher: "Launcher", action: str, reply: dict[str, Any] | None,
                timeout: float) -> Moved:
    """A nanny's reply to ``checkpoint`` as a :class:`Moved`."""
    if reply is None:
        return Moved(rank, False, {}, f"{_where(launcher, rank)}: its nanny did not report the {action} within "
                                      f"{timeout:.0f} s")
    outcome = reply.get("outcome")
    if not isinstance(outcome, dict):
        return Moved(rank, False, {}, str(reply.get("error") or f"{_where(launcher, rank)}: no report of the {action}"))
    return Moved(rank, bool(outcome.get("ok")), outcome.get("seconds") or {}, str(outcome.get("error") or ""))


def gpu_holders(gpu: str) -> tuple[int | None, list[str]]:
    """(free bytes, "pid 123 (python, 30.0 GiB)" per compute process) of the GPU ``gpu`` (an index
    or UUID as CUDA_VISIBLE_DEVICES names it), from nvidia-smi: what keeps a rank from its GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, []
    try:
        free = subprocess.run([exe, "-i", gpu, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        apps = subprocess.run([exe, "-i", gpu, "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi could not say who holds GPU %s: %s", gpu, exc)
        return None, []
    holders = []
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            holders.append(f"pid {parts[0]} ({os.path.basename(parts[1])}, {size(int(parts[2]) * 2**20)})")
    return (int(free) * 2**20 if free.isdigit() else None), holders


def gpu_used(gpu: str) -> int | None:
    """Bytes used on the GPU ``gpu`` (all its processes), from nvidia-smi; None where unknown. What
    a rank holds when nvidia-smi cannot list processes by pid (a container's own pid namespace)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi could not say what GPU %s holds: %s", gpu, exc)
        return None
    return int(out) * 2**20 if out.isdigit() else None


def held_bytes(launcher: "Launcher", topology: "Topology",
               used: Callable[[str], int | None] = gpu_used) -> dict[int, int | None]:
    """rank -> the GPU memory it holds now (what the driver will keep in host memory): its
    process's own figure, else, for a rank on this host, its whole GPU's."""
    usage = launcher.memory()
    held = {p.rank: usage.get(p.rank, (None, None))[1] for p in launcher.ranks}
    for p in launcher.ranks:
        if not held[p.rank] and not p.host:
            held[p.rank] = used(topology.visible_devices(p.rank))
    return held


def room_problem(topology: "Topology", held: dict[int, int | None],
                 holders: Callable[[str], tuple[int | None, list[str]]] = gpu_holders,
                 remote: frozenset[int] = frozenset(), verbs: Verbs = SCRIPT_VERBS) -> str | None:
    """Why some rank's GPU cannot take its state back now (which GPU, who holds it, retry); None
    when every GPU has room. Checked before the driver is asked: a restore that fails midway is
    not one the driver promises to leave the process whole after."""
    problems = []
    for rank, need in sorted(held.items()):
        if rank in remote:
            continue  # its host's nvidia-smi is its nanny's; a restore there that lacks room says so itself
        gpu = topology.visible_devices(rank)
        free, who = holders(gpu)
        if free is None or need is None or free >= need:
            continue
        problems.append(f"rank {rank}'s GPU {gpu} has {size(free)} free and rank {rank} needs {size(need)}; "
                        f"it is held by {', '.join(who) if who else 'processes nvidia-smi does not show'}")
    if not problems:
        return None
    return "; ".join(problems) + f": each rank goes back to its own GPU only; free it and run {verbs.resume} again"


def who_holds(topology: "Topology", ranks: list[int], remote: frozenset[int] = frozenset(),
              holders: Callable[[str], tuple[int | None, list[str]]] = gpu_holders) -> str:
    """"rank 0's GPU 3 is used by pid 4242 (python, 118.0 GiB)" for each of ``ranks`` on this host
    whose GPU another process uses now (a restore that failed: which process to ask about)."""
    said = []
    for rank in ranks:
        if rank in remote:
            continue
        gpu = topology.visible_devices(rank)
        _, who = holders(gpu)
        if who:
            said.append(f"rank {rank}'s GPU {gpu} is used by {', '.join(who)}")
    return "; ".join(said)


def abort_groups(relay: "Relay", ranks: list[int]) -> list[int]:
    """The session's groups aborted on every rank (the hang recovery's abort over each rank's
    control channel); the ranks that did not confirm it."""
    answers = relay.channels.prober.ask(ranks, abort=True, timeout_s=ABORT_ASK_S)
    logger.info("clorch_repl: aborted the groups for a suspend: %s", answers)
    return [r for r, answer in answers.items() if answer is None]


def regroup(relay: "Relay", launcher: "Launcher", generation: int) -> str:
    """Every rank's groups given new backends (the ``regroup`` request, as a recovery sends it);
    "" when it worked, else why not."""
    code = request_code("regroup", generation=generation, fresh=[], env=None, protocol=PROTOCOL_VERSION)
    ranks = tuple(p.rank for p in launcher.ranks)
    outcome = relay.execute(CellRequest(code, ranks, timeout_s=REGROUP_TIMEOUT_S), None, silent=True)
    if outcome.ok:
        return ""
    failed = outcome.failed
    if not failed:
        return "forming it again was interrupted" if outcome.interrupted else "forming it again timed out"
    first = failed[0]
    return f"rank {first.rank}: {first.error.evalue if first.error is not None else first.status.value}"


def _remote(group: "Launcher") -> frozenset[int]:
    return frozenset(p.rank for p in group.ranks if p.host)


def _spares_again(group: "Launcher") -> None:
    """Warm spares again, as after a start (the group works without them)."""
    try:
        group.group_formed()
    except (ClorchError, OSError, RuntimeError) as exc:
        logger.warning("clorch_repl: could not start warm spares again (%s); restarts start cold", exc)


def _held_line(total: int, verbs: Verbs = SCRIPT_VERBS) -> str:
    """The session's why while suspended (``%clorch status``)."""
    return f"{size(total)} of GPU memory held in host memory since {time.strftime('%H:%M:%S')}; {verbs.resume}"


def _fresh(group: "Launcher", verbs: Verbs = SCRIPT_VERBS) -> str:
    """How to get fresh ranks: a restart, or what works where the launcher refuses one (a detached session)."""
    return group.instead_of_restarting() or f"{verbs.restart} gives fresh ranks and a fresh group"


def _failures(moved: dict[int, Moved]) -> str:
    return "; ".join(m.error for m in moved.values() if not m.ok)


class Suspending:
    """:meth:`suspend` and :meth:`resume` of a :class:`~clorch_repl.session.session.Session`."""

    #: rank -> GPU bytes each rank held when suspended (the host memory the driver holds for it)
    _held: dict[int, int | None]

    def suspend(self: Any, progress: Progress = lambda _: None) -> str:
        """Give every rank's GPU back, keeping its process, namespace and tensors (see the module
        docstring); the line that says what was done. A refusal or a failure raises
        :class:`ClorchError`, and a failure leaves the session running as before."""
        group, relay = self._require()
        verbs = self.hooks.verbs  # the words of whoever drives the session (.hooks.Verbs)
        dead = [p.rank for p in group.ranks if not p.alive]
        why = refusal(self.life.state, self.topology, relay.busy(), dead, group, verbs)
        local = any(not p.host for p in group.ranks)  # a rank elsewhere: its nanny's driver says for itself
        problem = why or (cuda_checkpoint.api_problem() if local else None)
        if problem:
            raise ClorchError(f"cannot suspend: {problem}")
        t0 = time.monotonic()
        ranks = [p.rank for p in group.ranks]
        self._held = held_bytes(group, self.topology)
        total = sum(b for b in self._held.values() if b)
        self.life.move("suspend", f"{size(total)} of GPU memory moving to host memory")
        progress(f"suspending {rank_words(ranks)}: taking the group down")
        spares = end_spares(group)  # first: the driver's host memory need not compete with theirs
        silent = abort_groups(relay, ranks)
        try:
            moved = drive("suspend", group, ranks, total, verbs) if not silent else {}
        except ClorchError as exc:  # the helper could not be run or timed out: nothing known taken
            return self._undo_suspend([], str(exc), total)
        if silent or not all(m.ok for m in moved.values()):
            failure = (f"{ranks_are(silent)} did not confirm the abort of its groups" if silent
                       else _failures(moved))
            return self._undo_suspend([r for r, m in moved.items() if m.ok], failure, total)
        took = time.monotonic() - t0
        self.life.move("suspended", _held_line(total, verbs))
        logger.info("clorch_repl: suspended in %.1f s (%s); %d warm spare(s) ended", took, moved, spares)
        return (f"clorch: suspended {rank_words(ranks)} in {took:.1f} s: {size(total)} of GPU memory moved to host "
                f"memory and every GPU given back; each rank keeps its variables; {verbs.resume} brings them back")

    def _undo_suspend(self: Any, taken: list[int], failure: str, total: int) -> str:
        """A suspend failed midway: give back what was taken, form the group again, and say why."""
        group, relay = self._require()
        verbs = self.hooks.verbs
        back = drive("resume", group, taken, total, verbs) if taken else {}
        self._generation += 1
        lost = regroup(relay, group, self._generation) if all(m.ok for m in back.values()) else _failures(back)
        if lost:
            self.life.move("degrade", f"a failed suspend left the ranks without a group ({lost})")
            raise ClorchError(f"the suspend failed ({failure}) and the group could not be formed again ({lost}); "
                              f"every rank kept its variables: {_fresh(group, verbs)}")
        self.life.move("resumed", f"a suspend failed: {failure}")
        _spares_again(group)
        raise ClorchError(f"the suspend failed and the session runs on as before (its group formed again): {failure}")

    def resume(self: Any, progress: Progress = lambda _: None) -> str:
        """Every rank's GPU state back on its own GPU and the group formed again; the line that
        says so. Refused (the session stays suspended) while a rank's GPU lacks room."""
        group, relay = self._require()
        verbs = self.hooks.verbs
        if self.life.state is not SessionState.SUSPENDED:
            raise ClorchError(f"nothing to resume: the session is {self.life.state.value} " + (
                f"({verbs.suspend} gives the GPUs back)" if self.topology.uses_gpu
                else "(its ranks run on CPUs: they hold no GPU, and are never suspended)"))
        held = getattr(self, "_held", {})
        problem = room_problem(self.topology, held, remote=_remote(group), verbs=verbs)
        if problem:
            raise ClorchError(f"cannot resume yet: {problem}")
        t0 = time.monotonic()
        ranks = [p.rank for p in group.ranks]
        total = sum(b for b in held.values() if b)
        self.life.move("resume", f"{size(total)} moving back to the GPUs")
        progress(f"resuming {rank_words(ranks)}: {size(total)} back to the GPUs")
        try:
            moved = drive("resume", group, ranks, total, verbs)
        except ClorchError as exc:  # the helper could not be run or timed out: where each rank is, unknown
            self.life.move("degrade", f"a resume failed ({exc})")
            raise ClorchError(f"the resume failed ({exc}); {verbs.stop}, then {verbs.start}") from None
        if not all(m.ok for m in moved.values()):
            return self._undo_resume(moved, total)
        progress("forming the group again")
        self._generation += 1
        lost = regroup(relay, group, self._generation)
        if lost:
            self.life.move("degrade", f"the group could not be formed again after the resume ({lost})")
            raise ClorchError(f"every rank has its GPU back and kept its variables, but the group could not be "
                              f"formed again ({lost}): {_fresh(group, verbs)}")
        self.life.move("resumed")
        _spares_again(group)
        return (f"clorch: resumed {rank_words(ranks)} in {time.monotonic() - t0:.1f} s: each rank back on its own "
                "GPU with every variable and tensor, the group formed again")

    def _undo_resume(self: Any, moved: dict[int, Moved], total: int) -> str:
        """Some rank could not be restored: those that were go back to host memory, so the session
        is suspended as a whole again and the resume can be retried."""
        group, _ = self._require()
        verbs = self.hooks.verbs
        failure = _failures(moved)
        restored = [r for r, m in moved.items() if m.ok]
        again = drive("suspend", group, restored, total, verbs) if restored else {}
        if not all(m.ok for m in again.values()):
            self.life.move("degrade", f"a resume failed midway ({failure}; {_failures(again)})")
            raise ClorchError(f"the resume failed ({failure}) and {rank_words(restored)} could not be suspended "
                              f"again ({_failures(again)}): {verbs.stop}, then {verbs.start}")
        holders = who_holds(self.topology, [r for r, m in moved.items() if not m.ok], _remote(group))
        self.life.move("resume_failed", _held_line(total, verbs))
        raise ClorchError(f"cannot resume yet: {failure}{'; ' + holders if holders else ''}; the session stays "
                          f"suspended: run {verbs.resume} again")
