"""A user try-out's three findings through a real notebook kernel and 2 gloo ranks, in one session:
``%clorch top --once`` said "cpu 0 %" for ranks whose thread spun (the first sample of a CPU share
has no baseline), ``%%distributed --profile /proc/nope`` gave a raw FileNotFoundError traceback,
and ``--gather get_ipython`` was accepted and made every later magic fail with "'dict' object is
not callable". Without a process: tests/unit/test_magic_tryout_units.py."""

from __future__ import annotations

import re

from notebook_kernel import clorch_session

SPIN = """%%distributed
import threading
stop_spin = False
def _spin():
    x = 0
    while not stop_spin:
        x += 1
threading.Thread(target=_spin, daemon=True).start()
"""


def _cpu(text: str) -> dict[int, float]:
    """rank -> the cpu column's percent in a ``%clorch top --once`` table."""
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^(\d+)\s+here\s.*?\s(\d+) %\s", text, re.M)}


def test_top_profile_and_gather_as_the_try_out_used_them() -> None:
    with clorch_session() as nb:
        assert nb.run(SPIN).status == "ok"
        try:
            once = nb.run("%clorch top --once")  # the first look at these ranks: no earlier sample
            assert once.status == "ok", once.text
            cpu = _cpu(once.text)
            assert set(cpu) == {0, 1} and min(cpu.values()) >= 5, once.text  # each spins a core's share
        finally:
            assert nb.run("%%distributed\nstop_spin = True").status == "ok"

        bad = nb.run("%%distributed --profile /proc/nope\nprint('ran', rank)")
        assert bad.status == "error", bad.text
        said = " ".join(bad.text.split())
        assert "UsageError: --profile /proc/nope: cannot make or write in that trace folder (" in said, bad.text
        assert "Traceback" not in bad.text and "FileNotFoundError" not in bad.text, bad.text
        assert "ran" not in bad.text, bad.text  # refused before anything was sent to the ranks

        shadow = nb.run("%%distributed --gather get_ipython\nrank")
        assert shadow.status == "error", shadow.text
        said = " ".join(shadow.text.split())
        assert "--gather 'get_ipython' is one of IPython's own names" in said and "choose another name" in said, \
            shadow.text
        assert "Traceback" not in shadow.text, shadow.text
        gathered = nb.run("%%distributed --gather ranks_seen\nrank")
        assert gathered.status == "ok", gathered.text
        assert "{0: 0, 1: 1}" in nb.run("ranks_seen").text  # magics still work, a good name is taken
