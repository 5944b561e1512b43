"""A notebook whose working directory was deleted under it: starting ranks says so and what to do.

The ranks start in the notebook's working directory; once it is gone, ``os.getcwd`` raises a bare
FileNotFoundError from inside the launcher. What the user must see instead is that folder's
absence and the remedy, and once they change folder the same session starts again."""

from __future__ import annotations

import os
import tempfile

import psutil
import pytest

from clorch_repl.common.procs import wait_gone
from clorch_repl.errors import ConfigError
from clorch_repl.session.engine import local_session


@pytest.mark.parametrize("spares", ["0", "1"])
def test_a_restart_in_a_deleted_working_directory_says_so_and_the_next_one_works(spares: str,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLORCH_SPARES", spares)  # cold starts, and warm spares (forked in the old folder)
    home = os.getcwd()
    gone, elsewhere = tempfile.mkdtemp(), tempfile.mkdtemp()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    session = local_session(2, "gloo")
    try:
        os.chdir(gone)
        session.start()
        os.rmdir(gone)
        with pytest.raises(ConfigError) as refused:
            session.restart()
        words = str(refused.value)
        assert "working directory" in words and "no longer exists" in words and "os.chdir()" in words, words
        os.chdir(elsewhere)
        session.restart()
        assert session.run("import os\nassert os.getcwd() == %r" % elsewhere, None, None, None).ok
    finally:
        os.chdir(home)
        assert session.stop() == []
        os.rmdir(elsewhere)
    children = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert wait_gone(children, 10) == []  # the refused start left no rank, spare or zygote behind


def test_a_batch_job_launched_from_a_deleted_working_directory_is_refused_saying_so() -> None:
    from clorch_repl import distributed as dist

    home, gone = os.getcwd(), tempfile.mkdtemp()
    try:
        os.chdir(gone)
        os.rmdir(gone)
        for what in ({"main": "os:getpid"}, {"script": "train.py"}):
            with pytest.raises(ConfigError, match="no longer exists") as refused:
                dist.launch(nproc_per_node=1, **what)
            assert "os.chdir()" in str(refused.value)
    finally:
        os.chdir(home)
