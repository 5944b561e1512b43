"""%%distributed on a real 2-rank gloo group, driven through IPython's shell."""

from __future__ import annotations

import re
import time
from typing import Any

import psutil
import pytest
from IPython.utils.capture import capture_output

from clorch_repl.common.procs import wait_gone
from rank_text import lines_of, outputs_shown

pytestmark = pytest.mark.usefixtures("ranks")


def run(ip: Any, code: str, line: str = "") -> tuple[Any, Any]:
    with capture_output() as cap:
        result = ip.run_cell(f"%%distributed {line}\n{code}")
    return result, cap


def test_namespace_starts_with_rank_variables_and_persists(ip: Any) -> None:
    res, cap = run(ip, "print(rank, local_rank, world_size, device)\ny = rank * 10")
    assert res.success, cap.stdout
    assert lines_of(cap.stdout, 0) == ["0 0 2 cpu"]
    assert lines_of(cap.stdout, 1) == ["1 1 2 cpu"]
    res, cap = run(ip, "print(y + 1)")
    assert lines_of(cap.stdout, 0) == ["1"] and lines_of(cap.stdout, 1) == ["11"]


def test_cells_run_inside_the_initialised_group(ip: Any) -> None:
    res, cap = run(ip, "import torch, torch.distributed as dist\n"
                       "t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nprint(dist.get_backend(), t.tolist())")
    assert res.success, cap.stdout
    for r in (0, 1):
        assert lines_of(cap.stdout, r) == ["gloo [3.0, 3.0, 3.0]"]


def test_output_is_labelled_and_in_order_per_rank(ip: Any) -> None:
    code = ("import sys, time\n"
            "for i in range(40):\n"
            "    print(f'out {i}', flush=True)\n"
            "    if i % 10 == 0: print(f'err {i}', file=sys.stderr, flush=True); time.sleep(0.01)\n")
    res, cap = run(ip, code)
    assert res.success
    for r in (0, 1):
        assert lines_of(cap.stdout, r) == [f"out {i}" for i in range(40)]
        assert lines_of(cap.stderr, r) == [f"err {i}" for i in range(0, 40, 10)]
    unlabelled = [l for l in cap.stdout.splitlines() if l and not re.match(r"\[ranks? ", l)]
    assert unlabelled == []


def test_a_line_written_in_pieces_stays_one_labelled_line(ip: Any) -> None:
    res, cap = run(ip, "import time\nprint('abc', end='', flush=True)\ntime.sleep(0.05)\nprint('def')")
    assert res.success
    assert lines_of(cap.stdout, 0) == ["abcdef"] and lines_of(cap.stdout, 1) == ["abcdef"]


def test_carriage_return_progress_gets_one_live_line_per_rank(ip: Any) -> None:
    code = ("import sys, time\n"
            "for pct in (10, 50, 100):\n"
            "    sys.stderr.write(f'\\rprogress {pct:3d}%'); sys.stderr.flush(); time.sleep(0.05)\n"
            "sys.stderr.write('\\n')\nprint('after')")
    res, cap = run(ip, code)
    assert res.success
    assert "\r" not in cap.stderr and "\r" not in cap.stdout
    finals: dict[int, str] = {}
    ids: dict[int, set[str]] = {0: set(), 1: set()}
    for out in cap.outputs:
        text = out.data.get("text/plain", "")
        m = re.match(r"\[rank (\d)\] progress (.*)", text)
        if m:
            finals[int(m.group(1))] = m.group(2)
            ids[int(m.group(1))].add(out.transient["display_id"] if out.transient else "")
    assert finals == {0: "100%", 1: "100%"}
    assert len(ids[0]) == 1 and len(ids[1]) == 1 and ids[0] != ids[1]
    assert lines_of(cap.stdout, 0) == ["after"]


def test_rich_display_and_display_updates_pass_through_per_rank(ip: Any) -> None:
    code = ("from IPython.display import HTML, display\n"
            "display(HTML(f'<b>hello from {rank}</b>'))\n"
            "h = display(HTML('v1'), display_id=True)\n"
            "h.update(HTML(f'v2 on {rank}'))")
    res, cap = run(ip, code)
    assert res.success
    html = [o.data.get("text/html", "") for o in cap.outputs]
    assert "<b>hello from 0</b>" in html and "<b>hello from 1</b>" in html
    updates = [o for o in cap.outputs if o.update]
    assert sorted(o.data["text/html"] for o in updates) == ["v2 on 0", "v2 on 1"]
    # each rank's display id is its own, so rank 1's update cannot overwrite rank 0's display
    assert len({o.transient["display_id"] for o in updates}) == 2
    # a label line above each rank's rich output says whose it is
    assert cap.stdout.count("[rank 0]\n") == 2 and cap.stdout.count("[rank 1]\n") == 2


def test_last_expression_is_shown_per_rank(ip: Any) -> None:
    res, cap = run(ip, "rank * 100 + 7")
    assert res.success
    shown = sorted(o.data["text/plain"] for o in cap.outputs)
    assert shown == ["[rank 0] 7", "[rank 1] 107"]


def test_every_output_of_a_cell_lands_in_that_cell_and_the_cell_ends_at_once(ip: Any) -> None:
    """A rank's reply counts what its cell sent on iopub (wire.IOPUB_COUNT_KEY) and the relay ends
    the rank's part once it has read that many. A count too low would let a display sent by the
    rank's IOPub thread after the reply slip into the next cell; one too high would hold every cell
    until the relay's quiet period (REPLY_QUIET_S) gave up on the missing messages."""
    from clorch_repl.session.relay import REPLY_QUIET_S

    for i in range(12):
        code = (f"from IPython.display import HTML, display\nprint('text {i}', flush=True)\n"
                f"display(HTML(f'<i>shown {i} on {{rank}}</i>'))\nprint('after {i}')\n{i} * 10 + rank")
        t0 = time.monotonic()
        res, cap = run(ip, code)
        took = time.monotonic() - t0
        assert res.success, cap.stdout
        for r in (0, 1):  # the empty line is the label above the rank's display
            assert lines_of(cap.stdout, r) == [f"text {i}", "", f"after {i}"], cap.stdout
        shown = sorted(o.data.get("text/html") or o.data["text/plain"] for o in outputs_shown(cap.outputs))
        assert shown == sorted([f"<i>shown {i} on 0</i>", f"<i>shown {i} on 1</i>", f"[rank 0] {i * 10}",
                                f"[rank 1] {i * 10 + 1}"])
        assert took < REPLY_QUIET_S, f"cell {i} took {took:.1f} s: its end was not confirmed by the count"


def test_output_of_forked_children_does_not_end_the_cell_early(ip: Any) -> None:
    """A forked child's output (a multiprocessing pool, a DataLoader's workers) reaches iopub
    through ipykernel's pipe, which the rank does not count: it must not complete the relay's count
    before the rank's own messages arrived (a review found the cell's result in the next cell in 6
    runs of 15 before counted messages were marked)."""
    code = ("import multiprocessing as mp\ndef f(x):\n    print('worker', x, flush=True)\n    return x\n"
            "with mp.get_context('fork').Pool(2) as pool:\n    pool.map(f, range(4))\nf'result of {rank}'")
    for _ in range(8):
        res, cap = run(ip, code)
        assert res.success, cap.stdout
        shown = sorted(o.data["text/plain"] for o in outputs_shown(cap.outputs))
        assert shown == ["[rank 0] 'result of 0'", "[rank 1] 'result of 1'"], (shown, cap.stdout)
        res, cap = run(ip, "print('next', rank)")
        assert res.success and not outputs_shown(cap.outputs) and "result of" not in cap.stdout, cap.stdout


def test_forked_childrens_printed_lines_arrive_whole(ip: Any) -> None:
    """print() writes a line's text and its end apart, and a forked child (a Pool's or a
    DataLoader's worker) sent each write as its own message, so the lines of workers printing at
    once came out run together ("worker 2 line 0worker 3 line 0") with their ends as empty
    labelled lines ("[ranks 0-1]"). A child now sends whole lines (a partial line waits for its
    end, an explicit flush, or the child's exit)."""
    code = ("import multiprocessing as mp, sys\ndef f(i):\n    for j in range(3):\n"
            "        print(f'worker {i} line {j}', flush=True)\n"
            "    print(f'tail {i}', end='')\n    sys.stdout.flush()\n    return i\n"
            "with mp.get_context('fork').Pool(4) as pool:\n    print(pool.map(f, range(4)))")
    for _ in range(3):
        res, cap = run(ip, code)
        assert res.success, cap.stdout
        for r in (0, 1):
            lines = lines_of(cap.stdout, r)
            assert "" not in lines, cap.stdout  # no line's end sent on its own
            # a partial line flushed on purpose ("tail i") is sent as it is: what follows runs on
            assert sorted(re.findall(r"tail \d", "\n".join(lines))) == [f"tail {i}" for i in range(4)], cap.stdout
            body = [line for line in (re.sub(r"tail \d", "", line) for line in lines) if line]
            assert body[-1] == "[0, 1, 2, 3]", cap.stdout
            assert sorted(body[:-1]) == sorted(f"worker {i} line {j}" for i in range(4) for j in range(3)), cap.stdout


def test_a_display_that_cannot_be_sent_is_not_waited_for(ip: Any) -> None:
    """A display of what JSON cannot hold fails in the rank's Session.send; the cell that catches
    the error must end at once, not after the relay's quiet period for a message never sent."""
    from clorch_repl.session.relay import REPLY_QUIET_S

    t0 = time.monotonic()
    res, cap = run(ip, "from IPython.display import display\ntry:\n"
                       "    display({'application/json': {'a': object()}}, raw=True)\n"
                       "except (TypeError, ValueError) as exc:\n    print('refused', type(exc).__name__)")
    took = time.monotonic() - t0
    assert res.success, cap.stdout
    assert lines_of(cap.stdout, 0)[0].startswith("refused") and lines_of(cap.stdout, 1)[0].startswith("refused")
    assert took < REPLY_QUIET_S, f"the cell took {took:.1f} s: a message never sent was counted"


def test_an_error_on_one_rank_fails_the_cell_with_that_ranks_traceback(ip: Any) -> None:
    res, cap = run(ip, "if rank == 1:\n    raise ValueError('boom on one')\nprint('fine', rank)")
    assert not res.success
    assert lines_of(cap.stdout, 0) == ["fine 0"]
    assert "---- rank 1 ----" in cap.stdout and "---- rank 0 ----" not in cap.stdout
    assert "ValueError" in cap.stdout and "boom on one" in cap.stdout
    assert "clorch_repl" not in cap.stdout  # the rank's traceback, not ours


def test_errors_on_every_rank_show_every_traceback(ip: Any) -> None:
    res, cap = run(ip, "raise RuntimeError(f'failure number {rank}')")
    assert not res.success
    for r in (0, 1):
        assert f"---- rank {r} ----" in cap.stdout and f"failure number {r}" in cap.stdout


def test_exit_in_a_cell_is_refused_and_the_ranks_stay(ip: Any) -> None:
    """exit() asked the rank's kernel to end after the cell: the cell "succeeded" and the ranks
    died unexplained a moment later. Now the cell fails at the call and the ranks go on; a
    sys.exit in a cell no longer comes with IPython's advice to call exit()."""
    for call in ("exit()", "quit()"):
        res, cap = run(ip, f"x = rank\n{call}\nprint('not reached')")
        assert not res.success, cap.stdout
        flat = " ".join(cap.stdout.split())
        assert "ExitRefused" in flat and "exit() would end rank 0's kernel" in flat, cap.stdout
        assert "%clorch stop ends every rank" in flat and "exit_guard" not in flat, cap.stdout
        assert lines_of(cap.stdout, 0) == [] and lines_of(cap.stdout, 1) == [], cap.stdout  # not reached
    time.sleep(1)  # the kernels used to end this long after the cell
    res, cap = run(ip, "print('alive', x)")
    assert res.success and lines_of(cap.stdout, 0) == ["alive 0"] and lines_of(cap.stdout, 1) == ["alive 1"], cap.stdout
    res, cap = run(ip, "import sys\nsys.exit(0)")
    assert "To exit: use" not in cap.stdout + cap.stderr, cap.stdout + cap.stderr


def test_a_pasted_scripts_argparse_sees_no_arguments(ip: Any) -> None:
    """sys.argv held the kernel's -f CONNECTION_FILE: a torchrun script's parse_args(), pasted
    into a cell, read the connection file's path as its first argument."""
    res, cap = run(ip, "import argparse, sys\nparser = argparse.ArgumentParser()\n"
                       "parser.add_argument('--lr', type=float, default=0.1)\nprint(parser.parse_args().lr, sys.argv[1:])")
    assert res.success and lines_of(cap.stdout, 0) == ["0.1 []"] and lines_of(cap.stdout, 1) == ["0.1 []"], cap.stdout


def test_ranks_option_runs_on_the_chosen_ranks_only(ip: Any) -> None:
    res, cap = run(ip, "print('here')", "--ranks 1")
    assert res.success
    assert lines_of(cap.stdout, 1) == ["here"] and lines_of(cap.stdout, 0) == []


@pytest.mark.parametrize("line, message", [
    ("--ranks 0,5", "--ranks names rank 5, which does not exist (0-1)"),
    ("--ranks 1,1", "--ranks repeats 1"),
    ("--ranks x", "--ranks must be comma-separated integers"),
    ("--timeout -3", "--timeout must be a positive number of seconds"),
    ("--bogus", "unrecognized arguments: --bogus"),
    ("--ranks 0 --stdin-ranks 1", "--stdin-ranks names rank 1, which does not run this cell (it runs on rank 0)"),
])
def test_bad_cell_options_give_one_clear_line(ip: Any, line: str, message: str) -> None:
    res, cap = run(ip, "print('never')", line)
    assert not res.success
    assert message in cap.stdout + cap.stderr
    assert "never" not in cap.stdout
    assert "Traceback" not in cap.stdout + cap.stderr


def test_top_level_await_runs_on_every_rank_and_a_plain_cell_after_it(ip: Any) -> None:
    # the ranks answer "is this a coroutine?" without compiling cells that cannot be one
    # (clorch_repl.kernel.rank_kernel.cheap_async_check): both kinds must still run as IPython runs them
    res, cap = run(ip, "import asyncio\nawait asyncio.sleep(0.01)\nprint('awaited', rank)")
    assert res.success, cap.stdout
    assert lines_of(cap.stdout, 0) == ["awaited 0"] and lines_of(cap.stdout, 1) == ["awaited 1"]
    res, cap = run(ip, "async def twice(x):\n    return 2 * x\nprint(await twice(rank))")
    assert res.success and lines_of(cap.stdout, 1) == ["2"], cap.stdout
    res, cap = run(ip, "print('plain', rank)")
    assert res.success and lines_of(cap.stdout, 0) == ["plain 0"]


def test_timeout_interrupts_the_cell_and_the_ranks_stay_usable(ip: Any) -> None:
    res, cap = run(ip, "import time\ntime.sleep(60)", "--timeout 1")
    assert not res.success
    assert "Timed out" in cap.stdout and "KeyboardInterrupt" in cap.stdout
    res, cap = run(ip, "print('still here')")
    assert res.success and lines_of(cap.stdout, 1) == ["still here"]


def test_status_lists_every_rank_as_a_table(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_line_magic("clorch", "status")
    bundle = cap.outputs[-1].data
    assert "<table" in bundle["text/html"]
    rows = bundle["text/plain"].splitlines()[1:]
    assert [r.split()[:2] for r in rows] == [["0", "idle"], ["1", "idle"]]
    assert all("gloo" in r and "cpu" in r for r in rows)


def test_logs_hold_python_and_native_output(ip: Any) -> None:
    res, _ = run(ip, "import os\nprint('python says hi', rank)\nos.write(2, f'native says hi {rank}\\n'.encode())\n"
                     "from IPython.display import display\ndisplay(f'displayed by {rank}')\nf'result of {rank}'")
    assert res.success
    with capture_output() as cap:
        ip.run_line_magic("clorch", "logs 1 --tail 20")
    assert "python says hi 1" in cap.stdout and "native says hi 1" in cap.stdout
    # the cell's displayed results too, as text (issue 25)
    assert "'displayed by 1'" in cap.stdout and "'result of 1'" in cap.stdout, cap.stdout


def test_ranks_listen_on_loopback_and_ipc_only_with_private_files(ip: Any, magics: Any) -> None:
    import json
    import os
    import stat

    group = magics.session.group
    for pid in magics.session.pids():
        listening = [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and set(listening) <= {"127.0.0.1", "::1"}, listening
    assert stat.S_IMODE(os.stat(group.dir).st_mode) & 0o077 == 0
    for rank in (0, 1):
        for name in (f"rank{rank}.json", f"rank{rank}.log", f"rank{rank}.stack"):
            assert stat.S_IMODE(os.stat(os.path.join(group.dir, name)).st_mode) == 0o600, name
        with open(os.path.join(group.dir, f"rank{rank}.json")) as fh:
            info = json.load(fh)
        assert info["transport"] == "ipc" and info["signature_scheme"] == "hmac-sha256"
        assert len(info["key"]) >= 32
    # the group's rendezvous (a FileStore the ranks created): this user's alone too
    store = group.store_file
    assert os.path.exists(store) and stat.S_IMODE(os.stat(store).st_mode) == 0o600, oct(os.stat(store).st_mode)


def test_children_of_ranks_end_with_the_ranks(ip: Any, magics: Any) -> None:
    res, cap = run(ip, "import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nprint(child.pid)")
    assert res.success
    children = [int(lines_of(cap.stdout, r)[0]) for r in (0, 1)]
    pids = magics.session.pids()
    assert all(psutil.pid_exists(p) for p in children + pids)
    ip.run_line_magic("clorch", "stop")
    assert wait_gone(children + pids, 10) == []
    ip.run_line_magic("clorch", "start --nproc 2")  # leave the module's session running


def test_a_rank_killed_mid_cell_fails_the_cell_and_restart_recovers(ip: Any, magics: Any) -> None:
    t0 = time.monotonic()
    res, cap = run(ip, "import os, signal, time, torch, torch.distributed as dist\n"
                       "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                       "time.sleep(0.2)\ndist.all_reduce(torch.ones(1))")
    elapsed = time.monotonic() - t0
    assert not res.success
    assert "rank 1 died" in cap.stdout and "SIGKILL" in cap.stdout
    assert elapsed < 60, f"the cell took {elapsed:.0f} s to notice a dead rank"
    states = {r.rank: r.state.value for r in magics.session.status()}
    assert states[1] == "dead"
    # the survivor keeps its state and runs cells alone, saying so (issue 34); rank 1 is refused
    res, cap = run(ip, "print('still here')")
    assert res.success and lines_of(cap.stdout, 0) == ["still here"] and lines_of(cap.stdout, 1) == []
    assert "%clorch restart --ranks 1" in cap.stdout, cap.stdout
    res, cap = run(ip, "print('too late')", "--ranks 1")
    assert not res.success and "rank 1 (killed by signal SIGKILL" in cap.stdout + cap.stderr
    ip.run_line_magic("clorch", "restart")
    res, cap = run(ip, "import torch, torch.distributed as dist\nt = torch.tensor([rank + 1.0])\n"
                       "dist.all_reduce(t)\nprint(t.item(), 'y' in globals())")
    assert res.success
    assert lines_of(cap.stdout, 0) == ["3.0 False"] and lines_of(cap.stdout, 1) == ["3.0 False"]


def test_a_rank_aborted_by_a_cpp_exception_shows_what_it_was(ip: Any, magics: Any) -> None:
    # gloo finds the sizes differ on rank 0 and throws in its own thread: std::terminate, SIGABRT.
    # What it was is written before faulthandler's report, and belongs in the death report.
    res, cap = run(ip, "import torch, torch.distributed as dist\n"
                       "dist.all_reduce(torch.ones(4 if rank == 0 else 8))", "--timeout 60")
    assert not res.success
    report = cap.stdout.split("rank 0 died", 1)[-1]
    assert "SIGABRT" in report and "Fatal Python error: Aborted" in report, cap.stdout
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in report, cap.stdout
    assert "Received data size doesn't match expected size" in report, cap.stdout
    ip.run_line_magic("clorch", "restart")


def test_a_segfault_names_the_rank_and_shows_where_it_crashed(ip: Any, magics: Any) -> None:
    res, cap = run(ip, "import ctypes, time\ndef crash_here():\n    ctypes.string_at(0)\n"
                       "if rank == 0:\n    crash_here()\ntime.sleep(30)")
    assert not res.success
    assert "rank 0 died" in cap.stdout and "SIGSEGV" in cap.stdout
    assert "Segmentation fault" in cap.stdout and "crash_here" in cap.stdout  # faulthandler, via the log
    # the crashing line, its cell named as the notebook names it (faulthandler wrote the file's path)
    assert re.search(r'File "Cell In\[\d+\]", line 3 in crash_here', cap.stdout), cap.stdout
    assert "---- rank 1 ----" in cap.stdout and "KeyboardInterrupt" in cap.stdout  # the survivor was interrupted
    ip.run_line_magic("clorch", "restart")
    res, cap = run(ip, "print('fresh', rank)")
    assert res.success and lines_of(cap.stdout, 0) == ["fresh 0"]


def test_a_rank_that_raises_before_a_collective_does_not_hang_the_cell(ip: Any) -> None:
    t0 = time.monotonic()
    res, cap = run(ip, "import torch.distributed as dist\nif rank == 1:\n    raise ValueError('early exit')\n"
                       "dist.barrier()")
    elapsed = time.monotonic() - t0
    assert not res.success
    assert "early exit" in cap.stdout  # the cause, from rank 1
    assert "barrier" in cap.stdout  # where rank 0 waited: freed by aborting the group, which formed again
    assert "rank 0 waited in the collective and was freed" in cap.stdout, cap.stdout
    assert "the group was aborted and formed again" in cap.stdout, cap.stdout
    assert elapsed < 60, f"{elapsed:.0f} s: the other rank was left waiting for the group's timeout"
    ip.run_line_magic("clorch", "restart")
