"""Issue 36, the pure parts: the hold rule the supervisors follow, and the session file's content
and validation (what a kernel reads before it connects to ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat

import pytest

from clorch_repl.errors import ConfigError
from clorch_repl.host import hold
from clorch_repl.session import registry
from clorch_repl.common.topology import Topology

HOLD = {"owner_pid": 1234, "owner_start": 5, "keep_for_s": 10.0, "session_file": ""}


def test_without_a_hold_the_rank_lives_exactly_as_long_as_its_notebook() -> None:
    assert hold.decide(None, parent_alive=True, alive=False, unowned_since=None, now=100.0) == (True, None)
    assert hold.decide(None, parent_alive=False, alive=False, unowned_since=None, now=100.0) == (False, None)


def test_a_live_owner_keeps_the_rank_and_clears_the_idle_clock() -> None:
    assert hold.decide(HOLD, parent_alive=False, alive=True, unowned_since=50.0, now=100.0) == (True, None)


def test_without_an_owner_the_rank_is_kept_for_keep_for_then_ended() -> None:
    kept, since = hold.decide(HOLD, parent_alive=False, alive=False, unowned_since=None, now=100.0)
    assert kept and since == 100.0
    assert hold.decide(HOLD, parent_alive=False, alive=False, unowned_since=since, now=109.9) == (True, 100.0)
    assert hold.decide(HOLD, parent_alive=False, alive=False, unowned_since=since, now=110.0) == (False, 100.0)


def test_a_live_parent_that_was_taken_over_does_not_keep_the_rank() -> None:
    """The first kernel lives on after another took the session and ended: keep-for still counts."""
    assert hold.decide(HOLD, parent_alive=True, alive=False, unowned_since=100.0, now=110.0) == (False, 100.0)


def test_a_new_owner_before_expiry_starts_the_clock_again() -> None:
    _, since = hold.decide(HOLD, parent_alive=False, alive=False, unowned_since=None, now=100.0)
    _, since = hold.decide(HOLD, parent_alive=False, alive=True, unowned_since=since, now=105.0)
    assert since is None
    assert hold.decide(HOLD, parent_alive=False, alive=False, unowned_since=since, now=200.0) == (True, 200.0)


def test_the_watcher_reads_the_hold_and_notices_a_dead_owner(tmp_path) -> None:
    now = [0.0]
    watcher = hold.Watcher(str(tmp_path), clock=lambda: now[0])
    assert watcher.keep(parent_alive=True) and not watcher.keep(parent_alive=False)  # no hold: as today
    hold.write(str(tmp_path), os.getpid(), 2.0, "")
    now[0] = 1.0
    assert watcher.keep(parent_alive=False)  # this process, the owner, is alive
    assert oct(stat.S_IMODE(os.stat(tmp_path / hold.HOLD_NAME).st_mode)) == "0o600"
    with open(tmp_path / hold.HOLD_NAME, "w") as fh:  # an owner that is gone (pid reused: start differs)
        json.dump({**HOLD, "owner_pid": os.getpid(), "owner_start": -1, "keep_for_s": 2.0}, fh)
    now[0] = 2.0
    assert watcher.keep(parent_alive=True) and hold.unowned_since(str(tmp_path)) is not None
    now[0] = 4.1
    assert not watcher.keep(parent_alive=True)


def test_a_watcher_without_a_session_dir_follows_the_parent() -> None:
    assert hold.Watcher(None).keep(True) and not hold.Watcher(None).keep(False)


def test_the_session_file_is_removed_only_while_it_names_this_session(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"dir": "/other"}))
    assert not hold.remove_session_file(str(path), "/mine") and path.exists()
    path.write_text(json.dumps({"dir": "/mine"}))
    assert hold.remove_session_file(str(path), "/mine") and not path.exists()


def record(**changes) -> registry.SessionRecord:
    fields = dict(name="alice-1", launcher="local", dir="/tmp/clorch-x",
                  topology=Topology(nproc=2, devices=(None, None), backend="gloo", timeout_s=60.0),
                  ranks=tuple(registry.RankEntry(r, f"/tmp/clorch-x/rank{r}.json", 100 + r, 200 + r, 1.0)
                              for r in range(2)),
                  generation=3, keep_for_s=3600.0, owner_pid=42)
    fields.update(changes)
    return registry.SessionRecord(**fields)


def test_a_record_survives_its_json() -> None:
    original = record()
    data = json.loads(json.dumps(original.to_json()))
    assert "key" not in json.dumps(data)  # the keys stay in the connection files
    assert registry.parse_record(data, "f.json") == original
    assert original.host == socket.gethostname()  # %clorch sessions' hosts column
    data.pop("host")  # a file written before the column: listed, its host unknown
    assert registry.parse_record(data, "f.json").host == "?"


@pytest.mark.parametrize("damage, said", [
    (lambda d: d.update(version=99), "another clorch_repl version"),
    (lambda d: d.pop("dir"), "'dir' is missing"),
    (lambda d: d.update(generation="3"), "'generation' is missing or not a int"),
    (lambda d: d["ranks"].pop(), "lists ranks [0] for 2 rank(s)"),
    (lambda d: d.update(uid=os.getuid() + 1), "not yours to connect to"),
    (lambda d: d.update(keep_for_s=0), "out of range"),
    (lambda d: d.update(name="../etc"), "session name '../etc'"),
    (lambda d: d["ranks"][0].update(pid=True), "'pid' is missing"),
])
def test_a_damaged_session_file_is_refused_naming_the_file(damage, said) -> None:
    data = record().to_json()
    damage(data)
    with pytest.raises(ConfigError) as err:
        registry.parse_record(data, "/run/clorch/alice-1.json")
    assert said in str(err.value)


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0),
                                           ("1d", 86400.0), ("0.5h", 1800.0)])
def test_durations(text, seconds) -> None:
    assert registry.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1s", "soon", "1w", "1h30m"])
def test_bad_durations_are_named(text) -> None:
    with pytest.raises(ConfigError, match="--keep-for must be a duration"):
        registry.parse_duration(text)


@pytest.mark.parametrize("name", ["", "a b", "../x", "-x", "x" * 65, "a/b"])
def test_bad_names_are_refused(name) -> None:
    with pytest.raises(ConfigError, match="session name"):
        registry.check_name(name)


def test_the_runtime_dir_is_private_and_a_shared_one_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    folder = registry.runtime_dir()
    assert oct(stat.S_IMODE(os.stat(folder).st_mode)) == "0o700"
    written = record()
    path = registry.write(written)
    assert oct(stat.S_IMODE(os.stat(path).st_mode)) == "0o600"
    assert registry.names() == ["alice-1"] and registry.read("alice-1") == written
    first = registry.default_name()
    assert first.endswith("-1")
    registry.write(record(name=first))
    assert registry.default_name() == first[:-1] + "2"  # the next free number
    os.chmod(folder, 0o755)
    with pytest.raises(ConfigError, match="mode 0700"):
        registry.runtime_dir()


def test_detach_refuses_other_launchers_saying_why() -> None:
    from types import SimpleNamespace

    from clorch_repl.session.reattach import detach

    session = SimpleNamespace(group=SimpleNamespace(name="slurm"))
    with pytest.raises(ConfigError, match="--launcher local sessions only; this one is slurm: its ranks' nannies end them .* "
                                           "cannot yet re-register with a new kernel's endpoint"):
        detach(session, "alice-1", 60.0, lambda _: None)  # type: ignore[arg-type]


def test_the_watcher_never_ends_a_rank_on_a_stale_reading(tmp_path) -> None:
    """A hold written just before the notebook died (within the half second between readings)
    is read before the rank is ended."""
    now = [0.0]
    watcher = hold.Watcher(str(tmp_path), clock=lambda: now[0])
    assert watcher.keep(parent_alive=True)  # read: no hold yet
    hold.write(str(tmp_path), os.getpid(), 60.0, "")
    now[0] = 0.1  # the notebook dies before the next regular reading
    assert watcher.keep(parent_alive=False)


def test_a_hold_that_vanished_ends_the_rank_though_its_parent_lives() -> None:
    """Another rank's supervisor ended first and removed the session directory."""
    assert hold.decide(None, parent_alive=True, alive=False, unowned_since=None, now=1.0, was_held=True) == (False, None)


def test_the_watcher_ends_its_rank_once_the_session_directory_is_gone(tmp_path) -> None:
    now = [0.0]
    folder = tmp_path / "session"
    folder.mkdir()
    watcher = hold.Watcher(str(folder), clock=lambda: now[0])
    hold.write(str(folder), os.getpid(), 60.0, "")
    assert watcher.keep(parent_alive=True)
    (folder / hold.HOLD_NAME).unlink()
    folder.rmdir()
    now[0] = 1.0
    assert not watcher.keep(parent_alive=True)


def test_a_session_file_whose_ranks_are_gone_is_stale_and_a_damaged_one_is_kept(tmp_path, monkeypatch) -> None:
    from clorch_repl.session.reattach import _stale

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    registry.write(record(dir=str(tmp_path)))  # pids 100, 101: not ours, long gone in a test's namespace
    assert _stale("alice-1") == (not any(os.path.exists(f"/proc/{p}") for p in (100, 101)))
    with open(registry.path_of("bob-1"), "w") as fh:
        fh.write("{not json")
    assert not _stale("bob-1")  # never removed silently: the user is told what is wrong with it


def test_a_session_of_another_host_in_a_shared_home_is_listed_not_judged(tmp_path, monkeypatch) -> None:
    """Jupyter's runtime directory is under the home, which clusters share between hosts: a
    session file of host B seen from host A names B's pids and folders, so A must neither call it
    ended (and remove it) nor connect to it."""
    from clorch_repl.session import reattach

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    registry.write(record(dir=str(tmp_path / "not-here"), host="node-b"))  # its pids mean nothing here
    assert not reattach._stale("alice-1")
    header, rows = reattach.status_rows()
    assert rows == [["alice-1", "2 x gloo", "node-b", "local", "not checked here", "-", "pid 42 on node-b", "-", "-"]]
    assert len(header) == len(rows[0])
    with pytest.raises(ConfigError, match="runs on host node-b, not here .* connect from a kernel on node-b"):
        reattach.connect("alice-1", take=False, progress=lambda _: None)
    assert os.path.exists(registry.path_of("alice-1"))  # listed, refused, and kept for its own host


def test_sessions_gpu_memory_is_measured_or_said_unknown_never_made_up() -> None:
    from clorch_repl.session.reattach import gpu_memory

    cpu = record()
    assert not cpu.topology.uses_gpu
    assert gpu_memory(cpu, {cpu.ranks[0].pid: 1 << 30}) == "cpu"  # CPU ranks: whatever else holds GPU memory
    gpu = dataclasses.replace(cpu, topology=dataclasses.replace(cpu.topology, devices=(0, 1)))
    pids = [r.pid for r in gpu.ranks]
    assert gpu_memory(gpu, {pids[0]: 3 << 30, pids[1]: 1 << 30, 999999: 5 << 30}) == "4.0 GiB"  # its ranks only
    assert gpu_memory(gpu, {pids[1]: 512 << 20}) == "512.0 MiB (1 of 2 ranks)"
    assert gpu_memory(gpu, {}) == "?"  # no nvidia-smi, or it lists none of them


def test_keep_for_is_said_in_the_unit_it_was_given() -> None:
    from clorch_repl.common.human import span

    assert [span(3600.0), span(1800.0), span(90.0), span(2.5)] == ["1 h", "30 min", "90 s", "2.5 s"]
    assert [span(30 * 86400.0), span(36 * 3600.0)] == ["30 d", "36 h"]  # 30d was said as "720 h"


@pytest.mark.parametrize("text", ["31d", "99999d", "721h", "2592001"])
def test_keep_for_beyond_30_days_is_refused_naming_the_option_and_the_limit(text) -> None:
    """``--keep-for 99999d`` was accepted: ranks kept 270 years with nobody driving them."""
    with pytest.raises(ConfigError) as err:
        registry.parse_duration(text)
    assert str(err.value) == (f"--keep-for must be at most 30d (30 days): ranks that no kernel drives hold their GPUs "
                              f"with nobody watching; got {text!r}. Give 30d or less: each %clorch connect starts "
                              "the count again")
    assert registry.parse_duration("30d") == registry.parse_duration("720h") == 30 * 86400.0  # the limit itself


def test_the_sessions_hang_notice_is_in_its_file_and_every_kernel_that_drives_it_uses_it(tmp_path) -> None:
    """``%clorch start --hang-notice 3`` is the session's setting: the kernel that detaches it and
    every kernel that connects (a ConnectedSession) must keep it, not fall back to the default."""
    from clorch_repl.diagnosis import DEFAULT_HANG_NOTICE_S
    from clorch_repl.session.reattach import ConnectedSession

    noticed = record(hang_notice_s=3.0)
    data = json.loads(json.dumps(noticed.to_json()))
    assert registry.parse_record(data, "f.json").hang_notice_s == 3.0
    assert ConnectedSession(noticed, str(tmp_path / "alice-1.json")).hang_notice_s == 3.0
    assert ConnectedSession(record(hang_notice_s=0.0), "x.json").hang_notice_s == 0.0  # off stays off
    data.pop("hang_notice_s")  # a file written before the setting was kept: the default
    assert registry.parse_record(data, "f.json").hang_notice_s == DEFAULT_HANG_NOTICE_S
    for bad in (-1, "3", True, None):
        with pytest.raises(ConfigError, match="'hang_notice_s' .* is not a number of seconds"):
            registry.parse_record({**data, "hang_notice_s": bad}, "f.json")


def test_the_sessions_suspend_after_is_in_its_file_and_a_kernel_that_connects_arms_it(
        tmp_path, ip, magics, monkeypatch) -> None:
    """``%clorch start --suspend-after 10m`` then ``%clorch detach``: the setting was lost, a
    kernel that connected never suspended the ranks by itself. Now the detach hands it to the
    session file and ``%clorch connect`` arms it again. What cannot run here (no GPU): the suspend
    itself (tests/gpu/test_gpu_suspend.py); the detach and the connect are stood in for (they start
    no process in a unit test; tests/integration/test_detach.py runs them for real)."""
    from types import SimpleNamespace

    from IPython.utils.capture import capture_output

    from clorch_repl.magics.suspend import set_idle_suspend
    from clorch_repl.session import reattach
    from clorch_repl.session.reattach import ConnectedSession

    kept = record(suspend_after_s=600.0)
    data = json.loads(json.dumps(kept.to_json()))
    assert registry.parse_record(data, "f.json").suspend_after_s == 600.0
    data.pop("suspend_after_s")  # a file written before the setting was kept: off
    assert registry.parse_record(data, "f.json").suspend_after_s == 0.0
    with pytest.raises(ConfigError, match="'suspend_after_s' -1 is not a number of seconds"):
        registry.parse_record({**data, "suspend_after_s": -1}, "f.json")

    detached: dict = {}

    def detach(session, name, keep_for_s, progress, suspend_after_s=0.0):
        detached.update(name=name, suspend_after_s=suspend_after_s)
        return ConnectedSession(dataclasses.replace(kept, name=name), str(tmp_path / f"{name}.json"))

    monkeypatch.setattr(reattach, "detach", detach)
    monkeypatch.setattr(reattach, "connect", lambda name, take, progress, hooks=None: (
        ConnectedSession(kept, str(tmp_path / "alice-1.json")), ""))
    magics.shutdown()
    try:
        set_idle_suspend(magics, 600.0)  # what %clorch start --suspend-after 10m arms (refused here: no GPU)
        magics.session = SimpleNamespace(running=True, group=SimpleNamespace(options=None))
        assert ip.run_cell("%clorch detach --name alice-1").success
        assert detached == {"name": "alice-1", "suspend_after_s": 600.0}
        magics.session = None
        set_idle_suspend(magics, 0)  # a fresh kernel: nothing armed
        with capture_output() as cap:
            assert ip.run_cell("%clorch connect alice-1").success
        assert magics._idle_suspend.after_s == 600.0  # armed again, from the session's file
        assert "--suspend-after 10m00s" in cap.stdout, cap.stdout  # (a terminal IPython: it cannot fire, it says)
    finally:
        set_idle_suspend(magics, 0)
        magics.session = None


def test_connects_tail_of_the_logs_is_text_without_colour_codes() -> None:
    """What the ranks printed lately, shown on connect, as ``%clorch logs`` shows it: IPython's
    coloured traceback in a rank's log is a terminal's, not text."""
    from types import SimpleNamespace

    from clorch_repl.session.reattach import tails

    logged = "\x1b[31mKeyboardInterrupt\x1b[39m: \n\x1b[32m     87\x1b[39m     x = 1\n"
    session = SimpleNamespace(topology=SimpleNamespace(nproc=1), logs=lambda rank, lines: logged,
                              group=SimpleNamespace(files=[SimpleNamespace(log_path="/s/rank0.log")]))
    shown = tails(session)  # type: ignore[arg-type]
    assert "\x1b" not in shown and "KeyboardInterrupt: \n     87     x = 1" in shown, repr(shown)


def _not_a_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read()) + 1  # above the kernel's largest pid: never a running process


def test_an_adopted_rank_that_died_says_how_as_its_supervisor_wrote_it(tmp_path) -> None:
    """A detached session's dead rank reads as it would in the kernel that started it ("exit code
    5"), from what its supervisor wrote beside its pid file; "ended" only where nothing was written."""
    from clorch_repl.host import hold, supervisor
    from clorch_repl.host.rankfiles import RankFiles
    from clorch_repl.launchers.adopted import AdoptedRank

    gone = _not_a_pid()
    connection_file = str(tmp_path / "rank1.json")

    def adopted() -> AdoptedRank:
        return AdoptedRank(1, connection_file, gone, gone, 0.0, RankFiles(str(tmp_path), 1))

    assert adopted().exit == "ended (see %clorch logs 1)"  # its supervisor was killed too: nothing written
    hold.write_private(supervisor.exit_path(connection_file + ".pid"), "5")  # as the supervisor writes it
    assert supervisor.exit_path(connection_file + ".pid") == connection_file + ".exit"
    assert adopted().exit == "exit code 5" and not adopted().alive
    hold.write_private(supervisor.exit_path(connection_file + ".pid"), "-9")  # as the supervisor writes it
    assert adopted().exit.startswith("killed by signal SIGKILL")


def test_advice_about_a_detached_sessions_lost_ranks_never_names_the_refused_restart() -> None:
    """A detached session cannot start ranks again (%clorch restart [--ranks] is refused, saying
    why): the header before each cell and the refusal of a cell on a dead rank say what works."""
    from types import SimpleNamespace

    from clorch_repl.errors import ClorchError
    from clorch_repl.launchers.adopted import FRESH_RANKS, AdoptedLauncher
    from clorch_repl.magics import views
    from clorch_repl.notebook.hooks import NotebookHooks
    from clorch_repl.session.cell_rules import refuse_dead_or_busy
    from clorch_repl.session.recovery import degraded_notice
    from clorch_repl.session.hooks import Verbs
    from clorch_repl.session.lifecycle import SessionState

    gone = _not_a_pid()
    launcher = AdoptedLauncher.from_entries(record().topology, "/s", [(0, "/s/r0.json", os.getpid(), os.getpid(), 0.0),
                                                                      (1, "/s/r1.json", gone, gone, 0.0)], "/s.json")
    advice = launcher.instead_of_replacing([1])
    assert advice == ("a detached session cannot start rank 1 again (%clorch restart is refused there): for fresh "
                      f"ranks, {FRESH_RANKS}")
    session = SimpleNamespace(life=SimpleNamespace(state=SessionState.DEGRADED, why="rank 1 died"), group=launcher,
                              lost=(1,), chosen=lambda ranks: (0,), hooks=NotebookHooks())
    header = degraded_notice(session)
    assert header == ("clorch: rank 1 died: cells run on rank 0, which has no group (collectives fail); " + advice)
    relay = SimpleNamespace(busy=lambda: [])
    with pytest.raises(ClorchError) as refused:
        refuse_dead_or_busy(launcher, relay, (0, 1), Verbs(restart_ranks="%clorch restart --ranks {ranks}"))  # type: ignore[arg-type]
    assert str(refused.value) == "rank 1 (ended (see %clorch logs 1)) is dead: " + advice
    with pytest.raises(ClorchError) as stuck:
        views.interrupted({1: ""}, None, lambda: "rank 1 is in time.sleep", 2, launcher)
    assert str(stuck.value) == "rank 1 is stuck: " + advice


def test_a_tables_rows_end_at_their_last_cell() -> None:
    """%clorch jobs, sessions and status share this table: a long last cell (a job's cause of 190
    characters) padded every other row's end with spaces."""
    from clorch_repl.magics.views import table_text

    text = table_text(["job", "cause"], [["job-1", "x" * 190], ["job-2", "-"]])
    assert [len(line) - len(line.rstrip()) for line in text.splitlines()] == [0, 0, 0], text
    assert text.splitlines()[2] == "job-2  -"


def test_with_no_rank_left_the_advice_is_what_the_launcher_can_do() -> None:
    """Every rank lost: a cell is refused; the advice is a whole restart where the launcher can
    start ranks, and what works instead where it cannot (a detached session refuses restarts)."""
    from types import SimpleNamespace

    from clorch_repl.errors import ClorchError
    from clorch_repl.notebook.hooks import NotebookHooks
    from clorch_repl.session.recovery import survivors

    ranks = [SimpleNamespace(rank=0), SimpleNamespace(rank=1)]
    local = SimpleNamespace(ranks=ranks, instead_of_replacing=lambda lost: "")
    detached = SimpleNamespace(ranks=ranks, instead_of_replacing=lambda lost: f"a detached session cannot start {lost}")
    assert survivors(local, [1], "rank 1 died") == (0,)
    with pytest.raises(ClorchError, match=r"no rank is left to run on \(ranks 0-1 died\): %clorch restart starts every"):
        survivors(local, [0, 1], "ranks 0-1 died", NotebookHooks.verbs)
    with pytest.raises(ClorchError, match=r"\(ranks 0-1 died\): a detached session cannot start \[0, 1\]$"):
        survivors(detached, [0, 1], "ranks 0-1 died")


def test_sessions_until_column_gives_the_date_when_the_end_is_days_away() -> None:
    # --keep-for runs up to 30 days: "14:02:11" alone could have been any of them
    import re
    import time

    from clorch_repl.session.reattach import _clock

    now = time.time()
    assert re.fullmatch(r"\d\d:\d\d:\d\d", _clock(now + 3600, now))
    assert _clock(now + 3 * 86400, now) == time.strftime("%Y-%m-%d %H:%M", time.localtime(now + 3 * 86400))
