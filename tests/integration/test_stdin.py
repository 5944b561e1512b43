"""Prompts of ranks answered in the notebook, through a real notebook kernel driven by
jupyter_client as JupyterLab drives one (the client answers input_request on its stdin channel,
as JupyterLab's input box does): input() on one rank and on both in turn, --stdin-ranks,
breakpoint() stepped with pdb commands, %clorch debug after an exception, an interrupt while a
prompt waits, and the hang notice for a rank held at a pdb prompt."""

from __future__ import annotations

import pathlib
import re
import time
from queue import Empty
from typing import Iterator

import pytest

from rank_text import said
from notebook_kernel import NotebookKernel, clorch_session


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    # The kernel's shutdown ends the ranks: a test may leave them stopped or debugged.
    with clorch_session(stop=False) as kernel:
        yield kernel


def test_input_on_one_rank_reaches_the_front_end_labelled_and_the_answer_that_rank(nb: NotebookKernel) -> None:
    reply = nb.run("%%distributed\nif rank == 1:\n    name = input('your name? ')\n    print('hello', name)\n"
                   "else:\n    print('no question here')\n", answers=["Ada"], timeout=60)
    assert reply.status == "ok", reply.text
    assert reply.prompts == ["[rank 1] your name? "]
    assert "[rank 1] hello Ada" in reply.text, reply.text
    assert "[rank 0] no question here" in reply.text, reply.text


def test_both_ranks_asking_at_once_are_served_one_after_another_in_rank_order(nb: NotebookKernel) -> None:
    code = ("%%distributed\nimport torch.distributed as dist\ndist.barrier()\n"
            "value = input(f'value for {rank}? ')\nprint('got', value)\n")
    reply = nb.run(code, answers=lambda prompt: "A" if prompt.startswith("[rank 0]") else "B", timeout=60)
    assert reply.status == "ok", reply.text
    assert reply.prompts == ["[rank 0] value for 0? ", "[rank 1] value for 1? "]
    assert "[rank 0] got A" in reply.text and "[rank 1] got B" in reply.text, reply.text


def test_stdin_ranks_lets_only_the_chosen_rank_ask_and_the_other_fails_clearly(nb: NotebookKernel) -> None:
    code = "%%distributed --stdin-ranks 0\nvalue = input(f'value for {rank}? ')\nprint('got', value)\n"
    reply = nb.run(code, answers=["zero"], timeout=60)
    assert reply.status == "error"
    assert reply.prompts == ["[rank 0] value for 0? "]
    assert "[rank 0] got zero" in reply.text, reply.text
    assert "StdinNotImplementedError" in reply.text, reply.text
    assert "input() on rank 1: only rank 0 may read input in this cell (%%distributed --stdin-ranks)" \
        in reply.text, reply.text


def test_a_front_end_that_takes_no_input_gets_a_clear_error_instead_of_a_blocked_cell(nb: NotebookKernel) -> None:
    reply = nb.run("%%distributed --ranks 1\ninput('anyone? ')\n", timeout=60)  # allow_stdin=False, as nbclient
    assert reply.status == "error"
    assert "input() on rank 1: the notebook's front end sent this cell with allow_stdin=False" in reply.text, \
        reply.text


def test_breakpoint_on_rank_1_steps_prints_and_continues(nb: NotebookKernel) -> None:
    code = ("%%distributed\nimport torch, torch.distributed as dist\n"
            "def step(x):\n    if rank == 1:\n        breakpoint()\n    y = x + 1\n    return y\n"
            "y = step(40 + rank)\nt = torch.tensor([float(y)])\ndist.all_reduce(t)\n"
            "print('y', y, 'sum', int(t.item()))\n")
    reply = nb.run(code, answers=["p x", "n", "p y", "c"], timeout=90)
    assert reply.status == "ok", reply.text
    assert len(reply.prompts) == 4, reply.prompts  # one per command, each labelled
    assert set(reply.prompts) <= {"[rank 1] (Pdb) ", "[rank 1] ipdb> "}, reply.prompts  # IPython's pdb in a kernel
    lines = reply.text.splitlines()
    assert "[rank 1] 41" in lines, reply.text              # p x
    assert "[rank 1] 42" in lines, reply.text              # p y, after n ran `y = x + 1`
    assert not any("Error" in line for line in lines), reply.text
    assert "[rank 0] y 41 sum 83" in lines, reply.text     # rank 0 waited in the all_reduce meanwhile
    assert "[rank 1] y 42 sum 83" in lines, reply.text


def test_breakpoint_on_a_rank_outside_stdin_ranks_is_skipped_saying_why(nb: NotebookKernel) -> None:
    """``--stdin-ranks 0`` and ``breakpoint()`` on every rank: rank 0 debugs; rank 1's pdb printed
    its frame header (merged with rank 0's, as if both had stopped) and then failed with a
    forty-line traceback through bdb, pdb and cmd (a try-out). Rank 1 now skips it, saying why."""
    code = ("%%distributed --stdin-ranks 0\ndef f():\n    a = 41 + rank\n    breakpoint()\n    return a\n"
            "print('result', f())\n")
    reply = nb.run(code, answers=["p a", "c"], timeout=90)
    assert reply.status == "ok", reply.text
    assert set(reply.prompts) <= {"[rank 0] (Pdb) ", "[rank 0] ipdb> "} and len(reply.prompts) == 2, reply.prompts
    lines = reply.text.splitlines()
    assert "[rank 0] 41" in lines and "[rank 0] result 41" in lines and "[rank 1] result 42" in lines, reply.text
    assert ("[rank 1] breakpoint() skipped on rank 1: only rank 0 may read input in this cell (%%distributed "
            "--stdin-ranks); add rank 1 there to debug it too") in " ".join(reply.text.split()), reply.text
    assert "Traceback" not in reply.text and "[ranks 0-1] >" not in reply.text, reply.text


def test_clorch_debug_opens_the_frames_of_a_ranks_last_exception(nb: NotebookKernel) -> None:
    code = ("%%distributed\ndef divide(total, parts):\n    share = total * 10\n    return share / parts\n"
            "divide(7, rank - 1)\n")
    reply = nb.run(code, timeout=60)
    assert reply.status == "error" and "ZeroDivisionError" in reply.text, reply.text
    reply = nb.run("%clorch debug 1", answers=["p share, parts", "q"], timeout=60)
    assert reply.status == "ok", reply.text
    assert reply.prompts and all(p == "[rank 1] ipdb> " for p in reply.prompts), reply.prompts
    assert "[rank 1] (70, 0)" in reply.text.splitlines(), reply.text


def test_clorch_debug_refuses_a_rank_that_does_not_exist(nb: NotebookKernel) -> None:
    reply = nb.run("%clorch debug 5", answers=[], timeout=30)
    assert reply.status == "error"
    assert "%clorch debug names rank 5, which does not exist (0-1)" in reply.text, reply.text


def test_clorch_debug_refuses_a_front_end_that_takes_no_input(nb: NotebookKernel) -> None:
    """nbclient and ``jupyter execute`` send cells with allow_stdin=False: pdb's prompts could not
    be answered, so the debugger is refused in one line, not with a traceback of pdb's own input()."""
    reply = nb.run("%clorch debug 1", timeout=30)  # no answers: allow_stdin=False
    assert reply.status == "error"
    assert "%clorch debug needs a front end that takes input" in reply.text, reply.text
    assert "allow_stdin=False" in reply.text and "pdb.py" not in reply.text, reply.text


def test_interrupt_while_a_prompt_waits_interrupts_the_ranks_and_ends_the_cell(nb: NotebookKernel) -> None:
    asked: list[float] = []

    def leave_open(prompt: str) -> None:
        asked.append(time.monotonic())
        return None

    # rank 1 sleeps rather than waiting in a collective: gloo's wait in C++ ignores KeyboardInterrupt
    # (a stuck rank is another test's matter); this one is about the prompt.
    msg_id = nb.send("%%distributed\nimport time\nif rank == 0:\n    input('never? ')\nelse:\n    time.sleep(60)\n"
                     "print('not reached')\n", allow_stdin=True)
    deadline = time.monotonic() + 60
    while not asked and time.monotonic() < deadline:
        try:
            msg = nb.kc.get_stdin_msg(timeout=0.2)
        except Empty:  # not asked yet
            continue
        leave_open(msg["content"]["prompt"])
    assert asked, "rank 0's prompt never reached the front end"
    nb.km.interrupt_kernel()  # Kernel > Interrupt
    started = time.monotonic()
    reply = nb.collect(msg_id, timeout=60)
    assert time.monotonic() - started < 15, "the cell did not end soon after the interrupt"
    assert reply.status == "error"
    assert "KeyboardInterrupt" in reply.text, reply.text
    assert "] not reached" not in reply.text, reply.text
    # rank 0's traceback ends at the user's input() (and ipykernel's own frames), not in clorch_repl
    plain = re.sub(r"\x1b\[[0-9;]*m", "", reply.text)  # (colours off)
    assert "----> 3     input('never? ')" in plain and "stdin_policy" not in plain, plain
    after = nb.run("%%distributed\nprint('fine', rank)\n", timeout=60)  # the group still works
    assert after.status == "ok", after.text
    assert "fine 0" in after.text and "fine 1" in after.text, after.text


def test_hang_notice_says_a_rank_at_a_pdb_prompt_is_held_in_the_debugger_not_hung(nb: NotebookKernel) -> None:
    code = ("%%distributed --hang-notice 2\nimport torch.distributed as dist\n"
            "def step():\n    if rank == 1:\n        breakpoint()\n    dist.barrier()\n    return rank\n"
            "print('done', step())\n")
    msg_id = nb.send(code, allow_stdin=True)
    deadline = time.monotonic() + 60
    prompt = None
    while prompt is None and time.monotonic() < deadline:
        try:
            prompt = nb.kc.get_stdin_msg(timeout=0.2)["content"]["prompt"]
        except Empty:
            continue
    assert prompt == "[rank 1] ipdb> " or prompt == "[rank 1] (Pdb) ", prompt
    nb.wait_for_output(msg_id, "clorch: not a hang, waiting for your answer; ", timeout=30)
    nb.kc.input("c")  # rank 1 goes on into the barrier; the cell ends normally
    reply = nb.collect(msg_id, timeout=60, answers=[])
    assert reply.status == "ok", reply.text
    notices = said(reply.text, "clorch: ")  # clorch's messages, wrapped at the cell's width: one line each
    assert len(notices) == 1, reply.text
    assert "barrier" in notices[0] and "rank 0 waits in it" in notices[0], notices
    assert "rank 1 never called it and is held in the debugger at Cell In[" in notices[0], notices
    assert ", line 5 in step()" in notices[0], notices  # the line pdb stopped at
    assert "no progress on any rank" not in reply.text, reply.text
    assert "[rank 0] done 0" in reply.text and "[rank 1] done 1" in reply.text, reply.text


def test_getpass_and_pdb_set_trace_on_a_rank(nb: NotebookKernel) -> None:
    code = ("%%distributed --ranks 0\nimport getpass, pdb\ndef f():\n    secret = getpass.getpass('token: ')\n"
            "    pdb.set_trace()\n    return len(secret)\nprint('length', f())\n")
    reply = nb.run(code, answers=["abcd", "p secret", "c"], timeout=60)
    assert reply.status == "ok", reply.text
    assert reply.prompts[0] == "[rank 0] token: ", reply.prompts
    assert len(reply.prompts) == 3 and set(reply.prompts[1:]) <= {"[rank 0] (Pdb) ", "[rank 0] ipdb> "}, reply.prompts
    lines = reply.text.splitlines()
    assert "[rank 0] 'abcd'" in lines and "[rank 0] length 4" in lines, reply.text


def wait_for_prompt(nb: NotebookKernel, timeout: float = 60.0) -> str:
    """The next input_request's prompt, left unanswered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return nb.kc.get_stdin_msg(timeout=0.2)["content"]["prompt"]
        except Empty:
            continue
    raise TimeoutError("no input_request reached the front end")


def test_other_ranks_stream_and_the_time_limit_holds_while_a_prompt_waits(nb: NotebookKernel) -> None:
    code = ("%%distributed --timeout 6\nimport time\nif rank == 1:\n    input('wait? ')\nelse:\n"
            "    time.sleep(0.5)\n    for i in range(3):\n        print('tick', i, flush=True)\n        time.sleep(0.2)\n"
            "    time.sleep(60)\n")
    started = time.monotonic()
    msg_id = nb.send(code, allow_stdin=True)
    assert wait_for_prompt(nb) == "[rank 1] wait? "
    nb.wait_for_output(msg_id, "tick", count=3, timeout=30)  # rank 0's output, while rank 1's prompt is open
    reply = nb.collect(msg_id, timeout=60)
    assert time.monotonic() - started < 20, "the time limit did not end the cell"
    assert reply.status == "error"
    assert "[rank 0] tick 2" in reply.text, reply.text
    assert "Timed out" in reply.text and "after 6 s" in reply.text, reply.text


def test_clorch_run_answers_a_scripts_input_in_the_notebook(nb: NotebookKernel, tmp_path: pathlib.Path) -> None:
    # %clorch run is a cell like %%distributed: the script's input() (and pdb) is asked of the
    # notebook's front end, not refused for want of a stdin hook the notebook user cannot pass
    script = tmp_path / "ask.py"
    script.write_text("import os\nif os.environ['RANK'] == '0':\n    print('got', input('n? '))\n")
    reply = nb.run(f"%clorch run --ranks 0 {script}", answers=["7"], timeout=90)
    assert reply.status == "ok", reply.text
    assert reply.prompts == ["[rank 0] n? "], reply.prompts
    assert "got 7" in reply.text, reply.text


def test_a_rank_that_dies_while_another_waits_at_a_prompt_ends_the_cell(nb: NotebookKernel) -> None:
    # last in the module: it kills rank 0 and restarts the ranks
    code = ("%%distributed\nimport os, signal, time, torch.distributed as dist\n"
            "if rank == 1:\n    input('waiting? ')\nelse:\n    time.sleep(1.0)\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    started = time.monotonic()
    msg_id = nb.send(code, allow_stdin=True)
    assert wait_for_prompt(nb) == "[rank 1] waiting? "
    reply = nb.collect(msg_id, timeout=60)
    assert time.monotonic() - started < 20, "the death was not noticed while the prompt waited"
    assert reply.status == "error"
    assert "rank 0" in reply.text and "SIGKILL" in reply.text, reply.text
    restarted = nb.run("%clorch restart", timeout=120)
    assert restarted.status == "ok", restarted.text
