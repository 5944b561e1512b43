"""Shared fixtures, and the split of the suite into a fast unit half and the integration half.

Fixtures: an IPython shell with clorch_repl loaded, and a running 2-rank gloo session. The shell is
IPython's real InteractiveShell, in this process; the ranks are real ipykernels in real processes
forming a real gloo group. Nothing of clorch_repl is mocked.

The split is the folder a test file is in. Every test under ``tests/unit/`` is marked ``unit``;
every other test ``integration``: ``tests/integration/``, and beside it ``tests/gpu/`` (run on GPU
hosts by ``scripts/gpu_check.sh`` as ``pytest tests/gpu``; it skips here) and ``tests/browser/``
(JupyterLab in Chromium, needing what CI installs). Those two keep their own folders because they
are run, skipped or left out as a whole by their path, apart from the rest (scripts, CI and
docs/PERFORMANCE.md name them so), and the unit tests read ``tests/gpu/recorded`` (NCCL answers
recorded on GPUs). The modules shared by both halves stay at ``tests/``: the helpers
(``notebook_kernel.py``, ``rank_text.py``, ``dist_workers.py``, ``train_helpers.py``, ...),
``torchrun_scripts/`` and ``plugins/`` (a launcher package found through its entry point); ranks,
notebook kernels and subprocesses import them as ``tests.X`` (the repository root is on their
``PYTHONPATH``) or by their bare names (``tests/`` is on ``sys.path``, which ``dist.launch`` passes
on to its ranks). ``tests/unit`` and ``tests/integration`` are on ``sys.path`` too: a module split
in two imports the helpers of its other half by bare name (``from test_merge_output import feed``),
and ``tests/gpu`` those of the CPU tests it mirrors (``from test_remote_ranks import torchrun``).
A module whose tests fell in both halves was split: the half with more lines kept its name in its
folder, the other is ``test_<name>_units.py`` in ``tests/unit`` or ``test_<name>_live.py`` in
``tests/integration``.

The fast half is ``bash scripts/test.sh --fast``, i.e. ``pytest --fast`` (which collects only
``tests/unit``); ``pytest -m unit`` selects the same tests but imports every test file. A unit test
is held to what the folder promises, in every run (the full one included): it fails if its setup
or call starts a process (a Python audit hook sees every ``subprocess``/``os.fork``/
``os.posix_spawn``/``os.exec*``/``os.system`` and multiprocessing's spawn), or if its call takes
over ``CLORCH_UNIT_LIMIT_S`` seconds of CPU (2 by default) or five times that of wall clock; such a
test belongs in ``tests/integration``. A test file directly in ``tests/`` is a usage error: it
goes in one of the two folders, so the layout stays the split.
"""

from __future__ import annotations

import _posixsubprocess
import atexit
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
# Ranks and notebook kernels import the tests' own helper modules (``import tests.train_helpers``)
# as a notebook in ROOT could; this process gets ROOT from ``pythonpath`` in pyproject.toml.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
# Connect files of multi-host sessions go to a private directory of this test run (not ~/.clorch),
# removed at its end: tests kill notebooks, which cannot remove their own.
_CONNECT_DIR = tempfile.mkdtemp(prefix="clorch-test-connect-")
os.environ["CLORCH_CONNECT_DIR"] = _CONNECT_DIR
atexit.register(shutil.rmtree, _CONNECT_DIR, True)
# Stopped sessions' rank logs go with their session's files in this test run (by default they are kept
# beside it, clorch_repl.host.logfiles): hundreds of sessions would leave hundreds of folders.
# tests/integration/test_notebook_kernel.py turns keeping on again to test it.
os.environ["CLORCH_KEEP_LOGS"] = "0"

# The fast half: the test modules under tests/unit, whose every test starts no process: no worker
# kernels, no notebook kernel, no torch.distributed group, no subprocess, no browser, no hosts.
UNIT = os.path.join(HERE, "unit")
# Bare-name imports: the shared helpers in tests/ (as before the split; pytest would add it for
# this conftest alone), and the two halves' modules, which a split module's other half and
# tests/gpu import.
for _folder in (os.path.join(HERE, "integration"), UNIT, HERE):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

# The most a unit test's call may take: seconds of this process's CPU time (load from other
# processes on the machine does not count), and five times that of wall-clock time (a test that
# waits is not a unit test either).
UNIT_LIMIT_S = float(os.environ.get("CLORCH_UNIT_LIMIT_S", "2"))

# Audit events (https://docs.python.org/3/library/audit_events.html) that start a process.
_PROCESS_EVENTS = frozenset({
    "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
    "pty.spawn", "_posixsubprocess.fork_exec",
})
_running_unit: str | None = None  # the node id of the unit test in its setup or call now, if any
_spawned: list[str] = []  # what it tried to start
_call_took = pytest.StashKey[tuple[float, float]]()  # a unit test's call: (CPU s, wall s)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Refuse a process started by a unit test (the refusal reaches the test as its failure)."""
    if _running_unit is None or event not in _PROCESS_EVENTS:
        return
    what = f"{event}{args[:2]!r}"
    _spawned.append(what)
    raise RuntimeError(f"unit test {_running_unit} started a process ({what}); a test that starts "
                       f"processes belongs to the integration half: move it to tests/integration")


sys.addaudithook(_audit)


def _audited_fork_exec(*args: Any, **kwargs: Any) -> Any:
    """``_posixsubprocess.fork_exec``, announced first: multiprocessing's spawn and forkserver start
    methods call it directly, without an audit event of their own. Not a mock: it calls through."""
    sys.audit("_posixsubprocess.fork_exec", args[:1])
    return _fork_exec(*args, **kwargs)


_fork_exec = _posixsubprocess.fork_exec
_posixsubprocess.fork_exec = _audited_fork_exec


def _in(folder: str, path: str) -> bool:
    path = os.path.abspath(path)
    return path == folder or path.startswith(folder + os.sep)


def _is_unit(item: pytest.Item) -> bool:
    return _in(UNIT, str(item.path))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="run only the fast unit half (-m unit), collecting only tests/unit")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a test file directly in tests/ (it would be integration without saying so); with
    --fast, select the unit tests."""
    loose = sorted(n for n in os.listdir(HERE) if n.startswith("test_") and n.endswith(".py"))
    if loose:
        raise pytest.UsageError(f"test files directly in tests/: {loose}; move each to tests/unit (it starts no "
                                f"process) or tests/integration (the folder is the half)")
    if config.getoption("fast"):
        expr = config.option.markexpr
        config.option.markexpr = f"unit and ({expr})" if expr else "unit"


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """With --fast, skip importing the test files (and folders) outside tests/unit."""
    if not config.getoption("fast"):
        return None
    path = os.path.abspath(str(collection_path))
    if path == HERE or not _in(HERE, path) or _in(UNIT, path) or _in(path, UNIT):
        return None
    name = os.path.basename(path)
    if os.path.isdir(path) or (name.startswith("test_") and name.endswith(".py")):
        return True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test ``unit`` or ``integration`` by its folder (tryfirst: before ``-m`` selects on
    the marks)."""
    for item in items:
        item.add_marker(pytest.mark.unit if _is_unit(item) else pytest.mark.integration)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Watch a unit test's setup and call for processes.

    Not its teardown: that is where pytest also ends the module- and session-scoped fixtures that
    earlier integration tests started (a module's ranks are stopped in its last test's teardown).
    """
    global _running_unit
    _spawned.clear()
    _running_unit = item.nodeid if item.get_closest_marker("unit") is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Time a unit test's call (only the call: setup may end what earlier integration tests left)."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        return (yield)
    finally:
        item.stash[_call_took] = (time.process_time() - cpu, time.perf_counter() - wall)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    global _running_unit
    _running_unit = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Turn a unit test's report into a failure when it broke the fast half's promises."""
    report: pytest.TestReport = yield
    if item.get_closest_marker("unit") is None:
        return report
    spawned = list(_spawned)
    _spawned.clear()  # reported once, in the phase that started it
    if report.failed or report.skipped:
        return report
    problems = []
    if spawned:
        problems.append(f"started a process: {', '.join(spawned)}")
    if call.when == "call" and _call_took in item.stash:
        cpu, wall = item.stash[_call_took]
        if cpu > UNIT_LIMIT_S or wall > 5 * UNIT_LIMIT_S:
            problems.append(f"its call took {cpu:.2f} s of CPU and {wall:.2f} s of wall clock, over the fast "
                            f"half's {UNIT_LIMIT_S:g} s of CPU and {5 * UNIT_LIMIT_S:g} s of wall clock "
                            f"(CLORCH_UNIT_LIMIT_S)")
    if problems:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is a unit test (tests/unit) but {'; '.join(problems)}. "
                           f"Make it fast, or move it to tests/integration.")
    return report


@pytest.fixture(scope="session")
def ip() -> Iterator[Any]:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    # No spares warmed at load in this process (GPU hosts, CLORCH_SPARES=1): the fast half's tests
    # use this shell and must start no process; tests that want spares ask %clorch start for them.
    given = os.environ.get("CLORCH_SPARES")
    os.environ["CLORCH_SPARES"] = "0"
    try:
        shell.run_line_magic("load_ext", "clorch_repl")
    finally:
        if given is None:
            os.environ.pop("CLORCH_SPARES")
        else:
            os.environ["CLORCH_SPARES"] = given
    yield shell
    from clorch_repl.magics import magics_for

    magics = magics_for(shell)
    if magics is not None:
        magics.shutdown()


@pytest.fixture()
def magics(ip: Any) -> Any:
    from clorch_repl.magics import magics_for

    return magics_for(ip)


@pytest.fixture(scope="module")
def ranks(ip: Any) -> Iterator[Any]:
    """A started 2-rank gloo session for the tests of one module; stopped (and checked) after."""
    from clorch_repl.magics import magics_for
    from clorch_repl.common.procs import wait_gone

    magics = magics_for(ip)
    if magics.session is None or not magics.session.running:
        ip.run_line_magic("clorch", "start --nproc 2")
    yield magics
    pids = magics.session.pids() if magics.session else []
    magics.shutdown()
    assert wait_gone(pids, 10) == []
