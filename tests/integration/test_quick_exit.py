"""A rank's exit after a shutdown request (:mod:`clorch_repl.kernel.quick_exit`): what a clean exit
promises happens (non-daemon threads finish first, then every atexit handler, then the rank's
log is flushed, exit status 0), and the interpreter's teardown, which cost a healthy restart
most of its time (issue 39), does not. A real Python process, as a rank's is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, pathlib, sys, threading, time
    from clorch_repl.kernel.quick_exit import exit_now

    out = pathlib.Path(sys.argv[1])

    def late_writer():
        time.sleep(0.3)
        (out / "thread").write_text("done")

    threading.Thread(target=late_writer).start()  # not a daemon: an exit waits for it
    atexit.register(lambda: (out / "atexit").write_text((out / "thread").read_text()))

    class Torn:
        def __del__(self):
            (out / "teardown").write_text("ran")

    kept = Torn()  # reachable from this module until the interpreter's teardown releases it
    sys.__stdout__.write("buffered, no newline")  # in the stream's buffer (a pipe) until flushed
    exit_now()
    (out / "returned").write_text("exit_now returned")
""")


def test_exit_now_keeps_a_clean_exits_promises_and_skips_the_teardown(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "buffered, no newline", "the rank's log must get what was still buffered"
    assert (tmp_path / "atexit").read_text() == "done", "atexit ran, after the non-daemon thread had finished"
    assert not (tmp_path / "returned").exists()
    assert not (tmp_path / "teardown").exists(), "the interpreter's teardown ran: the exit was not cut short"
