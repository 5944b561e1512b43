"""What a cell shows about a failed or dead rank, through a real notebook kernel driven by
jupyter_client as JupyterLab drives one: a refused ``input()`` shows the user's own line and
no frame of clorch_repl, and a rank that dies after ``%clorch restart`` is reported with the
lines of its current process only (the log itself keeps the earlier ones)."""

from __future__ import annotations

import re
from typing import Iterator

import pytest

from notebook_kernel import NotebookKernel, clorch_session

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    return ANSI.sub("", text)


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    with clorch_session(stop=False) as kernel:  # the kernel's shutdown ends the ranks
        yield kernel


def test_input_refused_by_the_front_end_shows_the_users_line_and_no_clorch_frame(nb: NotebookKernel) -> None:
    # allow_stdin=False, as clorch-notebook (nbclient) sends every cell
    reply = nb.run("%%distributed --ranks 1\nanswer = input('anyone? ')  # the user's line\n", timeout=60)
    text = plain(reply.text)
    assert reply.status == "error"
    assert "answer = input('anyone? ')  # the user's line" in text, text
    assert "StdinNotImplementedError: input() on rank 1: the notebook's front end sent this cell with " \
           "allow_stdin=False" in text, text
    assert "clorch_repl/" not in text, text
    assert "raw_input" not in text, text


def test_input_on_a_rank_outside_stdin_ranks_names_it_and_shows_no_clorch_frame(nb: NotebookKernel) -> None:
    code = "%%distributed --stdin-ranks 0\nvalue = input(f'value for {rank}? ')\nprint('got', value)\n"
    reply = nb.run(code, answers=["zero"], timeout=60)
    text = plain(reply.text)
    assert reply.status == "error"
    assert "[rank 0] got zero" in text, text
    assert "input() on rank 1: only rank 0 may read input in this cell (%%distributed --stdin-ranks)" \
        in text, text
    assert "value = input(f'value for {rank}? ')" in text, text
    assert "clorch_repl/" not in text, text


def test_getpass_refused_shows_no_clorch_frame_and_can_be_caught_as_stdin_not_implemented(nb: NotebookKernel) -> None:
    reply = nb.run("%%distributed --ranks 0\nimport getpass\ntoken = getpass.getpass('token: ')\n", timeout=60)
    text = plain(reply.text)
    assert reply.status == "error"
    assert "token = getpass.getpass('token: ')" in text and "StdinNotImplementedError" in text, text
    assert "clorch_repl/" not in text, text
    caught = nb.run("%%distributed --ranks 0\nfrom IPython.core.error import StdinNotImplementedError\n"
                    "try:\n    input('x? ')\nexcept StdinNotImplementedError as e:\n    print('caught', type(e).__name__)\n",
                    timeout=60)
    assert caught.status == "ok", caught.text
    assert "[rank 0] caught StdinNotImplementedError" in caught.text, caught.text


def test_a_rank_dying_after_restart_is_reported_without_the_logs_of_before(nb: NotebookKernel) -> None:
    before = nb.run("%%distributed\nundefined_name_before_restart\n", timeout=60)
    assert before.status == "error" and "NameError" in before.text, before.text
    restarted = nb.run("%clorch restart", timeout=120)
    assert restarted.status == "ok", restarted.text
    reply = nb.run("%%distributed\nimport os\nif rank == 1:\n    print('about to leave', flush=True)\n"
                   "    os._exit(3)\n", timeout=60)
    text = plain(reply.text)
    assert reply.status == "error"
    assert "rank 1 died: exit code 3.\nLast lines of its log:" in text, text
    report = text.split("Last lines of its log:", 1)[1]
    assert "about to leave" in report, text  # the current process's own lines are there
    assert "NameError" not in report and "undefined_name_before_restart" not in report, text
    logs = nb.run("%clorch logs 1", timeout=60)  # the log itself keeps what came before the restart
    assert "undefined_name_before_restart" in plain(logs.text), logs.text
