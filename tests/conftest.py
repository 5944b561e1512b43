"""Shared fixtures, and the split of the suite into a fast unit half and the integration half.

Fixtures: an IPython shell with clorch_repl loaded, and a running 2-rank gloo session. The shell is
IPython's real InteractiveShell, in this process; the ranks are real ipykernels in real processes
forming a real gloo group. Nothing of clorch_repl is mocked.

The split: every test is marked ``integration`` unless its module (or the test itself) is listed in
``FAST`` below, in which case it is marked ``unit``. So a new test file lands in the integration half
until someone lists it, and never slows the fast half by accident. The fast half is
``bash scripts/test.sh --fast``, i.e. ``pytest --fast`` (which imports only the files FAST names);
``pytest -m unit`` selects the same tests but imports every test file. A listed test is still held
to what the list promises, in every run (the full one included): it fails if its setup or call
starts a process (a Python audit hook sees every ``subprocess``/``os.fork``/``os.posix_spawn``/
``os.exec*``/``os.system`` and multiprocessing's spawn), or if its call takes over ``CLORCH_UNIT_LIMIT_S`` seconds of CPU (2 by
default) or five times that of wall clock; a name in ``FAST`` that no longer exists is a usage
error, so the list cannot rot silently.
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

# The fast half: test modules (paths under tests/) whose every test starts no process: no worker
# kernels, no notebook kernel, no torch.distributed group, no subprocess, no browser, no hosts; and,
# as "file.py::test_name" (a parametrised test named without its [id]), such tests of modules whose
# other tests do start processes.
FAST = frozenset({
    "test_amp.py",
    "test_atomic.py",
    "test_cell_files.py",
    "test_stack_dump.py",
    "test_nanny_protocol.py",
    "test_layout.py",
    "test_launchers.py::test_a_plugin_launcher_is_listed_and_batch_jobs_say_where_they_can_run",
    "test_launchers.py::test_a_launcher_written_before_the_topology_hook_says_so",
    "test_checkpoint_parts.py",
    "test_top.py::test_rows_say_what_each_rank_does",
    "test_profile.py::test_the_verdict_on_recorded_summaries",
    "test_profile.py::test_merged_traces_start_each_rank_at_its_mark",
    "test_profile.py::test_collective_time_is_taken_from_the_trace_on_any_thread",
    "test_data.py",
    "test_procs.py",
    "test_topology.py",
    "test_wire.py",
    "test_lean_wire.py",
    # issue 24: the output budget, and whether a rank given up on had returned
    "test_flood_budget.py",
    "test_logcap.py",
    "test_cell_end.py",
    # issue 25: reports in one glance (merged blocks, one spelling of rank sets)
    "test_report_merge.py",
    "test_kernel_status.py",
    "test_log_displays.py",
    # issue 27: a cell's state machine and the ledger, on recorded message sequences
    "test_cell_run.py",
    "test_relay_loop.py",
    "test_liveness.py",
    # %clorch run's line, init_process_group's agreement, torchrun's variables, export's conversion
    "test_torchrun_units.py",
    # issue 27: requests to ranks as named handlers and JSON data (builder and registry)
    "test_requests.py",
    # checkpoints in one process (the multi-rank and SIGKILL cases start processes)
    "test_checkpoint.py::test_round_trip_single_process",
    "test_checkpoint.py::test_file_mode_follows_the_umask",
    "test_checkpoint.py::test_state_must_be_json",
    "test_checkpoint.py::test_bad_checkpoints_raise_and_change_nothing",
    "test_checkpoint.py::test_checkpoint_of_another_model_is_refused",
    "test_checkpoint.py::test_loading_runs_no_pickled_code",
    "test_dist_collectives.py::test_no_group_is_a_clear_error",
    "test_dist_launch.py::test_bad_input_is_refused_before_any_process_starts",
    "test_dist_launch.py::test_missing_main_is_refused",
    "test_dist_launch.py::test_config_error_is_a_clorch_error",
    "test_errors.py::test_every_error_but_a_failed_cell_is_a_clorch_error",
    "test_errors.py::test_the_api_names_reach_the_same_classes",
    "test_errors.py::test_a_failed_cell_shows_each_rank_once_per_distinct_traceback",
    "test_errors.py::test_cascade_or_cause",
    "test_errors.py::test_a_dead_rank_and_a_stuck_one_are_told_apart",
    # hang analysis of recorded and hand-written rank states (the live hangs start ranks)
    "test_hang_analysis.py::test_a_dead_rank_is_named",
    "test_hang_analysis.py::test_a_full_ring_of_a_healthy_loop_is_no_hang",
    "test_hang_analysis.py::test_a_rank_in_library_code_only_shows_two_frames_not_a_dozen",
    "test_hang_analysis.py::test_nccl_first_barrier_still_connecting_is_pending_not_completed",
    "test_hang_analysis.py::test_nccl_entries_launched_and_done_are_not_pending",
    "test_hang_analysis.py::test_both_recorders_are_read_and_kept_apart",
    "test_hang_analysis.py::test_recorded_nccl_ranks_one_skips_while_the_other_waits_in_item",
    "test_hang_analysis.py::test_recorded_nccl_ranks_with_different_sizes",
    # the magics' refusals and help, before any rank is started
    "test_magic_input.py::test_bad_input_gives_one_clear_line",
    "test_magic_input.py::test_help_works_for_every_command",
    "test_magic_input.py::test_stop_without_ranks_says_so",
    "test_magic_input.py::test_bad_hang_options_give_one_clear_line",
    "test_magic_input.py::test_why_and_hang_notice_have_help",
    # the display's merging of rank output, fed by hand (no ranks)
    "test_merge_output.py::test_labels",
    "test_merge_output.py::test_identical_lines_are_shown_once",
    "test_merge_output.py::test_eight_ranks_one_line",
    "test_merge_output.py::test_different_lines_stay_per_rank",
    "test_merge_output.py::test_partly_identical_output_is_correct_and_in_order_per_rank",
    "test_merge_output.py::test_a_line_only_one_rank_printed_does_not_end_merging",
    "test_merge_output.py::test_a_line_one_rank_printed_first_merges_the_next_one_arriving_later",
    "test_merge_output.py::test_interleaved_arrival_in_odd_chunks",
    "test_merge_output.py::test_stderr_and_stdout_merge_separately",
    "test_merge_output.py::test_no_merge_keeps_every_copy",
    "test_merge_output.py::test_identical_final_value_is_shown_once_and_different_values_per_rank",
    "test_merge_output.py::test_a_line_waits_for_the_other_ranks_only_briefly",
    "test_merge_output.py::test_output_of_a_rank_outside_the_cell_is_shown_unmerged",
    "test_merge_output.py::test_a_line_written_in_pieces_merges_when_whole",
    "test_merge_output.py::test_the_same_unfinished_last_line_is_merged_at_the_cells_end",
    "test_spares.py::test_the_status_line_counts_a_spare_not_yet_forked_as_starting",
    "test_merge_output.py::test_the_rest_of_a_line_already_shown_in_part_stays_that_ranks",
    "test_merge_output.py::test_rich_output_keeps_its_place_in_each_ranks_order",
    "test_merge_output.py::test_progress_lines_stay_per_rank",
    "test_merge_output.py::test_identical_tracebacks_are_shown_once",
    "test_merge_output.py::test_different_tracebacks_stay_per_rank",
    "test_merge_output.py::test_random_interleavings_keep_every_ranks_lines_in_order",
    "test_merge_output.py::test_widget_views_are_shown_in_rank_order_whatever_order_they_come_in",
    "test_notebook_runner.py::test_a_bad_clorch_nproc_is_named_by_start",
    # cpulists, PCI lookups and the variables a rank reads (binding a real process is integration)
    "test_numa.py::test_cpulists_as_the_kernel_writes_them",
    "test_numa.py::test_a_bad_cpulist_is_refused_with_what_was_wrong",
    "test_numa.py::test_format_cpulist_gives_back_the_ranges",
    "test_numa.py::test_bus_ids_of_nvidia_smi_become_sysfs_names",
    "test_numa.py::test_a_real_pci_device_gives_its_node_cores_or_says_it_has_no_node",
    "test_numa.py::test_without_a_gpu_the_cores_are_unknown_and_the_log_says_why",
    "test_numa.py::test_a_gpu_that_does_not_exist_has_no_cores",
    "test_numa.py::test_the_variables_a_rank_reads",
    "test_parallel.py::test_wrapper_needs_a_process_group",
    "test_parallel.py::test_no_sync_and_optimizer_step_work_on_a_plain_model",
    "test_remote_ranks.py::test_a_rank_reads_its_place_from_torchrun_or_slurm",
    "test_remote_ranks.py::test_start_refuses_bad_launcher_options_in_one_line",
    "test_stdin.py::test_a_rank_at_a_prompt_that_did_not_answer_the_probe_is_still_named_held",
    # the file format of %clorch send/get, in this process
    "test_transfer.py::test_unsendable_values_are_named_with_their_place_and_type",
    "test_transfer.py::test_a_value_that_contains_itself_is_refused",
    "test_transfer.py::test_round_trip_keeps_tensors_dicts_and_scalars",
    "test_transfer.py::test_loading_never_runs_code_from_the_file",
    "test_transfer.py::test_a_file_that_changed_since_it_was_announced_is_refused",
    "test_transfer.py::test_too_large_is_refused_before_anything_is_written",
    "test_transfer.py::test_bad_transfer_input_is_one_clear_line_before_any_rank_is_asked",
})

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
                       f"processes belongs to the integration half: take it out of FAST in tests/conftest.py")


sys.addaudithook(_audit)


def _audited_fork_exec(*args: Any, **kwargs: Any) -> Any:
    """``_posixsubprocess.fork_exec``, announced first: multiprocessing's spawn and forkserver start
    methods call it directly, without an audit event of their own. Not a mock: it calls through."""
    sys.audit("_posixsubprocess.fork_exec", args[:1])
    return _fork_exec(*args, **kwargs)


_fork_exec = _posixsubprocess.fork_exec
_posixsubprocess.fork_exec = _audited_fork_exec


def _fast_key(item: pytest.Item) -> tuple[str, str]:
    """(path under tests/, test name without parameters) of a collected test."""
    rel = os.path.relpath(str(item.path), HERE).replace(os.sep, "/")
    name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    return rel, name


def _is_fast(item: pytest.Item) -> bool:
    rel, name = _fast_key(item)
    return rel in FAST or f"{rel}::{name}" in FAST


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="run only the fast unit half (-m unit), collecting only the files FAST names "
                          "(tests/conftest.py)")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a FAST entry that names no file (a renamed module would leave the fast half quietly);
    with --fast, select the unit tests."""
    missing = sorted(e for e in FAST if not os.path.isfile(os.path.join(HERE, e.split("::", 1)[0])))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py FAST names files that do not exist: {missing}; "
                                f"fix the list (the fast half is the tests it names)")
    if config.getoption("fast"):
        expr = config.option.markexpr
        config.option.markexpr = f"unit and ({expr})" if expr else "unit"


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """With --fast, skip importing the test files (and folders) that hold no unit test."""
    if not config.getoption("fast"):
        return None
    path = os.path.abspath(str(collection_path))
    if path == HERE or not path.startswith(HERE + os.sep):
        return None
    rel = os.path.relpath(path, HERE).replace(os.sep, "/")
    files = {e.split("::", 1)[0] for e in FAST}
    if os.path.isdir(path):
        return None if any(f.startswith(rel + "/") for f in files) else True
    name = os.path.basename(path)
    if name.startswith("test_") and name.endswith(".py"):
        return None if rel in files else True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test ``unit`` or ``integration`` (tryfirst: before ``-m`` selects on the marks);
    refuse a FAST test name that its collected module does not have."""
    for item in items:
        item.add_marker(pytest.mark.unit if _is_fast(item) else pytest.mark.integration)
    # a name is stale when its module, collected in this run, has no such test function (a run of
    # one test id leaves the module's other listed tests uncollected, not stale)
    modules = {_fast_key(i)[0]: i.module for i in items if isinstance(i, pytest.Function)}
    named = [e.split("::", 1) for e in FAST if "::" in e]
    stale = sorted(f"{rel}::{name}" for rel, name in named if rel in modules and not hasattr(modules[rel], name))
    if stale:
        raise pytest.UsageError(f"tests/conftest.py FAST names tests that do not exist: {stale}; "
                                f"fix the list (a renamed test goes to the integration half until it is)")


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
        report.longrepr = (f"{item.nodeid} is listed in FAST (tests/conftest.py) but {'; '.join(problems)}. "
                           f"Make it fast, or take it out of FAST so it runs with the integration tests.")
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
    from clorch_repl.procs import wait_gone

    magics = magics_for(ip)
    if magics.session is None or not magics.session.running:
        ip.run_line_magic("clorch", "start --nproc 2")
    yield magics
    pids = magics.session.pids() if magics.session else []
    magics.shutdown()
    assert wait_gone(pids, 10) == []
