"""Which job folders a launch sweeps (clorch_repl.jobs.job_dirs): the decision alone, and a sweep of
folders made by hand in a private temporary directory. No process is started; the folders' owners
are this process (alive) or a pid that cannot exist (dead). tests/integration/test_job_dirs.py
kills a real notebook kernel and sweeps its folder from another one."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import psutil
import pytest

from clorch_repl.jobs import job_dirs
from clorch_repl.jobs.job_dirs import OWNER_FILE, Owner, Seen, names_folder, parse_owner, sweep_stale, verdict

UID = os.getuid()
HOST = socket.gethostname()
ME_STARTED = job_dirs.start_ticks(os.getpid())
BOOT = job_dirs.this_boot()
#: an hour, in clock ticks: a start that far from the owner's is another process's
HOUR = 3600 * os.sysconf("SC_CLK_TCK")


def no_pid() -> int:
    """A pid no process can have: above the kernel's highest."""
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read()) + 1


def stale(path: str = "/tmp/clorch-job-1-abcdefgh", **changes: Any) -> Seen:
    owner = Owner(pid=no_pid(), started=1000, host=HOST, owns_dir=True, boot=BOOT)
    fields = {"path": path, "is_dir": True, "uid": UID, "owner": owner, **changes}
    return Seen(**fields)


def judge(seen: Seen, alive: bool = False, used: bool = False) -> str | None:
    return verdict(seen, uid=UID, host=HOST, boot=BOOT, owner_alive=lambda _o: alive, in_use=lambda _p: used)


def test_a_folder_of_this_user_whose_owner_and_ranks_are_gone_is_swept() -> None:
    assert judge(stale()) is None


@pytest.mark.parametrize(("changes", "alive", "used", "why"), [
    ({"is_dir": False}, False, False, "not a real directory"),
    ({"uid": UID + 1}, False, False, f"owned by uid {UID + 1}"),
    ({"owner": None}, False, False, "no readable owner.json"),
    ({"owner": Owner(pid=1, started=1, host=HOST, owns_dir=False, boot=BOOT)}, False, False, "log_dir"),
    ({"owner": Owner(pid=1, started=1, host="elsewhere", owns_dir=True, boot=BOOT)}, False, False, "host elsewhere"),
    ({"owner": Owner(pid=1, started=None, host=HOST, owns_dir=True, boot=BOOT)}, False, False, "no recorded start time"),
    # a container sharing /tmp under the same hostname (another pid namespace), or another boot
    ({"owner": Owner(pid=1, started=1, host=HOST, owns_dir=True, boot="other-boot pid:[1]")}, False, False,
     "another boot or pid namespace"),
    ({"owner": Owner(pid=1, started=1, host=HOST, owns_dir=True, boot=None)}, False, False,
     "another boot or pid namespace"),
    ({}, True, False, "is alive"),
    ({}, False, True, "still names it"),
])
def test_every_doubt_keeps_the_folder(changes: dict[str, Any], alive: bool, used: bool, why: str) -> None:
    assert why in (judge(stale(**changes), alive, used) or "swept")


def test_the_host_is_looked_at_only_for_an_otherwise_stale_folder() -> None:
    asked: list[str] = []

    def alive(_owner: Owner) -> bool:
        asked.append("alive")
        return False

    def used(_path: str) -> bool:
        asked.append("used")
        return False

    verdict(stale(owner=None), uid=UID, host=HOST, boot=BOOT, owner_alive=alive, in_use=used)
    assert asked == []
    verdict(stale(), uid=UID, host=HOST, boot=BOOT, owner_alive=alive, in_use=used)
    assert asked == ["alive", "used"]


def test_the_owner_record_is_read_strictly() -> None:
    good = {"pid": 12, "started": 55, "host": "h", "owns_dir": True, "boot": "b pid:[1]"}
    assert parse_owner(json.dumps(good)) == Owner(12, 55, "h", True, "b pid:[1]")
    assert parse_owner(json.dumps({**good, "started": None})) == Owner(12, None, "h", True, "b pid:[1]")
    for pid in (0, -1):  # psutil.Process(-1) raised ValueError out of the launch
        assert parse_owner(json.dumps({**good, "pid": pid})) is None
    assert parse_owner(json.dumps({**good, "started": 5.5})) is None and parse_owner(json.dumps({**good, "boot": 3})) is None
    for bad in ("", "{", "[]", json.dumps({**good, "pid": "12"}), json.dumps({**good, "pid": True}),
                json.dumps({**good, "owns_dir": 1}), json.dumps({**good, "started": "5"}),
                json.dumps({k: v for k, v in good.items() if k != "host"})):
        assert parse_owner(bad) is None, bad


def test_a_command_line_names_the_folder_or_a_file_in_it_not_a_sibling() -> None:
    folder = "/tmp/clorch-job-1-abcdefgh"
    assert names_folder([["python", "supervisor.py", "--session-dir", folder]], folder)
    assert names_folder([["python", "-m", "clorch_repl.jobs._rank_entry", f"{folder}/job.json"]], folder)
    assert not names_folder([["tail", f"{folder}x/rank-0.log"], ["python", folder[:-1]]], folder)


def test_the_owner_is_its_pid_and_start_time_together() -> None:
    assert job_dirs.owner_alive(Owner(os.getpid(), ME_STARTED, HOST, True, BOOT))
    # the same pid, started an hour later: the system gave the dead owner's pid to another process
    assert not job_dirs.owner_alive(Owner(os.getpid(), ME_STARTED - HOUR, HOST, True, BOOT))
    assert not job_dirs.owner_alive(Owner(no_pid(), ME_STARTED, HOST, True, BOOT))


def make(root: str, name: str, record: dict[str, Any] | None) -> str:
    path = os.path.join(root, name)
    os.mkdir(path, 0o700)
    with open(os.path.join(path, "rank-0.log"), "w") as fh:
        fh.write("a rank's log\n")
    if record is not None:
        with open(os.path.join(path, OWNER_FILE), "w") as fh:
            json.dump(record, fh)
    return path


def test_a_sweep_removes_only_the_stale_folders_of_clorch(tmp_path: Any) -> None:
    root = str(tmp_path / "tmp")
    os.mkdir(root)
    dead = {"pid": no_pid(), "started": ME_STARTED, "host": HOST, "owns_dir": True, "boot": BOOT}
    gone = make(root, "clorch-job-1-deadxxxx", dead)
    reused = make(root, "clorch-job-2-reusedxx", {**dead, "pid": os.getpid(), "started": ME_STARTED - HOUR})
    kept = {
        "live": make(root, "clorch-job-3-livexxxx", {**dead, "pid": os.getpid()}),
        "log_dir": make(root, "clorch-job-4-logdirxx", {**dead, "owns_dir": False}),
        "unmarked": make(root, "clorch-job-5-noownerx", None),
        "other name": make(root, "clorch-k2j3h4x9", dead),  # a session's folder: not a job's
        "damaged": make(root, "clorch-job-6-damagedx", None),
    }
    with open(os.path.join(kept["damaged"], OWNER_FILE), "w") as fh:
        fh.write("{not json")
    target = make(str(tmp_path), "elsewhere", dead)  # a stale folder outside the root, linked from it
    link = os.path.join(root, "clorch-job-7-linkxxxx")
    os.symlink(target, link)
    assert sorted(sweep_stale(root)) == sorted([gone, reused])
    assert not os.path.exists(gone) and not os.path.exists(reused)
    for what, path in kept.items():
        assert os.path.isfile(os.path.join(path, "rank-0.log")), what
    assert os.path.islink(link) and os.path.isfile(os.path.join(target, "rank-0.log"))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a folder of another user")
def test_a_folder_of_another_user_is_never_touched(tmp_path: Any) -> None:
    path = make(str(tmp_path), "clorch-job-1-otherxxx",
                {"pid": no_pid(), "started": ME_STARTED, "host": HOST, "owns_dir": True, "boot": BOOT})
    os.chown(path, 4242, 4242)
    assert sweep_stale(str(tmp_path)) == [] and os.path.isdir(path)


def test_a_sweep_never_raises_for_what_it_finds(tmp_path: Any) -> None:
    assert sweep_stale(str(tmp_path / "missing")) == []
    (tmp_path / "clorch-job-1-afilexxx").write_text("not a folder")
    assert sweep_stale(str(tmp_path)) == []


def test_a_job_folder_records_its_owner(tmp_path: Any) -> None:
    folder, owns = job_dirs.job_directory("job-7", str(tmp_path))
    assert not owns and os.path.basename(folder).startswith("clorch-job-7-")
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    with open(os.path.join(folder, OWNER_FILE)) as fh:
        assert parse_owner(fh.read()) == Owner(os.getpid(), ME_STARTED, HOST, False, BOOT)


def test_a_sweep_cut_short_leaves_a_folder_the_next_sweep_takes(tmp_path: Any, monkeypatch: Any) -> None:
    """A Ctrl-C during a launch's sweep stops it midway: the owner record is removed last, so the
    folder left is still one the next launch can judge (without its record it never would)."""
    dead = {"pid": no_pid(), "started": ME_STARTED, "host": HOST, "owns_dir": True, "boot": BOOT}
    path = make(str(tmp_path), "clorch-job-1-cutxxxxx", dead)
    for name in ("rank-1.log", "job.json", "zz-result.json"):
        (tmp_path / "clorch-job-1-cutxxxxx" / name).write_text("x")
    unlink, calls = os.unlink, []

    def cut_short(where: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(where)
        if len(calls) == 2:
            raise KeyboardInterrupt
        unlink(where, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", cut_short)
    with pytest.raises(KeyboardInterrupt):
        sweep_stale(str(tmp_path))
    monkeypatch.setattr(os, "unlink", unlink)
    assert os.path.isfile(os.path.join(path, OWNER_FILE))
    assert sweep_stale(str(tmp_path)) == [path] and not os.path.exists(path)
