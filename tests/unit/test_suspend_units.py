"""Suspend and resume (issue 37) without a GPU: the refusals a user reads, the session's states
and moves, the idle timer of ``--suspend-after``, and the driver wrapper's error messages.

Stand-ins, each only where the real part cannot exist on this machine (no GPU, no NVIDIA driver):
``_FakeCuda`` stands in for libcuda.so.1 (its checkpoint calls), ``drive`` (the helper process
that calls the driver) is replaced where a whole suspend is walked through, and ``_Relay`` stands in
for ranks whose processes the driver would checkpoint. A live CPU session's refusal is tested in
tests/integration/test_suspend.py; the real driver in tests/gpu/test_gpu_suspend.py.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pytest

from clorch_repl.host import cuda_checkpoint
from clorch_repl.errors import ClorchError, ConfigError
from clorch_repl.magics.suspend import IdleSuspend, parse_duration
from clorch_repl.session import suspend as susp
from clorch_repl.notebook.hooks import NotebookHooks
from clorch_repl.session.lifecycle import IllegalMove, Lifecycle, SessionState
from clorch_repl.session.session import Session
from clorch_repl.common.topology import Topology

GPU = Topology(nproc=2, devices=(0, 1), backend="nccl", timeout_s=600)
CPU = Topology(nproc=2, devices=(None, None), backend="gloo", timeout_s=600)
S = SessionState
#: the notebook's words: these tests read what the notebook's user reads (the engine's own words:
#: tests/unit/test_engine_verbs_units.py)
NB = NotebookHooks.verbs


# --------------------------------------------------------------------------- states and moves
def test_a_session_is_suspended_and_resumed_through_named_moves() -> None:
    life = Lifecycle(S.READY)
    for move, state in (("suspend", "suspending"), ("suspended", "suspended"), ("resume", "resuming"),
                        ("resume_failed", "suspended"), ("resume", "resuming"), ("resumed", "ready"),
                        ("suspend", "suspending"), ("resumed", "ready")):  # the last: a failed suspend
        assert life.move(move).value == state
    with pytest.raises(IllegalMove, match="cannot resume while ready"):
        life.move("resume")
    life.move("suspend")
    life.move("suspended")
    assert life.move("stop").value == "stopping"  # a suspended session can always be stopped


def test_cells_are_refused_while_suspended_and_offer_resume() -> None:
    for state in (S.SUSPENDING, S.SUSPENDED, S.RESUMING):
        with pytest.raises(ClorchError, match="%clorch resume gives them their GPUs back"):
            susp.refuse_cell(Lifecycle(state, why="20.0 GiB of GPU memory held in host memory"), verbs=NB)
    susp.refuse_cell(Lifecycle(S.READY))  # nothing said


# --------------------------------------------------------------------------------- refusals
def test_refusals_say_why_and_what_to_do() -> None:
    local = _Launcher()
    assert "hold no GPU to give back" in susp.refusal(S.READY, CPU, [], [], local, NB)
    assert "running a cell: wait for it to finish or %clorch interrupt" in susp.refusal(S.READY, GPU, [1], [], local, NB)
    assert "rank 0 is dead: %clorch restart --ranks 0" in susp.refusal(S.READY, GPU, [], [0], local, NB)
    assert "suspended already: %clorch resume" in susp.refusal(S.SUSPENDED, GPU, [], [], local, NB)
    assert "the session is degraded" in susp.refusal(S.DEGRADED, GPU, [], [], local, NB)
    assert susp.refusal(S.READY, GPU, [], [], local) is None
    assert "%clorch restart --ranks or %clorch restart first" in susp.refusal(S.DEGRADED, GPU, [], [], local, NB)


def test_ranks_a_launcher_cannot_replace_alone_are_never_advised_restart_ranks() -> None:
    # A remote (slurm, attach) session cannot replace rank 0 alone: it serves the group's store.
    # The rule is RemoteLauncher's own; the launcher around it is the stand-in (no cluster here).
    from clorch_repl.launchers.remote import RemoteLauncher

    class _Server:
        def is_lost(self, rank: int) -> bool:
            return False

    class _Remote(_Launcher):
        name = "slurm"
        server = _Server()

        def instead_of_replacing(self, ranks: list[int]) -> str:
            return RemoteLauncher.cannot_replace(self, ranks)  # type: ignore[arg-type]

    degraded = susp.refusal(S.DEGRADED, GPU, [], [0], _Remote(), NB)
    assert degraded.endswith("(%clorch status says why; %clorch restart first)") and "--ranks" not in degraded
    assert "%clorch restart --ranks or %clorch restart first" in susp.refusal(S.DEGRADED, GPU, [], [1], _Remote(), NB)
    dead = susp.refusal(S.READY, GPU, [], [0], _Remote())
    assert dead.startswith("rank 0 is dead: rank 0 serves the group's rendezvous store") and "--ranks" not in dead


def test_a_detached_sessions_refusals_never_advise_the_restart_it_refuses() -> None:
    """In a detached (connected) session ``%clorch restart [--ranks]`` is refused: a suspend
    refused for a dead rank advised ``%clorch restart --ranks 1`` there; now what works there."""
    import os

    from clorch_repl.launchers.adopted import FRESH_RANKS, AdoptedLauncher

    me = os.getpid()
    adopted = AdoptedLauncher.from_entries(GPU, "/s", [(0, "/s/r0.json", me, me, 0.0), (1, "/s/r1.json", me, me, 0.0)],
                                           "/s.json")
    dead = susp.refusal(S.READY, GPU, [], [1], adopted, NB)
    assert dead == ("rank 1 is dead: a detached session cannot start rank 1 again (%clorch restart is refused "
                    f"there): for fresh ranks, {FRESH_RANKS}")
    degraded = susp.refusal(S.DEGRADED, GPU, [], [], adopted, NB)
    assert degraded == ("the session is degraded: suspend needs every rank alive in its group (%clorch status says "
                        "why; a detached session cannot be restarted (%clorch restart is refused there): for fresh "
                        f"ranks, {FRESH_RANKS})")
    assert susp._fresh(adopted) == adopted.instead_of_restarting()  # a failed suspend's or resume's advice
    assert susp._fresh(_Launcher(), NB) == "%clorch restart gives fresh ranks and a fresh group"


def test_a_gpu_taken_at_resume_is_named_with_who_holds_it() -> None:
    def holders(gpu: str) -> tuple[int | None, list[str]]:
        return ({"0": 80 * 2**30, "1": 2 * 2**30}[gpu], ["pid 4242 (python, 138.0 GiB)"] if gpu == "1" else [])

    problem = susp.room_problem(GPU, {0: 20 * 2**30, 1: 20 * 2**30}, holders, verbs=NB)
    assert problem is not None and "rank 1's GPU 1 has 2.0 GiB free and rank 1 needs 20.0 GiB" in problem
    assert "held by pid 4242 (python, 138.0 GiB)" in problem and "run %clorch resume again" in problem
    assert "rank 0" not in problem
    assert susp.room_problem(GPU, {0: 20 * 2**30, 1: 1 * 2**30}, holders) is None


def test_a_failed_restore_names_the_process_on_the_ranks_gpu() -> None:
    def holders(gpu: str) -> tuple[int | None, list[str]]:
        return 100 * 2**30, ["pid 4242 (python, 38.0 GiB)"] if gpu == "1" else []

    assert susp.who_holds(GPU, [0, 1], holders=holders) == "rank 1's GPU 1 is used by pid 4242 (python, 38.0 GiB)"
    assert susp.who_holds(GPU, [1], frozenset({1}), holders=holders) == ""  # its host's nanny would know


# ------------------------------------------------------------------ a whole suspend, stand-ins
@dataclass
class _Rank:
    rank: int
    pid: int
    host: str = ""
    alive: bool = True
    exit: str | None = None
    started_at: float = 0.0


@dataclass
class _Launcher:
    """Stands in for the local launcher of 2 GPU ranks (no GPU here to start them on)."""

    name = "local"

    ranks: list[_Rank] = field(default_factory=lambda: [_Rank(0, 100), _Rank(1, 101)])
    spares: list[Any] = field(default_factory=lambda: ["spare0", "spare1"])
    formed: int = 0
    ended: list[Any] = field(default_factory=list)

    def _end(self, handles: list[Any], grace_s: float, polite: bool) -> list[str]:
        self.ended.extend(handles)
        return []

    def memory(self) -> dict[int, tuple[int | None, int | None]]:
        return {0: (2**30, 20 * 2**30), 1: (2**30, 20 * 2**30)}

    def group_formed(self) -> None:
        self.formed += 1

    def instead_of_replacing(self, ranks: list[int]) -> str:  # as the local launcher: it replaces ranks
        return ""

    def instead_of_restarting(self) -> str:
        return ""


class _Relay:
    """Stands in for the ranks' channels: records the abort order and the regroup requests."""

    def __init__(self, regroup_ok: bool = True) -> None:
        self.asked: list[tuple[list[int], bool]] = []
        self.requests: list[str] = []
        self.regroup_ok = regroup_ok
        self.channels = self
        self.prober = self

    def busy(self) -> list[int]:
        return []

    def ask(self, ranks: list[int], *, abort: bool = False, timeout_s: float = 0.0) -> dict[int, Any]:
        self.asked.append((list(ranks), abort))
        return {r: {"communicators": 1} for r in ranks}

    def execute(self, request: Any, sink: Any = None, *, silent: bool = False) -> Any:
        self.requests.append(request.code)
        return type("Outcome", (), {"ok": self.regroup_ok, "failed": [], "interrupted": False})()


def _session(relay: _Relay) -> Session:
    session = Session(GPU, hooks=NotebookHooks())
    session.group, session.relay = _Launcher(), relay  # type: ignore[assignment]
    session.life = Lifecycle(S.READY)
    return session


def _drive(fail: dict[str, set[int]], calls: list[tuple[str, list[int]]]) -> Any:
    def drive(action: str, launcher: Any, ranks: list[int], held: int, *_: Any) -> dict[int, susp.Moved]:
        calls.append((action, list(ranks)))
        return {r: susp.Moved(r, r not in fail.get(action, set()), {action: 1.0},
                              "" if r not in fail.get(action, set()) else f"rank {r} on here: cuCheckpointProcess"
                              "Checkpoint(101) failed with CUDA_ERROR_NOT_SUPPORTED") for r in ranks}
    return drive


def test_what_a_rank_holds_falls_back_to_its_gpus_figure_where_nvidia_smi_lists_no_pid() -> None:
    class Unlisted(_Launcher):
        def memory(self) -> dict[int, tuple[int | None, int | None]]:
            return {0: (2**30, None), 1: (2**30, 3 * 2**30)}

    held = susp.held_bytes(Unlisted(), GPU, used=lambda gpu: {"0": 21 * 2**30}.get(gpu))  # type: ignore[arg-type]
    assert held == {0: 21 * 2**30, 1: 3 * 2**30}


def test_suspend_then_resume_moves_the_state_and_forms_the_group_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(susp, "drive", _drive({}, calls))  # stand-in: no driver to checkpoint with here
    monkeypatch.setattr(susp.cuda_checkpoint, "api_problem", lambda: None)
    monkeypatch.setattr(susp, "room_problem", lambda topology, held, remote, verbs: None)
    relay = _Relay()
    session = _session(relay)
    line = session.suspend()
    assert "40.0 GiB of GPU memory moved to host memory" in line and session.life.state is S.SUSPENDED
    assert relay.asked == [([0, 1], True)] and calls == [("suspend", [0, 1])]
    assert session.group.ended == ["spare0", "spare1"] and session.group.spares == []  # warm spares ended
    assert "40.0 GiB of GPU memory held in host memory" in session.life.why
    with pytest.raises(ClorchError, match="suspended"):
        session.run("x = 1", None, None, None)
    with pytest.raises(ClorchError, match="then %clorch why"):
        session.why()  # the ranks are not asked: their answer would wait for the resume
    assert session.saves_in_flight() == {}
    assert "resumed ranks 0-1" in session.resume() and session.life.state is S.READY
    assert calls[-1] == ("resume", [0, 1]) and "regroup" in relay.requests[-1]
    assert session.group.formed == 1  # warm spares started again


def test_a_failed_suspend_gives_back_what_it_took_and_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(susp, "drive", _drive({"suspend": {1}}, calls))  # stand-in (no driver here)
    monkeypatch.setattr(susp.cuda_checkpoint, "api_problem", lambda: None)
    relay = _Relay()
    session = _session(relay)
    with pytest.raises(ClorchError, match="runs on as before .*CUDA_ERROR_NOT_SUPPORTED"):
        session.suspend()
    assert calls == [("suspend", [0, 1]), ("resume", [0])] and session.life.state is S.READY
    assert len(relay.requests) == 1 and "regroup" in relay.requests[0]
    assert session.group.formed == 1  # the warm spares ended for it are started again


def test_a_driver_without_the_api_is_refused_before_anything_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(susp.cuda_checkpoint, "api_problem", lambda: "the CUDA driver here (CUDA 12.4) has no "
                        "cuCheckpointProcessLock; suspending needs " + cuda_checkpoint.NEEDED)
    relay = _Relay()
    session = _session(relay)
    with pytest.raises(ClorchError, match="cannot suspend: .*CUDA 12.4.*driver 570 or later"):
        session.suspend()
    assert relay.asked == [] and session.life.state is S.READY


def test_resume_of_a_session_that_is_not_suspended_is_refused() -> None:
    session = _session(_Relay())
    with pytest.raises(ClorchError, match="nothing to resume: the session is ready"):
        session.resume()


# ------------------------------------------------------------------------ --suspend-after
def test_durations_read_as_a_user_writes_them() -> None:
    assert [parse_duration(v) for v in ("900", "90s", "30m", "2h", "1d", "0")] == [900, 90, 1800, 7200, 86400, 0]
    assert parse_duration(None) is None
    assert parse_duration("30d") == 30 * 86400  # the limit itself
    for typo in ("31d", "99999d", "10000000"):  # taken before, and never fired
        with pytest.raises(ConfigError, match=r"--suspend-after must be at most 30d \(30 days\); got"):
            parse_duration(typo)
    with pytest.raises(ConfigError, match="takes a duration such as 30m"):
        parse_duration("soon")


class _Loop:
    """Stands in for the kernel's event loop: records what is scheduled, runs nothing by itself."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[float, Any]] = []

    def call_later(self, delay: float, callback: Any) -> Any:
        self.scheduled.append((delay, callback))
        return type("Handle", (), {"cancel": lambda self: None})()


class _IdleSession:
    def __init__(self) -> None:
        self.life = Lifecycle(S.READY)
        self.relay = _Relay()
        self.running = True
        self.suspends = 0

    def suspend(self) -> str:
        self.suspends += 1
        self.life = Lifecycle(S.SUSPENDED)
        return "clorch: suspended ranks 0-1 in 9.0 s: 40.0 GiB of GPU memory moved to host memory"


def test_the_idle_timer_suspends_once_no_cell_ran_that_long_and_says_so_at_the_next_cell(
        capsys: pytest.CaptureFixture[str]) -> None:
    now = [1000.0]
    magics = type("Magics", (), {"shell": None, "session": _IdleSession()})()
    loop = _Loop()
    idle = IdleSuspend(magics, 1800.0, loop, clock=lambda: now[0])  # type: ignore[arg-type]
    idle.arm()
    assert loop.scheduled[-1][0] == 1800.0
    now[0] += 1000
    idle.post_run_cell()  # a cell ran: the idle time starts again
    now[0] += 900
    idle.check()
    assert magics.session.suspends == 0 and loop.scheduled[-1][0] == pytest.approx(900.0)
    now[0] += 900
    idle.check()
    assert magics.session.suspends == 1
    idle.check()  # suspended already: never twice
    assert magics.session.suspends == 1
    idle.pre_run_cell()
    said = capsys.readouterr().out
    assert said.startswith("clorch: no cell ran for 30m00s, so the session was suspended (--suspend-after)")
    assert "40.0 GiB of GPU memory moved to host memory" in said
    idle.pre_run_cell()
    assert capsys.readouterr().out == ""  # said once


def test_the_idle_timer_waits_for_a_running_cell() -> None:
    now = [0.0]
    session = _IdleSession()
    session.relay.busy = lambda: [0]  # type: ignore[method-assign]
    idle = IdleSuspend(type("M", (), {"shell": None, "session": session})(), 60.0, _Loop(), clock=lambda: now[0])
    now[0] = 120.0
    idle.check()
    assert session.suspends == 0


# ---------------------------------------------------------------------- the driver wrapper
class _FakeCuda:
    """Stands in for libcuda.so.1 (no NVIDIA driver on this machine): the checkpoint calls with
    the driver's return codes, out-parameters written through ctypes as the driver writes them."""

    NAMES = {0: b"CUDA_SUCCESS", 2: b"CUDA_ERROR_OUT_OF_MEMORY", 801: b"CUDA_ERROR_NOT_SUPPORTED"}
    TEXT = {2: b"out of memory", 801: b"operation not supported"}

    def __init__(self, fail: dict[str, int] | None = None, state: int = 0) -> None:
        self.fail = fail or {}
        self.state = state
        self.calls: list[str] = []
        self.lock_timeout: int | None = None

    def cuDriverGetVersion(self, ref: Any) -> int:
        ref._obj.value = 12080
        return 0

    def cuInit(self, flags: int) -> int:
        self.calls.append("cuInit")
        return 0

    def cuGetErrorName(self, code: int, ref: Any) -> int:
        ref._obj.value = self.NAMES.get(code, b"CUDA_ERROR_UNKNOWN")
        return 0

    def cuGetErrorString(self, code: int, ref: Any) -> int:
        ref._obj.value = self.TEXT.get(code, b"unknown error")
        return 0

    def cuCheckpointProcessGetState(self, pid: int, ref: Any) -> int:
        ref._obj.value = self.state
        return 0

    def _call(self, name: str, pid: int, args: Any) -> int:
        self.calls.append(name)
        assert ctypes.sizeof(args._obj) == 64
        return self.fail.get(name, 0)

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> int:
        self.lock_timeout = args._obj.timeoutMs
        return self._call("lock", pid, args)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> int:
        return self._call("checkpoint", pid, args)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
        return self._call("restore", pid, args)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> int:
        return self._call("unlock", pid, args)


def test_the_driver_wrapper_calls_the_steps_in_order() -> None:
    lib = _FakeCuda()
    times = cuda_checkpoint.Driver(lib).suspend(4242, "rank 0 on gpu7")
    assert lib.calls == ["cuInit", "lock", "checkpoint"] and set(times) == {"lock", "checkpoint"}
    assert lib.lock_timeout == cuda_checkpoint.LOCK_TIMEOUT_MS
    lib = _FakeCuda(state=2)
    cuda_checkpoint.Driver(lib).resume(4242, "rank 0 on gpu7")
    assert lib.calls == ["cuInit", "restore", "unlock"]


def test_a_failed_call_names_rank_host_call_and_the_drivers_words_and_unlocks() -> None:
    lib = _FakeCuda(fail={"checkpoint": 801})
    with pytest.raises(cuda_checkpoint.CheckpointError) as caught:
        cuda_checkpoint.Driver(lib).suspend(4242, "rank 1 on gpu7")
    assert str(caught.value) == ("rank 1 on gpu7: cuCheckpointProcessCheckpoint(4242) failed with "
                                 "CUDA_ERROR_NOT_SUPPORTED: operation not supported")
    assert lib.calls[-1] == "unlock"  # the process runs on as before
    with pytest.raises(cuda_checkpoint.CheckpointError, match="not checkpointed: nothing to resume"):
        cuda_checkpoint.Driver(_FakeCuda(state=0)).resume(1, "rank 0 on gpu7")
    with pytest.raises(cuda_checkpoint.CheckpointError, match="out of memory"):
        cuda_checkpoint.Driver(_FakeCuda(state=2, fail={"restore": 2})).resume(1, "rank 0 on gpu7")


def test_a_driver_without_the_symbols_names_the_version_needed() -> None:
    class Old:
        def cuDriverGetVersion(self, ref: Any) -> int:
            ref._obj.value = 12040
            return 0

    problem = cuda_checkpoint.api_problem(Old())
    assert problem is not None and "CUDA 12.4" in problem and "cuCheckpointProcessLock" in problem
    assert "driver 570 or later" in problem
    with pytest.raises(cuda_checkpoint.CheckpointError, match="driver 570 or later"):
        cuda_checkpoint.Driver(Old())
    assert cuda_checkpoint.api_problem(_FakeCuda()) is None


def test_the_helper_runs_every_process_and_reports_each() -> None:
    lib = _FakeCuda(fail={"checkpoint": 801})
    outcomes = cuda_checkpoint.act(cuda_checkpoint.Driver(lib), "suspend", [(1, "rank 0 on a"), (2, "rank 1 on a")])
    assert [o.pid for o in outcomes] == [1, 2] and not any(o.ok for o in outcomes)
    assert "rank 1 on a: cuCheckpointProcessCheckpoint(2)" in outcomes[1].error


def test_ranks_on_other_hosts_are_moved_by_their_nannies_and_silence_is_named() -> None:
    class Remote(_Launcher):
        """Stands in for a remote launcher's nannies (their real round trip: tests/integration/test_suspend.py)."""

        def checkpoint(self, action: str, ranks: list[int], timeout_s: float) -> dict[int, Any]:
            return {0: {"outcome": {"pid": 100, "ok": True, "seconds": {"lock": 0.0, "checkpoint": 9.5}}},
                    1: None}

    launcher = Remote(ranks=[_Rank(0, 100, "nodeA"), _Rank(1, 101, "nodeB")])
    moved = susp.drive("suspend", launcher, [0, 1], 0)  # type: ignore[arg-type]
    assert moved[0].ok and moved[0].seconds["checkpoint"] == 9.5
    assert not moved[1].ok and moved[1].error == "rank 1 on nodeB: its nanny did not report the suspend within 120 s"


def test_a_helper_that_cannot_run_leaves_the_session_running(monkeypatch: pytest.MonkeyPatch) -> None:
    def drive(action: str, launcher: Any, ranks: list[int], held: int, *_: Any) -> dict[int, susp.Moved]:
        raise ClorchError("the CUDA driver did not suspend ranks 0-1 within 120 s; %clorch stop ends them")

    monkeypatch.setattr(susp, "drive", drive)  # stand-in for the helper (no driver here)
    monkeypatch.setattr(susp.cuda_checkpoint, "api_problem", lambda: None)
    relay = _Relay()
    session = _session(relay)
    with pytest.raises(ClorchError, match="runs on as before .*within 120 s"):
        session.suspend()
    assert session.life.state is S.READY and "regroup" in relay.requests[-1]


def test_the_top_panel_shows_suspended_with_the_memory_held_and_asks_no_rank() -> None:
    from clorch_repl.notebook.panel import Panel

    class Prober:
        """Stands in for the ranks' control channels (a real panel: tests/integration/test_top.py)."""

        def __init__(self) -> None:
            self.asked: list[Any] = []

        def ask(self, *args: Any, **kwargs: Any) -> dict[int, Any]:
            self.asked.append(args)
            return {}

        def send(self, *args: Any, **kwargs: Any) -> dict[str, int]:
            self.asked.append(args)
            return {}

        def collect(self, waiting: dict[str, int], timeout_s: float = 0.0) -> dict[str, Any]:
            return {}

        def close(self) -> None:
            pass

    prober = Prober()
    relay = type("Relay", (), {"busy": lambda self: [], "new_prober": lambda self: prober,
                               "add_tick": lambda self, tick: None, "remove_tick": lambda self, tick: None})()
    group = _Launcher()
    group.current_log_tail = lambda rank, lines: f"rank {rank}'s last line\n"  # type: ignore[attr-defined]
    session = Session(GPU)  # the real session's view, over the stand-ins
    session.group, session.relay = group, relay  # type: ignore[assignment]
    session.life = Lifecycle(S.SUSPENDED, why="40.0 GiB of GPU memory held in host memory since 14:02:11")
    shown: list[dict[str, str]] = []
    panel = Panel(lambda: session, interval_s=0.2, show=shown.append)
    panel.start()
    panel._round(1e9)
    assert prober.asked == []  # a suspended rank's answer would wait for the resume
    assert "(suspended: 40.0 GiB of GPU memory held in host memory" in shown[-1]["text/plain"]
    panel.close()


def test_a_resume_that_cannot_restore_a_rank_stays_suspended_and_says_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(susp.cuda_checkpoint, "api_problem", lambda: None)
    monkeypatch.setattr(susp, "room_problem", lambda topology, held, remote, verbs: None)
    monkeypatch.setattr(susp, "who_holds", lambda topology, ranks, remote: "rank 1's GPU 1 is used by pid 4242 "
                        "(python, 38.0 GiB)")  # stand-in for nvidia-smi (no GPU here)
    monkeypatch.setattr(susp, "drive", _drive({"resume": {1}}, calls))  # stand-in for the driver
    relay = _Relay()
    session = _session(relay)
    session.suspend()
    with pytest.raises(ClorchError, match=r"cannot resume yet: .*pid 4242 .*stays suspended: run %clorch resume again"):
        session.resume()
    assert session.life.state is S.SUSPENDED and "held in host memory" in session.life.why
    assert calls == [("suspend", [0, 1]), ("resume", [0, 1]), ("suspend", [0])]  # rank 0 back to host memory
    assert relay.requests == []  # no group formed while a rank is still suspended


class _StoppedRelay(_Relay):
    """A relay whose ranks are idle and whose channels close (a stop's side of the relay)."""

    def set_comm_sink(self, sink: Any) -> None:
        pass

    def idle(self, rank: int) -> bool:
        return True

    def close(self) -> None:
        pass


def test_stopping_a_suspended_session_ends_the_ranks_without_asking_them_to_leave() -> None:
    class Stoppable(_Launcher):
        def stop(self, grace_s: float = 5.0, *, polite: bool = True) -> list[str]:
            self.polite = polite
            return []

        def close(self) -> None:
            pass

    relay = _StoppedRelay()
    session = _session(relay)
    group = Stoppable()
    session.group = group  # type: ignore[assignment]
    session.life = Lifecycle(S.SUSPENDED)
    assert session.stop() == []
    assert relay.requests == [] and group.polite is False  # no leave request: it would wait on locked CUDA
    assert session.life.state is S.STOPPED


def test_a_stop_whose_close_is_interrupted_never_leaves_an_earlier_stops_logs_to_show() -> None:
    """A review's finding: ``session.logs(N)`` after a stop reads the folder that stop kept; where
    the launcher's close was cut short (a second Ctrl-C) the session still named an earlier
    stop's folder, and showed that session's log as this one's."""
    class Interrupted(_Launcher):
        kept_logs = "/tmp/clorch-this-stop-logs"

        def stop(self, grace_s: float = 5.0, *, polite: bool = True) -> list[str]:
            return []

        def close(self) -> None:
            raise KeyboardInterrupt

    session = _session(_StoppedRelay())
    session.kept_logs = "/tmp/clorch-an-earlier-stop-logs"
    session.group = Interrupted()  # type: ignore[assignment]
    session.life = Lifecycle(S.SUSPENDED)  # (stopped without a leave request: nothing asked of the fake)
    with pytest.raises(KeyboardInterrupt):
        session.stop()
    assert session.kept_logs == ""


def test_the_idle_suspend_ends_with_the_session() -> None:
    """``%clorch stop`` (and the extension's unload) end the session's --suspend-after: its timer
    was left waking on the kernel's loop for good, and the next ``%clorch start`` said "the session
    will not suspend by itself" of a session that never had the setting."""
    from clorch_repl.magics.suspend import end_idle_suspend, set_idle_suspend

    cancelled: list[bool] = []

    class _CancellingLoop(_Loop):
        def call_later(self, delay: float, callback: Any) -> Any:
            self.scheduled.append((delay, callback))
            return type("Handle", (), {"cancel": lambda self: cancelled.append(True)})()

    magics = type("Magics", (), {"shell": None, "session": _IdleSession()})()
    idle = IdleSuspend(magics, 600.0, _CancellingLoop())  # type: ignore[arg-type]
    idle.arm()
    magics._idle_suspend = idle  # what %clorch start --suspend-after 10m arms (refused here: no GPU)
    end_idle_suspend(magics)
    assert cancelled == [True] and magics._idle_suspend is None
    assert set_idle_suspend(magics, None) is None  # the next start (no --suspend-after) says nothing of it
    end_idle_suspend(magics)  # nothing armed: nothing to do, nothing said
