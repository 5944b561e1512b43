"""``clorch-notebook run``, the installed console script, on small notebooks with real ranks:
streamed output, --nproc reaching %clorch start, the failed cell named, and no process left behind
after SIGINT, SIGTERM or a second SIGINT."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import nbformat
import pytest

from clorch_repl.common.procs import wait_gone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "clorch-notebook")
PIDS = ("from clorch_repl.magics import magics_for\n"
        "import os\nprint('PIDS', os.getpid(), *magics_for(get_ipython()).session.pids(), flush=True)")


def notebook(path: str, *sources: str, tags: dict[int, list[str]] | None = None) -> str:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# a user's notebook")]
    for index, source in enumerate(sources):
        cell = nbformat.v4.new_code_cell(source)
        if tags and index in tags:
            cell.metadata["tags"] = tags[index]
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def clean_env() -> dict[str, str]:
    """The environment without the repository on PYTHONPATH (conftest adds it for the ranks): the
    runner and the notebooks must work from the installed package alone."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("CLORCH_NPROC", None)
    return env


RUNS: list["Run"] = []


class Run:
    """The console script in a subprocess; its stdout lines arrive, timestamped, on a queue."""

    def __init__(self, *args: str, cwd: str) -> None:
        RUNS.append(self)
        assert os.path.exists(SCRIPT), f"{SCRIPT} missing: `pip install -e .` installs the console script"
        self.proc = subprocess.Popen([SCRIPT, "run", *args], cwd=cwd, env=clean_env(), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line))

    def wait_line(self, text: str, timeout: float = 120.0) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                at, line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} within {timeout} s; saw:\n{''.join(self.stdout)}") from None
            self.stdout.append(line)
            if text in line:
                return at, line

    def finish(self, timeout: float = 180.0) -> tuple[int, str, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()  # the runner itself hung: fail the test, leave nothing running
                self.proc.wait()
        time.sleep(0.2)
        while not self.lines.empty():
            self.stdout.append(self.lines.get()[1])
        assert self.proc.stderr is not None
        return rc, "".join(self.stdout), self.proc.stderr.read()


def pids_in(text: str) -> list[int]:
    line = next(l for l in text.splitlines() if l.startswith("PIDS") or "] PIDS" in l)
    return [int(p) for p in line.split("PIDS", 1)[1].split()]


@pytest.fixture()
def folder(tmp_path) -> Iterator[str]:
    yield str(tmp_path)
    while RUNS:  # a test that failed half-way: stop its runner the way a user would (Ctrl+C twice)
        proc = RUNS.pop().proc
        for signum in (signal.SIGTERM, signal.SIGTERM):
            if proc.poll() is None:
                proc.send_signal(signum)
                time.sleep(1.0)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_passing_notebook_streams_its_output_and_writes_the_executed_copy(folder: str) -> None:
    path = notebook(os.path.join(folder, "ok.ipynb"),
                    "%load_ext clorch_repl",
                    "%clorch start",  # no --nproc: the runner's --nproc 1 must reach it
                    "%%distributed\nprint(f'rank {rank} of {world_size}')",
                    "import os, time\nprint('cwd', os.getcwd())\nprint('first', flush=True)\ntime.sleep(3)\nprint('second')",
                    PIDS,
                    "%clorch stop")
    out = os.path.join(folder, "out", "done.ipynb")
    os.makedirs(os.path.dirname(out))
    run = Run(path, "--nproc", "1", "--output", out, cwd="/")
    first_at, _ = run.wait_line("first")
    second_at, _ = run.wait_line("second")
    assert second_at - first_at > 1.5  # printed as it came, not at the end of the cell
    rc, stdout, stderr = run.finish()
    assert rc == 0, stderr
    assert "[rank 0] rank 0 of 1" in stdout  # --nproc 1 became %clorch start's default
    assert f"cwd {folder}" in stdout  # the kernel starts in the notebook's folder, as in JupyterLab
    assert "--- cell 3: %%distributed" in stdout and "OK: " in stdout
    executed = nbformat.read(out, as_version=4)
    texts = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert "[rank 0] rank 0 of 1" in texts and "second" in texts
    assert wait_gone(pids_in(stdout), 5) == []


def widget_state(nb: nbformat.NotebookNode) -> dict[str, dict]:
    """The saved widget models, by model id, as JupyterLab reads them when it opens the notebook."""
    saved = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return {model_id: model["state"] for model_id, model in saved.get("state", {}).items()}


def test_the_executed_copy_holds_each_ranks_final_widget_state(folder: str) -> None:
    """tqdm.auto bars made on two ranks are saved in the executed copy at their final values, one
    per rank, so opening it in JupyterLab shows the finished bars; language_info is saved too."""
    path = notebook(os.path.join(folder, "bars.ipynb"),
                    "%load_ext clorch_repl",
                    "%clorch start --nproc 2",
                    "%%distributed\nfrom tqdm.auto import tqdm\n"
                    "for _ in tqdm(range(20), desc=f'bar of rank {rank}'):\n    pass",
                    "%clorch stop")
    run = Run(path, "--timeout", "120", cwd=folder)
    rc, stdout, stderr = run.finish()
    assert rc == 0, stderr
    executed = nbformat.read(os.path.join(folder, "bars.executed.ipynb"), as_version=4)
    assert executed.metadata.get("language_info", {}).get("name") == "python", executed.metadata
    state = widget_state(executed)
    # tqdm's bar is an HBox of [description (HTML), bar (FloatProgress), numbers (HTML)]
    bars = {}
    for model in state.values():
        if model.get("_model_name") != "HBoxModel":
            continue
        label, bar, _numbers = (state[child.removeprefix("IPY_MODEL_")] for child in model["children"])
        text = label["value"].replace("\u2007", " ")  # tqdm's HTML label pads with figure spaces
        bars[text.split(":")[0]] = (bar["_model_name"], bar["value"], bar["max"])
    assert bars == {f"bar of rank {r}": ("FloatProgressModel", 20.0, 20.0) for r in (0, 1)}, state


def test_a_failing_cell_is_named_and_fails_the_run(folder: str) -> None:
    path = notebook(os.path.join(folder, "bad.ipynb"),
                    "%load_ext clorch_repl",
                    "%clorch start --nproc 2",
                    PIDS,
                    "%%distributed\nraise ValueError('expected by the test')",  # tagged: may fail
                    "%%distributed\nif rank == 1:\n    raise RuntimeError(f'broken on rank {rank}')",
                    "print('never reached')",
                    tags={3: ["raises-exception"]})
    run = Run(path, "--timeout", "120", cwd=folder)
    rc, stdout, stderr = run.finish()
    assert rc == 1
    assert "failed at cell 5 (In [5]): %%distributed" in stderr  # index among all cells, and the prompt
    assert "RuntimeError: broken on rank 1" in stderr + stdout
    assert "never reached" not in stdout
    executed = nbformat.read(os.path.join(folder, "bad.executed.ipynb"), as_version=4)
    assert [o.output_type for o in executed.cells[5].outputs if o.output_type == "error"] == ["error"]
    assert wait_gone(pids_in(stdout), 5) == []  # the kernel and both ranks


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)],
                         ids=["sigint", "sigterm", "second-sigint"])
def test_an_interrupted_run_leaves_no_rank_behind(folder: str, signals: tuple[int, ...]) -> None:
    path = notebook(os.path.join(folder, "spin.ipynb"),
                    "%load_ext clorch_repl",
                    "%clorch start --nproc 2",
                    PIDS,
                    "%%distributed\nimport time\nprint(f'spinning on rank {rank}', flush=True)\n"
                    "while True:\n    time.sleep(0.05)",
                    "print('never reached')")
    run = Run(path, cwd=folder)
    _, line = run.wait_line("PIDS")
    pids = pids_in(line)
    assert len(pids) == 3  # the notebook kernel and two ranks
    run.wait_line("spinning on rank")
    run.wait_line("spinning on rank")  # both ranks are in the loop (distinct lines: never merged)
    started = time.monotonic()
    for signum in signals:
        run.proc.send_signal(signum)
        time.sleep(0.5)
    rc, stdout, stderr = run.finish(timeout=90)
    took = time.monotonic() - started
    assert rc == 128 + signals[0], stderr
    assert f"interrupted by {signal.Signals(signals[0]).name} at cell 4" in stderr
    assert "never reached" not in stdout
    assert wait_gone(pids, 1) == [], "a rank or the kernel outlived the runner"
    if len(signals) > 1:
        assert took < 30  # the second signal skips the polite steps
    else:
        assert "KeyboardInterrupt" in stdout + stderr  # the cell was interrupted, as Kernel > Interrupt does


def test_bad_invocations_exit_2_with_a_reason(folder: str) -> None:
    missing = subprocess.run([SCRIPT, "run", os.path.join(folder, "nope.ipynb")], capture_output=True, text=True,
                             env=clean_env(), timeout=60)
    assert missing.returncode == 2 and "no such notebook file" in missing.stderr
    junk = os.path.join(folder, "junk.ipynb")
    with open(junk, "w") as fh:
        fh.write("{not json")
    broken = subprocess.run([SCRIPT, "run", junk], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert broken.returncode == 2 and "is not a readable notebook" in broken.stderr
    zero = subprocess.run([SCRIPT, "run", junk, "--nproc", "0"], capture_output=True, text=True, env=clean_env(),
                          timeout=60)
    assert zero.returncode == 2 and "--nproc: must be at least 1" in zero.stderr


def test_the_old_script_is_a_thin_wrapper(folder: str) -> None:
    path = notebook(os.path.join(folder, "tiny.ipynb"), "print('hello from', 6 * 7)")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "run_notebook.py"), path,
                           "--out", os.path.join(folder, "t.ipynb")], capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hello from 42" in done.stdout and os.path.exists(os.path.join(folder, "t.ipynb"))


def test_a_kernel_that_cannot_start_fails_before_the_first_cell(folder: str) -> None:
    path = notebook(os.path.join(folder, "k.ipynb"), "print('never reached')")
    done = subprocess.run([SCRIPT, "run", path, "--kernel", "no-such-kernel"], capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    assert done.returncode == 1
    assert "failed before the first cell" in done.stderr and "No such kernel named no-such-kernel" in done.stderr
    assert "never reached" not in done.stdout


def test_a_kernel_that_ignores_the_interrupt_is_stopped_within_bounds(folder: str) -> None:
    """The notebook's own kernel ignores SIGINT and sleeps: one SIGTERM still ends the run (the
    interrupt's grace, then the kernel's shutdown), and no rank outlives it."""
    from clorch_repl.tools.notebook_runner import INTERRUPT_GRACE_S, KILL_WAIT_S, SHUTDOWN_WAIT_S

    path = notebook(os.path.join(folder, "stuck.ipynb"),
                    "%load_ext clorch_repl",
                    "%clorch start --nproc 2",
                    PIDS,
                    "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ignoring', flush=True)\n"
                    "time.sleep(600)")
    run = Run(path, cwd=folder)
    pids = pids_in(run.wait_line("PIDS")[1])
    run.wait_line("ignoring")
    started = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc, _stdout, stderr = run.finish(timeout=INTERRUPT_GRACE_S + SHUTDOWN_WAIT_S + KILL_WAIT_S + 60)
    assert rc == 128 + signal.SIGTERM
    assert f"did not end within {INTERRUPT_GRACE_S:g} s of the interrupt" in stderr
    assert "interrupted by SIGTERM at cell 4" in stderr
    assert wait_gone(pids, 1) == []
    print(f"stuck kernel: run ended {time.monotonic() - started:.1f} s after SIGTERM")
