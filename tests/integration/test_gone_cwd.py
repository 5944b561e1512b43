"""A notebook whose working directory was deleted under it: starting ranks says so and what to do.

The ranks start in the notebook's working directory; once it is gone, ``os.getcwd`` raises a bare
FileNotFoundError from inside the launcher. What the user must see instead is that folder's
absence and the remedy, with nothing ended or left behind by the refusal, and once they change
folder the same session starts again. A folder made again at the same path is another folder:
warm spares started in the first must not become the ranks there."""

from __future__ import annotations

import os
import tempfile

import psutil
import pytest

from clorch_repl.common.procs import pid_running, wait_gone
from clorch_repl.errors import ConfigError
from clorch_repl.session.engine import local_session


def _spare_pids(session) -> list[int]:  # type: ignore[no-untyped-def]
    return [s.pid for s in session.group.spares if s.pid is not None]


@pytest.mark.parametrize("spares,fork", [("0", "1"), ("1", "1"), ("1", "0")],
                         ids=["cold", "warm spares", "warm spares, fresh interpreters"])
def test_a_restart_in_a_deleted_working_directory_says_so_and_the_next_one_works(
        spares: str, fork: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLORCH_SPARES", spares)
    monkeypatch.setenv("CLORCH_FORK_RANKS", fork)  # (without the zygote, nothing ends a lost spare at stop)
    home = os.getcwd()
    gone, elsewhere = tempfile.mkdtemp(), tempfile.mkdtemp()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    session = local_session(2, "gloo")
    try:
        os.chdir(gone)
        session.start()
        ranks, warm = session.pids(), _spare_pids(session)
        os.rmdir(gone)
        for ranks_asked in ([1], None):  # a restart of some ranks, then of all
            with pytest.raises(ConfigError) as refused:
                session.restart(ranks=ranks_asked)
            words = str(refused.value)
            assert words.startswith(f"this process's working directory, {gone} (pid {os.getpid()} on host "), words
            assert words.endswith(", was deleted, and new ranks start in it: change to an existing folder (%cd in "
                                  "a notebook, os.chdir() in a script) and try again"), words
            if ranks_asked is not None:  # refused before anything was ended: the ranks and spares run on
                assert session.pids() == ranks and all(pid_running(p) for p in ranks + warm)
                assert session.run("x = 1", None, None, None).ok
        assert wait_gone(warm, 10) == []  # the whole restart stopped the session: its spares with it, at once
        os.chdir(elsewhere)
        session.restart()
        assert session.run("import os\nassert os.getcwd() == %r" % elsewhere, None, None, None).ok
    finally:
        os.chdir(home)
        assert session.stop() == []
        os.rmdir(elsewhere)
    children = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert wait_gone(children, 10) == []  # the refused starts left no rank, spare or zygote behind


def test_a_restart_of_some_ranks_after_a_cd_says_that_their_folders_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """A try-out's finding: after a ``%cd``, ``%clorch restart --ranks 1`` started rank 1 in the
    notebook's new folder while rank 0 stayed in the old one, without a word."""
    monkeypatch.setenv("CLORCH_SPARES", "0")
    home, first, second = os.getcwd(), tempfile.mkdtemp(), tempfile.mkdtemp()
    session = local_session(2, "gloo")
    said: list[str] = []
    try:
        os.chdir(first)
        session.start()
        os.chdir(second)
        session.restart(said.append, ranks=[1])
        assert (f"the fresh rank(s) work in {second}, the notebook's working directory; the others started in "
                f"{first} (relative paths differ between them: %cd there and restart these ranks again to have "
                "them alike)") in said, said
        assert session.run("import os\nassert os.getcwd() == (%r if rank == 0 else %r)" % (first, second),
                           None, None, None).ok
        said.clear()
        os.chdir(first)
        session.restart(said.append, ranks=[1])  # alike again: nothing to say
        assert not any("the others started in" in line for line in said), said
    finally:
        os.chdir(home)
        assert session.stop() == []
        os.rmdir(first)
        os.rmdir(second)


def test_warm_spares_started_in_a_folder_made_again_at_its_path_are_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLORCH_SPARES", "1")
    home, folder = os.getcwd(), tempfile.mkdtemp()
    session = local_session(2, "gloo")
    try:
        os.chdir(folder)
        session.start()
        assert session.group.spares, "the session made no warm spares"
        os.chdir(home)
        os.rmdir(folder)
        os.mkdir(folder, 0o700)  # the same path, another folder (a checkout cloned again)
        os.chdir(folder)
        with open("data.txt", "w") as fh:
            fh.write("here")
        session.restart()
        assert not session.group.from_spares, "spares working in the deleted folder became the ranks"
        assert session.run("assert open('data.txt').read() == 'here'", None, None, None).ok
    finally:
        os.chdir(home)
        assert session.stop() == []
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


def test_a_batch_job_launched_from_a_deleted_working_directory_is_refused_saying_so() -> None:
    from clorch_repl import distributed as dist

    home, gone = os.getcwd(), tempfile.mkdtemp()
    try:
        os.chdir(gone)
        os.rmdir(gone)
        for what in ({"main": "os:getpid"}, {"script": "train.py"}):
            with pytest.raises(ConfigError, match="was deleted, and new ranks start in it") as refused:
                dist.launch(nproc_per_node=1, **what)
            assert "os.chdir()" in str(refused.value)
    finally:
        os.chdir(home)


def test_pull_push_and_gather_in_a_deleted_folder_are_refused_instead_of_ending_the_notebook() -> None:
    """A try-out's finding: ``%clorch pull`` imports torch in the notebook kernel the first time,
    and torch's import in a deleted folder ends the process (Intel oneMKL: "Cannot load
    libtorch_cpu.so", exit status 2): the notebook kernel died, and its ranks with it."""
    from notebook_kernel import clorch_session

    folder = tempfile.mkdtemp()
    with clorch_session() as nb:
        assert nb.run("%%distributed\nt = rank + 40").status == "ok"
        assert nb.run(f"import os, sys\nos.chdir({folder!r})\nos.rmdir({folder!r})\n"
                      "assert 'torch' not in sys.modules").status == "ok"  # (what the refusal is for)
        for command in ("%clorch pull t", "x = 2\n%clorch push x"):
            refused = nb.run(command)
            assert refused.status == "error", refused.text
            words = " ".join(refused.text.split())
            assert f"this process's working directory, {folder} (pid " in words, words
            assert "imports torch here, which would end this process in a deleted folder" in words, words
        refused = nb.run("%%distributed --gather g\ng = rank")  # refused before any rank runs it
        words = " ".join(refused.text.split())
        assert refused.status == "error" and "--gather g imports torch here" in words, refused.text
        assert "were interrupted" not in words, words  # (not sent ahead, then taken back)
        ran = nb.run("%%distributed\nprint('g' in globals())")
        assert ran.status == "ok" and "False" in ran.text and "True" not in ran.text, ran.text
        assert nb.run("%cd /tmp").status == "ok"
        pulled = nb.run("%clorch pull t\nprint(t)")
        assert pulled.status == "ok" and "{0: 40, 1: 41}" in pulled.text, pulled.text
