"""``%clorch run``: torchrun scripts of our own (tests/torchrun_scripts) run unchanged on a real
2-rank gloo session, and torchrun code's init/destroy/spawn inside ranks, driven through IPython's
shell as a notebook drives it. The tests share one session, in this order: the group's survival
of destroy_process_group() is checked first, and every later test's collectives depend on it."""

from __future__ import annotations

import os
import shlex
import time
from typing import Any

import psutil
import pytest
from IPython.utils.capture import capture_output

from clorch_repl.kernel.torchrun import KEPT_NOTE
from rank_text import lines_of, said as said_by_clorch

pytestmark = pytest.mark.usefixtures("ranks")

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_scripts")
DDP = os.path.join(SCRIPTS, "ddp_resume.py")
REPORT = os.path.join(SCRIPTS, "report.py")
EXITS = os.path.join(SCRIPTS, "exits.py")
ALL_REDUCE = ("import torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
              "print('sum', t.item(), dist.get_world_size())")


def run(ip: Any, line: str) -> tuple[Any, Any]:
    with capture_output() as cap:
        result = ip.run_cell(f"%clorch run {line}")
    return result, cap


def cell(ip: Any, code: str, line: str = "") -> tuple[Any, Any]:
    with capture_output() as cap:
        result = ip.run_cell(f"%%distributed {line}\n{code}")
    return result, cap


def error_of(result: Any) -> str:
    """The refusal's words on one line: clorch wraps its messages to the cell's width (issue 38)."""
    assert not result.success, "the cell should have failed"
    return " ".join(str(result.error_in_exec).split())


def assert_group_works(ip: Any) -> None:
    res, cap = cell(ip, ALL_REDUCE)
    assert res.success, cap.stdout + cap.stderr
    assert all(lines_of(cap.stdout, r) == ["sum 3.0 2"] for r in (0, 1)), cap.stdout


def test_init_that_agrees_is_accepted_and_destroy_keeps_the_group(ip: Any) -> None:
    code = ("import datetime, torch, torch.distributed as dist\n"
            "from torch.distributed import init_process_group\n"
            "dist.init_process_group('gloo')\n"
            "init_process_group(backend='gloo', init_method='env://', world_size=2, rank=rank,\n"
            "                   timeout=datetime.timedelta(seconds=30))\n"
            "print('default kept', dist.get_world_size(), dist.get_backend())\n"
            "sub = dist.new_group([0, 1])\n"
            "dist.destroy_process_group()\n"
            "dist.destroy_process_group()\n"
            "t = torch.ones(1)\ndist.all_reduce(t)\nprint('after destroy', t.item())")
    res, cap = cell(ip, code)
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        notes = [line for line in lines_of(cap.stdout, r) if line.startswith(KEPT_NOTE)]
        assert [line for line in lines_of(cap.stdout, r) if line not in notes] == ["default kept 2 gloo",
                                                                                  "after destroy 2.0"]
        assert len(notes) == 1, cap.stdout  # said once, in one line, for two destroys
        assert KEPT_NOTE not in cap.stderr  # a notice, not an error: not on stderr's red (issue 38)
        assert "ended 1 subgroup(s) the code made" in notes[0]
    # the subgroup the code made is gone; a subgroup's own destroy is torch's
    res, cap = cell(ip, "groups = dist.distributed_c10d._world.pg_map\nprint('subgroup gone', sub not in groups)\n"
                        "other = dist.new_group([0, 1])\nprint('made', other in groups)\n"
                        "dist.destroy_process_group(other)\nprint('groups', len(groups), other in groups)")
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        assert lines_of(cap.stdout, r) == ["subgroup gone True", "made True", "groups 1 False"], cap.stdout
    assert KEPT_NOTE not in cap.stderr + cap.stdout
    assert_group_works(ip)


def test_init_that_disagrees_raises_one_error_naming_each_difference(ip: Any) -> None:
    code = ("import torch, torch.distributed as dist\nfrom clorch_repl.errors import GroupConflict\n"
            "for kwargs in ({'backend': 'nccl'}, {'world_size': 3}, {'rank': 1 - rank},\n"
            "               {'init_method': 'tcp://127.0.0.1:1'}, {'device_id': torch.device('cuda', 0)}):\n"
            "    try:\n        dist.init_process_group(**kwargs)\n"
            "    except GroupConflict as exc:\n        print(sorted(kwargs), str(exc).split(': ', 1)[1])\n")
    res, cap = cell(ip, code)
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        shown = lines_of(cap.stdout, r)
        assert len(shown) == 5, cap.stdout
        assert shown[0].startswith("['backend'] backend='nccl', but the session's group uses gloo")
        assert shown[1].startswith("['world_size'] world_size=3, but the session's group has 2 rank(s)")
        assert shown[2].startswith(f"['rank'] rank={1 - r}, but this process is rank {r}")
        assert shown[3].startswith("['init_method'] init_method='tcp://127.0.0.1:1' would form a second group")
        assert shown[4].startswith("['device_id'] device_id=cuda:0, but this rank has no GPU")
    res, cap = cell(ip, "dist.init_process_group('gloo', world_size=4)")
    error = error_of(res)
    assert error.startswith("ranks 0-1: GroupConflict: init_process_group() disagrees with the session's gloo "
                            "group of 2 rank(s)"), error
    assert "clorch_repl" not in cap.stdout  # the rank's traceback ends at the user's call
    assert_group_works(ip)


def test_a_ddp_script_runs_twice_resuming_and_a_collective_works_after(ip: Any, tmp_path: Any) -> None:
    snap = tmp_path / "snap.pt"
    t0 = time.monotonic()
    res, cap = run(ip, f"{DDP} --epochs 2 --snapshot {snap}")
    first_s = time.monotonic() - t0
    assert res.success, cap.stdout + cap.stderr
    first = {r: lines_of(cap.stdout, r) for r in (0, 1)}
    for r in (0, 1):
        epochs = [line.split(" loss")[0] for line in first[r] if line.startswith("epoch")]
        assert epochs == [f"epoch 0 rank {r} samples 128", f"epoch 1 rank {r} samples 128"], cap.stdout
    assert [line for line in first[0] if line.startswith("snapshot")] == ["snapshot at epoch 0", "snapshot at epoch 1"]
    assert not [line for line in first[1] if line.startswith("snapshot")]
    weights = {r: [line for line in first[r] if line.startswith("weights")] for r in (0, 1)}
    assert len(weights[0]) == 1 and weights[0] == weights[1], cap.stdout  # DDP kept the replicas equal
    assert snap.exists()

    res, cap = run(ip, f"{DDP} --epochs 4 --snapshot {snap}")
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        shown = lines_of(cap.stdout, r)
        assert shown[0] == "resumed from epoch 1", cap.stdout
        assert [line.split(" loss")[0] for line in shown if line.startswith("epoch")] == [
            f"epoch 2 rank {r} samples 128", f"epoch 3 rank {r} samples 128"]
    # the script's globals stay in each rank's namespace; the session's group still works
    res, cap = cell(ip, "print(callable(main), len(make_data()), __name__)\n" + ALL_REDUCE)
    assert res.success, cap.stdout + cap.stderr
    assert all(lines_of(cap.stdout, r) == ["True 256 __main__", "sum 3.0 2"] for r in (0, 1)), cap.stdout
    print(f"TIMING %clorch run of two DDP epochs on 2 gloo ranks: {first_s:.2f} s")

    # the same code pasted into a cell (its last line calls main with the arguments) prints the same
    with open(DDP) as fh:
        source = fh.read()
    pasted = source.replace("    main()\n", f"    main(['--epochs', '2', '--snapshot', {str(tmp_path / 'pasted.pt')!r}])\n")
    assert pasted != source
    res, cap = cell(ip, pasted)
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        assert lines_of(cap.stdout, r) == first[r], cap.stdout
    assert_group_works(ip)


def test_the_script_sees_what_torchrun_gives_it_and_leaves_its_globals(ip: Any, tmp_path: Any) -> None:
    res, cap = run(ip, f"{REPORT} a --b 2 --ranks 7")  # after the script: the script's own arguments
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        assert lines_of(cap.stdout, r) == [
            "name __main__", "argv report.py a --b 2 --ranks 7",
            f"env RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=1 "
            f"ROLE_RANK={r} ROLE_WORLD_SIZE=2 TORCHELASTIC_RUN_ID=clorch",
            "master True True", "sees rank False"], cap.stdout
    res, cap = cell(ip, "import sys\nprint(report['RANK'], argv[1:], 'report' in sys.argv[0])")
    assert res.success, cap.stdout
    assert lines_of(cap.stdout, 1) == ["1 ['a', '--b', '2', '--ranks', '7'] False"]  # sys.argv restored

    pickles = tmp_path / "pickles.py"  # what the script defines pickles: it has a __main__ module of its own
    pickles.write_text("import pickle, sys\nclass Point:\n    pass\n"
                       "back = pickle.loads(pickle.dumps(Point()))\n"
                       "print(type(back).__name__, sys.modules['__main__'].__file__ == __file__, sys.path[0])\n")
    res, cap = run(ip, str(pickles))
    assert res.success and lines_of(cap.stdout, 0) == [f"Point True {tmp_path}"], cap.stdout + cap.stderr
    res, cap = run(ip, "-m tests.torchrun_scripts.report x")
    assert res.success, cap.stdout + cap.stderr
    assert lines_of(cap.stdout, 0)[1] == "argv report.py x" and lines_of(cap.stdout, 0)[-1] == "sees rank False"
    res, cap = run(ip, "--ranks 1 -i -m tests.torchrun_scripts.report")  # -i: the rank's own namespace
    assert res.success, cap.stdout + cap.stderr
    assert lines_of(cap.stdout, 0) == [] and lines_of(cap.stdout, 1)[-1] == "sees rank True", cap.stdout


def test_a_script_path_and_arguments_arrive_verbatim_never_as_code(ip: Any, tmp_path: Any) -> None:
    """They travel as JSON data in a request (clorch_repl.wire.requests), so quotes and a
    would-be statement in them reach the script as the strings they were, and run nothing."""
    folder = tmp_path / "it's \"quoted\""
    folder.mkdir()
    script = folder / "echo.py"
    script.write_text("import sys\nprint('argv', repr(sys.argv[1:]))\n")
    marker = tmp_path / "injected"
    args = [f"'); open({str(marker)!r}, 'w'); ('", "'); import os; ('", '"); import os; ("', "a'b\"c\\n"]
    res, cap = run(ip, " ".join(shlex.quote(a) for a in [str(script), *args]))
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):
        assert lines_of(cap.stdout, r) == [f"argv {args!r}"], cap.stdout
    assert not marker.exists()


def test_exit_statuses(ip: Any) -> None:
    for clean in ("0", "none"):
        res, cap = run(ip, f"{EXITS} {clean}")
        assert res.success, cap.stdout + cap.stderr
        assert all(lines_of(cap.stdout, r) == ["before exit"] for r in (0, 1)), cap.stdout
    res, cap = run(ip, f"{EXITS} 3")
    assert error_of(res) == "ranks 0-1: ScriptExit: exits.py exited with status 3 (sys.exit at exits.py:26)"
    # one line under the ranks' heading, not a traceback header with no frames under it
    assert "ScriptExit\x1b[0m: exits.py exited with status 3" in cap.stdout and "Traceback" not in cap.stdout, cap.stdout
    res, cap = run(ip, f"{EXITS} 2 1")  # only rank 1 exits
    assert error_of(res) == "rank 1: ScriptExit: exits.py exited with status 2 (sys.exit at exits.py:26)"
    assert lines_of(cap.stdout, 0) == ["before exit", "after exit"]
    res, cap = run(ip, f"{EXITS} msg")
    assert error_of(res).startswith("ranks 0-1: ScriptExit: exits.py exited with status 1")
    assert all(lines_of(cap.stderr, r) == ["cannot go on: no data"] for r in (0, 1)), cap.stderr
    res, cap = run(ip, f"{DDP} --epochs x --snapshot /nowhere")  # argparse's own message, then status 2
    assert error_of(res).startswith("ranks 0-1: ScriptExit: ddp_resume.py exited with status 2")
    assert "ddp_resume.py: error: argument --epochs: invalid int value: 'x'" in lines_of(cap.stderr, 1), cap.stderr
    res, cap = run(ip, f"{EXITS} raise")  # an exception: the script's own frames, none of clorch's
    assert error_of(res) == "rank 0: ValueError: bad value on rank 0; rank 1: ValueError: bad value on rank 1"
    assert "exits.py:16" in cap.stdout and "exits.py:25" in cap.stdout and "clorch_repl" not in cap.stdout
    res, cap = cell(ip, "print(callable(fail), what)")  # a failed script's globals stay too, for a look
    assert res.success and all(lines_of(cap.stdout, r) == ["True raise"] for r in (0, 1)), cap.stdout
    assert_group_works(ip)


def test_exit_and_quit_end_a_script_as_under_python(ip: Any, tmp_path: Any) -> None:
    """IPython hides the builtins' exit/quit during a cell, and the rank namespace's would shut its
    kernel down: a script gets python's (SystemExit), with -i too, and the rank's own come back."""
    script = tmp_path / "ends.py"
    script.write_text("import os\nprint('ending')\nexit(0) if os.environ['RANK'] == '0' else quit(4)\n")
    for line in (str(script), f"-i {script}"):
        res, cap = run(ip, line)
        assert error_of(res) == "rank 1: ScriptExit: ends.py exited with status 4 (sys.exit at ends.py:3)", line
        assert all(lines_of(cap.stdout, r) == ["ending"] for r in (0, 1)), cap.stdout
    res, cap = cell(ip, "print(type(exit).__name__, 'ends' in __file__ if '__file__' in dir() else None)")
    assert res.success and lines_of(cap.stdout, 0) == ["ZMQExitAutocall None"], cap.stdout
    assert_group_works(ip)


def test_spawn_is_refused_before_any_process_starts(ip: Any, magics: Any, tmp_path: Any) -> None:
    pids = magics.session.pids()
    before = {p: {c.pid for c in psutil.Process(p).children(recursive=True)} for p in pids}
    marker = tmp_path / "started"
    res, cap = run(ip, f"{os.path.join(SCRIPTS, 'spawner.py')} {marker}")
    error = error_of(res)
    assert error.startswith("ranks 0-1: SpawnRefused: torch.multiprocessing.spawn(worker, nprocs=2) would start "
                            "processes of its own"), error
    assert "call worker(rank, *args) on every rank instead" in error and "no process was started" in error
    assert list(tmp_path.iterdir()) == []
    assert {p: {c.pid for c in psutil.Process(p).children(recursive=True)} for p in pids} == before
    res, cap = cell(ip, "import torch.multiprocessing as mp\nmp.start_processes(print, nprocs=2)")
    assert "SpawnRefused: torch.multiprocessing.start_processes(print, nprocs=2)" in error_of(res)
    res, cap = cell(ip, "from torch.utils.data import DataLoader\n"  # worker processes of its own are fine
                        "print(sorted(int(x) for b in DataLoader(list(range(8)), batch_size=2, num_workers=2) for x in b))")
    assert res.success and lines_of(cap.stdout, 1) == ["[0, 1, 2, 3, 4, 5, 6, 7]"], cap.stdout + cap.stderr
    assert_group_works(ip)


def test_a_script_missing_or_broken_on_the_ranks_is_named_and_nothing_runs(ip: Any, tmp_path: Any) -> None:
    res, cap = run(ip, "no/such/train.py --epochs 1")
    error = error_of(res)
    assert error.startswith("%clorch run no/such/train.py: nothing was run: ranks 0-1: ScriptNotFound: no script "
                            "'no/such/train.py' on host "), error
    assert "it must exist on every node that runs a rank" in error
    res, cap = run(ip, "-m no_such_module_xyz")
    assert "cannot find module 'no_such_module_xyz'" in error_of(res) or "no module 'no_such_module_xyz'" in error_of(res)
    broken = os.path.join(str(tmp_path), "broken.py")
    with open(broken, "w") as fh:
        fh.write("print('never')\ndef f(:\n    pass\n")
    res, cap = run(ip, broken)  # python reads the whole script first: nothing of it runs
    assert error_of(res) == (f"%clorch run {broken}: nothing was run: ranks 0-1: SyntaxError: invalid syntax "
                             "(broken.py, line 2)"), error_of(res)
    assert "never" not in cap.stdout
    res, cap = run(ip, "--ranks 5 x.py")
    assert "--ranks" in error_of(res)


def test_timeout_ends_a_script_as_it_ends_a_cell(ip: Any) -> None:
    res, cap = run(ip, f"--timeout 2 {os.path.join(SCRIPTS, 'sleeper.py')} 60")
    assert error_of(res).startswith("the cell timed out after 2 s"), error_of(res)
    assert all(lines_of(cap.stdout, r) == ["sleeping"] for r in (0, 1)), cap.stdout
    assert_group_works(ip)


def test_a_stuck_ranks_stack_shows_the_scripts_frames_only(ip: Any, tmp_path: Any) -> None:
    """Rank 1 fails, rank 0 waits in its all_reduce: the report's stack of rank 0 starts at the
    script's line, not at the request's cell (``Cell In[7], line 1`` and clorch's request text)."""
    script = tmp_path / "onefails.py"
    script.write_text("import os, torch, torch.distributed as dist\n"
                      "if os.environ['RANK'] == '1':\n    raise RuntimeError('no shard on rank 1')\n"
                      "t = torch.ones(1)\ndist.all_reduce(t)\n")
    res, cap = run(ip, f"--timeout 60 {script}")
    shown = "\n".join([cap.stdout, *res.error_in_exec._render_traceback_()])
    assert "no shard on rank 1" in shown and "stack (most recent call last):" in shown, shown
    stack = shown.split("stack (most recent call last):", 1)[1]
    assert stack.lstrip().startswith(f"{script}:5 in <module>") or \
        stack.lstrip().startswith(f"{os.path.relpath(script)}:5 in <module>"), shown
    assert "clorch_repl" not in stack and "Cell In[" not in stack, shown
    assert_group_works(ip)


def test_kernel_interrupt_reaches_a_running_script(tmp_path: Any) -> None:
    """Kernel > Interrupt (SIGINT to a real notebook kernel) during %clorch run: KeyboardInterrupt
    in the script on every rank, at the script's line, and the session goes on."""
    from notebook_kernel import clorch_session

    with clorch_session() as nb:
        msg_id = nb.send(f"%clorch run {os.path.join(SCRIPTS, 'sleeper.py')} 60")
        nb.wait_for_ranks(msg_id, "sleeping")
        t0 = time.monotonic()
        nb.km.interrupt_kernel()
        reply = nb.collect(msg_id, timeout=60)
        assert reply.status == "error" and time.monotonic() - t0 < 10, reply.text
        assert "KeyboardInterrupt" in reply.text and "sleeper.py:6" in reply.text, reply.text
        after = nb.run("%%distributed\n" + ALL_REDUCE)
        assert after.status == "ok" and all(lines_of(after.text, r) == ["sum 3.0 2"] for r in (0, 1)), after.text
        # sys.exit's message comes after what the script printed before it: once because stdout
        # was still buffered on the rank, once because the notebook flushed its two streams in a
        # set's order (the page showed stderr first in some processes)
        script = tmp_path / "gives_up.py"
        script.write_text("import sys\nprint('working')\nprint('step done')\nsys.exit('giving up: bad data')\n")
        reply = nb.run(f"%clorch run {script}")
        assert reply.status == "error", reply.text
        assert reply.text.index("step done") < reply.text.index("giving up: bad data"), reply.text


def test_a_stall_in_a_script_gets_the_cells_hang_notice(ip: Any, tmp_path: Any) -> None:
    script = tmp_path / "stalls.py"
    script.write_text("import os, time, torch, torch.distributed as dist\n"
                      "def load():\n    time.sleep(7)\n"
                      "if os.environ['RANK'] == '1':\n    load()\n"
                      "dist.all_reduce(torch.ones(4))\nprint('joined')\n")
    res, cap = run(ip, f"--hang-notice 2 {script}")
    assert res.success, cap.stdout + cap.stderr
    said = cap.stdout + cap.stderr
    notice = said_by_clorch(said, "clorch: no progress on any rank")  # wrapped: one line per notice again
    assert len(notice) == 1, said
    assert "all_reduce" in notice[0] and "rank 1 never called it and is at" in notice[0], notice
    assert "stalls.py" in notice[0] and "load()" in notice[0], notice
    assert all(lines_of(cap.stdout, r) == ["joined"] for r in (0, 1)), cap.stdout


def test_a_rank_that_dies_in_a_script_is_reported(ip: Any, tmp_path: Any) -> None:
    """Last: the session is broken afterwards (the module's fixture stops it)."""
    script = tmp_path / "dies.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    os._exit(3)\nimport time\ntime.sleep(30)\n")
    t0 = time.monotonic()
    res, cap = run(ip, str(script))
    assert "rank 1 died (exit code 3)" in error_of(res), error_of(res)
    assert time.monotonic() - t0 < 25
