"""Mistakes a user can make before and around %clorch start, and in the hang-diagnosis options
(``--hang-notice``, ``%clorch why``): each gives one clear message (wrapped between words at the
cell's width), before any rank is started."""

from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl import cuda

GPUS = cuda.device_count()


def say(ip: Any, line: str) -> tuple[Any, str]:
    with capture_output() as cap:
        result = ip.run_cell(line)
    return result, cap.stdout + cap.stderr


def refusal(out: str) -> str:
    """A refused command's one message, its words joined by single spaces: IPython shows it after
    ``UsageError: ``, wrapped between words at the cell's width (100 columns), each further line
    indented by two spaces; the test fails if the output is anything else."""
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines and lines[0].startswith("UsageError: "), out
    assert all(line.startswith("  ") for line in lines[1:]), out
    assert all(len(line) <= 100 for line in lines), out
    return " ".join(out.split())


@pytest.fixture()
def no_session(ip: Any, magics: Any) -> Any:
    magics.shutdown()
    return ip


@pytest.mark.parametrize("line, message", [
    ("%clorch start --bogus", "unrecognized arguments: --bogus"),
    # the checks shared with the Python API (nproc=...) name the options as the user typed them here
    ("%clorch start --nproc 0", "UsageError: --nproc must be at least 1; got 0"),
    ("%clorch start --nproc two", "UsageError: --nproc must be a whole number of ranks"),
    ("%clorch start --devices 0,0", "UsageError: --devices repeats 0"),
    ("%clorch start --devices 999", "--devices 999 were given, but this machine has no usable GPU; leave out --devices"
     if GPUS == 0 else "--devices names GPU 999, which does not exist"),
    ("%clorch start --nproc 3 --devices 0,1", "UsageError: --nproc 3 and --devices 0,1 disagree"),
    pytest.param("%clorch start --backend nccl", "--backend nccl needs GPUs and this machine has none; use --backend gloo",
                 marks=pytest.mark.skipif(GPUS > 0, reason=f"this machine has {GPUS} GPU(s): nccl would start")),
    ("%clorch start --backend mpi", "UsageError: --backend must be one of nccl, gloo"),
    ("%clorch start --timeout 0", "UsageError: --timeout must be a positive number of seconds"),
    ("%clorch start --timeout 0.01", "UsageError: --timeout 0.01 s is the process group's"),
    ("%clorch start --timeout 0.01", "a cell's own time limit is %%distributed --timeout"),
    ("%clorch start --devices 3-1", "UsageError: --devices: the range 3-1 runs backwards"),
    ("%clorch start --launcher slurm --nproc-per-node 2 --backend mpi", "UsageError: --backend must be one of"),
    ("%clorch frobnicate", "unknown %clorch command 'frobnicate'"),
    # a value that begins with "-" is the option's, checked by it (argparse alone said only
    # "expected one argument")
    ("%clorch detach --keep-for -5m", "--keep-for must be a duration above zero such as 90s, 30m, 2h or 1d; got '-5m'"),
    ("%clorch detach --keep-for 99999d", "--keep-for must be at most 30d (30 days)"),
    ("%clorch start --suspend-after 99999d", "--suspend-after must be at most 30d (30 days)"),
    ("%clorch suspend --after 31d", "--after must be at most 30d (30 days)"),
    ("%clorch start --backend -gloo", "backend must be one of nccl, gloo"),
    ("%clorch start --nproc --devices 0", "argument --nproc: expected one argument"),
    ("%clorch run --bogus x.py", "unrecognized arguments: --bogus (see --help)"),
    # quotes are taken off as a shell takes them (they were kept: "session name \"'a b'\"", "got \"'0'\"")
    ("%clorch start --name 'a b'", "session name 'a b' must be 1-64 letters"),
    ("%clorch start --nproc '0'", "--nproc must be at least 1; got 0"),
    ('%clorch start --name "a b', "cannot read '--name \"a b': no closing quotation; close the quote"),
    ("%clorch run 'train.py", "cannot read \"'train.py\": no closing quotation"),
    # options of other launchers were ignored without a word
    ("%clorch start --partition gpu", "--partition is for --launcher slurm, and this start's launcher is local: "
                                      "give the launcher they are for, or leave them out"),
    ("%clorch start --nodes 2 --port 5000 --srun-args -N2", "--nodes, --port are for --launcher slurm or attach; "
                                                            "--srun-args is for --launcher slurm, and"),
    ("%clorch start --launcher attach --time 10", "--time is for --launcher slurm, and this start's launcher is "
                                                  "attach"),
    ("%clorch start --name foo\\", "no escaped character; a \\ at the end escapes nothing: remove it"),
    ("%%distributed\nprint(1)", "no ranks are running: run %clorch start first"),
    ("%clorch logs 0", "no ranks are running: run %clorch start first"),
    ("%clorch interrupt", "no ranks are running"),
    ("%clorch restart", "nothing to restart: run %clorch start first"),
])
def test_bad_input_gives_one_clear_message(no_session: Any, line: str, message: str) -> None:
    result, out = say(no_session, line)
    assert not result.success
    assert message in refusal(out), out
    assert "Traceback" not in out and "clorch_repl/" not in out


def test_option_values_are_read_without_their_quotes(magics: Any) -> None:
    """``--name 'alice-train'`` names the session alice-train (the quotes were kept, and the name
    refused); ``--srun-args "--gres=gpu:8 --exclusive"`` is srun's two arguments (it reached srun as
    one, quotes and all); a quoted value that begins with "-" is still the option's."""
    from clorch_repl.magics.arguments import parse, parse_launch
    from clorch_repl.magics.cell_options import cell_options

    args = parse(magics._start, "--launcher slurm --name 'alice-train' --srun-args \"--gres=gpu:8 --exclusive\" "
                                "--nproc '2'")
    options = parse_launch(args)
    assert (options.name, options.srun_args, args.nproc) == ("alice-train", "--gres=gpu:8 --exclusive", "2")
    assert parse(magics._detach, '--keep-for "2h" --name "bob.1"').keep_for == "2h"
    assert parse(magics._detach, "--keep-for '-5m'").keep_for == "-5m"  # the option's own check refuses it
    assert cell_options(magics.distributed, "--ranks '0,2' --gather 'out'").ranks == (0, 2)
    # srun's own -h as --srun-args' value is no request for %clorch start's help (it printed the help)
    assert parse(magics._start, "--launcher slurm --srun-args '-h'").srun_args == "-h"
    assert parse(magics._start, "--launcher slurm -h") is None  # the help, printed


def test_help_works_for_every_command(no_session: Any) -> None:
    for line in ("%clorch --help", "%clorch start --help", "%clorch logs --help", "%%distributed --help\npass"):
        result, out = say(no_session, line)
        assert result.success, out
        assert "%clorch" in out or "%distributed" in out, (line, out)
        assert not out.startswith("::"), out  # IPython's reST marker for its own documentation pages
    _, out = say(no_session, "%clorch start --help")
    assert "--devices" in out and "--backend" in out


def test_stop_without_ranks_says_so(no_session: Any) -> None:
    result, out = say(no_session, "%clorch stop")
    assert result.success and "no ranks are running" in out


# ------------------------------------------------------------------ hang-diagnosis options
@pytest.mark.parametrize("line, message", [
    ("%clorch start --hang-notice -1", "--hang-notice must be 0 (off) or a positive number of seconds; got '-1'"),
    ("%clorch start --hang-notice soon", "--hang-notice must be a number of seconds (0 turns it off); got 'soon'"),
    ("%clorch start --hang-notice inf", "--hang-notice must be 0 (off) or a positive number of seconds"),
    ("%%distributed --hang-notice -3\npass", "--hang-notice must be 0 (off) or a positive number of seconds"),
    ("%clorch why", "no ranks are running: run %clorch start first"),
    ("%clorch why --rank one", "--rank must be a rank number; got 'one'"),
    ("%clorch why --bogus", "unrecognized arguments: --bogus"),
])
def test_bad_hang_options_give_one_clear_message(no_session: Any, magics: Any, line: str, message: str) -> None:
    result, out = say(no_session, line)
    assert not result.success
    assert message in refusal(out), out
    assert "Traceback" not in out and "clorch_repl/" not in out
    assert magics.session is None  # nothing was started


def test_why_and_hang_notice_have_help(no_session: Any) -> None:
    _, out = say(no_session, "%clorch why --help")
    assert "--rank" in out and "--all-threads" in out
    _, out = say(no_session, "%%distributed --help\npass")
    assert "--hang-notice" in out
    _, out = say(no_session, "%clorch --help")
    assert "why" in out


def test_start_reports_what_the_user_waited_from_the_command(no_session: Any, magics: Any, monkeypatch: Any) -> None:
    """``%clorch start``'s "formed in" is what the user waited: it used to count from after the
    launcher's set-up (its topology, the warm spares taken), so a slow set-up went unsaid.

    Mocked, because starting ranks only to read a duration costs seconds and the real set-up here
    is fast: the launcher's topology is made slow (the local launcher's own, 0.4 s later), and
    Session.start only reads the clock it is handed (its own "formed in" counts from that clock,
    ``progress.since``), then refuses, so nothing is started."""
    import time

    from clorch_repl.launchers.local import LocalLauncher
    from clorch_repl.magics import core

    class SlowSetUp(LocalLauncher):
        @classmethod
        def topology(cls, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.4)
            return super().topology(*args, **kwargs)

    waited: list[float] = []

    def start(session: Any, progress: Any) -> float:
        waited.append(time.monotonic() - progress.since)
        raise core.ClorchError("not started: the test only reads the clock")

    monkeypatch.setattr(core, "launcher_class", lambda name: SlowSetUp)
    monkeypatch.setattr(core.Session, "start", start)
    result, out = say(no_session, "%clorch start --nproc 1 --backend gloo")
    assert not result.success and "not started" in out, out
    assert waited and waited[0] >= 0.4, waited
    assert magics.session is None
