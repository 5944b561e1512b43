"""``clorch-notebook run NB.ipynb``: execute a notebook headless in a real kernel, as a test would.

Scripted notebook runs are how users test their distributed code, so the runner ships with the
package (a console script) rather than living in the repository:

    clorch-notebook run notebooks/quickstart.ipynb --nproc 2 --timeout 600 --output done.ipynb

* The notebook runs through nbclient in a real ipykernel started in the notebook's own folder, as
  JupyterLab starts it (``--cwd`` says otherwise), so a notebook that passes here passes there.
* Each cell's output is printed as it arrives (streams, the text of displays, tracebacks), so a
  long training cell shows its progress instead of a silent wait.
* ``--nproc N`` reaches ``%clorch start`` without editing the notebook: the kernel gets
  ``CLORCH_NPROC=N``, which ``%clorch start`` takes as its default ``--nproc``.
* The executed copy is written to ``--output`` (default: ``NB.executed.ipynb`` beside the
  notebook), also when a cell failed or the run was interrupted, so a person can look. It holds
  every widget's last state (the ranks' tqdm bars: JupyterLab shows them as they ended) and the
  kernel's ``language_info``, as nbclient's own runs save them.
* Exit status: 0 when every cell ran; 1 when a cell failed or timed out (the message names the
  cell by its index and first line); 2 for a bad invocation; 130/143 when interrupted by
  SIGINT/SIGTERM. Cells tagged ``raises-exception`` may fail, as in nbclient and JupyterLab.
* No rank is ever left behind. At the end, and on SIGINT/SIGTERM, the running cell is interrupted
  (the ranks get the interrupt through clorch), the kernel is asked to shut down so that its
  atexit handler stops the ranks, and whatever the kernel started that still runs after that is
  ended by pid (the kernel's process group and every descendant seen while it ran). A second
  signal skips the polite steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, TextIO

import nbformat
import psutil
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from nbclient.util import ensure_async

from ..common.topology import NPROC_ENV

logger = logging.getLogger(__name__)

INTERRUPT_GRACE_S = 20.0  # how long an interrupted cell may take to end before the kernel is shut down
SHUTDOWN_WAIT_S = 20.0  # the kernel's atexit stops its ranks (all at once, one 5 s grace) before it exits
KILL_WAIT_S = 10.0
EXIT_FAILED, EXIT_USAGE = 1, 2
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class UsageProblem(Exception):
    """A bad invocation: the message says what to change."""


@dataclass
class Outcome:
    """How a run ended: ``status`` is the exit status, ``message`` the line that says why."""

    status: int
    message: str
    failed_cell: int | None = None


def say(stream: TextIO, text: str) -> None:
    """Write and flush, never raising: a reader that went away (a closed pipe) must not stop the
    run halfway or keep it from shutting the kernel down."""
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError) as exc:  # BrokenPipeError, or a closed file
        logger.debug("output dropped (%s): %r", exc, text[:200])


def first_line(cell: Any) -> str:
    """The first non-empty line of a cell's source, for naming the cell in a message."""
    for line in str(cell.get("source", "")).splitlines():
        if line.strip():
            return line.strip()[:100]
    return "<empty cell>"


def describe_cell(nb: Any, index: int) -> str:
    """``cell 13 (In [7]): %%distributed`` - the index counts every cell from 0, as nbformat does."""
    cell = nb.cells[index]
    count = cell.get("execution_count")
    prompt = f" (In [{count}])" if count else ""
    return f"cell {index}{prompt}: {first_line(cell)}"


class StreamingClient(NotebookClient):
    """nbclient's client, printing each output as the kernel sends it."""

    def __init__(self, nb: Any, *, out: TextIO, err: TextIO, color: bool, **kw: Any) -> None:
        super().__init__(nb, **kw)
        self._out, self._err, self._color = out, err, color
        self.current_index: int | None = None
        self.on_cell_execute = self._announce

    def _announce(self, cell: Any, cell_index: int) -> None:
        self.current_index = cell_index
        say(self._out, f"\n--- cell {cell_index}: {first_line(cell)}\n")

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        if msg["msg_type"] == "update_display_data":
            self._echo(msg)  # e.g. "ranks ready 1/2": the terminal shows each update as a new line
        return super().process_message(msg, cell, cell_index)

    def output(self, outs: list[Any], msg: dict[str, Any], display_id: str | None, cell_index: int) -> Any:
        self._echo(msg)
        return super().output(outs, msg, display_id, cell_index)

    def _echo(self, msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            stream = self._err if content.get("name") == "stderr" else self._out
            say(stream, self._plain(content.get("text", "")))
        elif kind in ("display_data", "execute_result", "update_display_data"):
            data = content.get("data", {})
            if data.get("text/plain") == "" and set(data) == {"text/plain"}:
                return  # an empty slot (a rank's widget view fills it in place): nothing to show yet
            text = data.get("text/plain") or f"<{', '.join(sorted(data)) or 'empty'} output>"
            say(self._out, self._plain(text).rstrip("\n") + "\n")
        elif kind == "error":
            say(self._err, self._plain("\n".join(content.get("traceback", []))) + "\n")

    def _plain(self, text: str) -> str:
        return text if self._color else ANSI.sub("", text)


class NotebookRun:
    """One headless run of one notebook; :meth:`run` returns the exit status."""

    def __init__(self, path: str, *, nproc: int | None = None, timeout_s: float | None = 600.0,
                 output: str | None = None, cwd: str | None = None, kernel_name: str | None = None,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.given = path  # as the user wrote it, for messages
        self.path = os.path.abspath(path)
        self.nproc = nproc
        self.timeout_s = timeout_s
        self.output = os.path.abspath(output) if output else re.sub(r"(\.ipynb)?$", ".executed.ipynb",
                                                                     self.path, count=1)
        self.cwd = os.path.abspath(cwd) if cwd else os.path.dirname(self.path)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.nb = self._read()
        self.kernel_name = kernel_name or self.nb.metadata.get("kernelspec", {}).get("name") or "python3"
        self.signals: list[int] = []
        self._work: asyncio.Future[Outcome] | None = None
        self._stopping = False
        self._in_cell = False
        self._kernel_busy = False  # a cell was sent and its reply has not come (timeout, cancel)
        self._km: AsyncKernelManager | None = None
        self._seen: dict[int, psutil.Process] = {}  # everything the kernel started, by pid

    def _read(self) -> Any:
        if not os.path.isfile(self.path):
            raise UsageProblem(f"{self.path}: no such notebook file")
        try:
            nb = nbformat.read(self.path, as_version=4)
        except Exception as exc:  # nbformat raises JSON, validation and IO errors alike
            raise UsageProblem(f"{self.path} is not a readable notebook: {type(exc).__name__}: {exc}") from None
        if not os.path.isdir(self.cwd):
            raise UsageProblem(f"--cwd {self.cwd}: no such directory")
        return nb

    def run(self) -> int:
        """Execute every cell, write the executed copy, make sure nothing the kernel started runs."""
        started = time.monotonic()
        outcome = asyncio.run(self._run())
        # The kernel and its ranks are stopped: a signal now (a second Ctrl-C a user sends while
        # the stop they asked for ends) has nothing left to stop, and must not cut the executed
        # copy's writing or turn the run's exit status into a death by signal.
        late = {signum: signal.signal(signum, self._signal_after_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._finish(outcome, started)
        finally:
            for signum, handler in late.items():
                signal.signal(signum, handler)

    def _signal_after_stop(self, signum: int, _frame: Any) -> None:
        self.signals.append(signum)
        logger.debug("%s after the stop: nothing left to stop", signal.Signals(signum).name)

    def _finish(self, outcome: Outcome, started: float) -> int:
        """Write the executed copy and say the verdict; the run's exit status."""
        try:
            nbformat.write(self.nb, self.output)
            where = f"executed copy: {self.output}"
        except OSError as exc:
            where = f"could not write the executed copy to {self.output}: {exc}"
            outcome = Outcome(outcome.status or EXIT_FAILED, outcome.message, outcome.failed_cell)
        verdict = "OK" if outcome.status == 0 else "FAILED"
        say(self.out, f"\n{verdict}: {self.given} in {time.monotonic() - started:.1f} s; {where}\n")
        if outcome.status:
            say(self.err, outcome.message + "\n")
        return outcome.status

    # -- the run ---------------------------------------------------------------------------------

    async def _run(self) -> Outcome:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        env = dict(os.environ)
        if self.nproc is not None:
            env[NPROC_ENV] = str(self.nproc)
        # IPC sockets in a private folder, as the ranks use: nothing listens on a port
        private = tempfile.mkdtemp(prefix="clorch-notebook-")
        os.chmod(private, 0o700)
        km = self._km = AsyncKernelManager(kernel_name=self.kernel_name, transport="ipc",
                                           ip=os.path.join(private, "kernel"))
        km.connection_file = os.path.join(private, "kernel.json")
        km.shutdown_wait_time = SHUTDOWN_WAIT_S
        client = StreamingClient(self.nb, km=km, timeout=self.timeout_s, kernel_name=self.kernel_name,
                                 out=self.out, err=self.err, color=self.out.isatty())
        # The work runs in a task of its own: a signal cancels that task, never this coroutine,
        # so the shutdown below always runs to its end.
        self._work = asyncio.ensure_future(self._start_and_execute(km, client, env))
        try:
            return await self._work
        except asyncio.CancelledError:
            return self._interrupted(client)
        except DeadKernelError:
            if self.signals:
                return self._interrupted(client)
            return self._failed(client, "the notebook's kernel died")
        except Exception as exc:  # e.g. NoSuchKernel, a kernel that never answered: say so, clean up
            logger.debug("run failed", exc_info=True)
            return self._failed(client, f"{type(exc).__name__}: {exc}")
        finally:
            self._stopping = True
            self._save_widgets(client)
            await self._shutdown(km, client)
            shutil.rmtree(private, ignore_errors=True)
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    def _save_widgets(self, client: StreamingClient) -> None:
        """Save every widget's last state (the ranks' tqdm bars among them) in the notebook's
        metadata, as nbclient's own ``async_execute`` does after its last cell: opening the
        executed copy in JupyterLab then shows the bars as they ended. Also after a failed or
        interrupted run, where the bars show how far it got. Never raises: the shutdown after it
        must run, and a copy without widgets still has every output."""
        try:
            client.set_widgets_metadata()
        except Exception as exc:  # a widget state nbclient cannot serialize: keep the rest of the copy
            logger.warning("widget state not saved in the executed copy: %s: %s", type(exc).__name__, exc)
            say(self.err, f"clorch-notebook: could not save the widgets' state in the executed copy "
                          f"({type(exc).__name__}: {exc}); the outputs are saved\n")

    async def _start_and_execute(self, km: AsyncKernelManager, client: StreamingClient,
                                 env: dict[str, str]) -> Outcome:
        await km.start_kernel(cwd=self.cwd, env=env)
        watcher = asyncio.ensure_future(self._watch(self._kernel_pid(km)))
        try:
            await client.async_start_new_kernel_client()
            await self._save_language_info(client)
            return await self._cells(client)
        finally:
            watcher.cancel()

    async def _save_language_info(self, client: StreamingClient) -> None:
        """Ask the kernel what language it runs and save that in the notebook's metadata, as
        nbclient's own ``async_execute`` does (we run the cells ourselves, so it is not called):
        front ends read ``language_info`` for highlighting and the file extension on export."""
        assert client.kc is not None
        msg_id = await ensure_async(client.kc.kernel_info())
        reply = await client.async_wait_for_reply(msg_id)
        if reply is None:  # nbclient skips it too (a kernel silent past --timeout raises CellTimeoutError)
            logger.warning("the kernel sent no kernel_info reply; the executed copy has no language_info")
            return
        if "language_info" not in reply["content"]:
            raise RuntimeError(f"the kernel's kernel_info reply has no language_info (it is not a Jupyter "
                               f"kernel nbclient can run); its content: {reply['content']}")
        self.nb.metadata["language_info"] = reply["content"]["language_info"]

    async def _cells(self, client: StreamingClient) -> Outcome:
        for index, cell in enumerate(self.nb.cells):
            if self.signals:
                return self._interrupted(client)
            self._in_cell = self._kernel_busy = True
            try:
                await client.async_execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                self._kernel_busy = False
            except CellTimeoutError:
                return self._failed(client, f"no reply within --timeout {self.timeout_s:g} s")
            except CellExecutionError as exc:
                self._kernel_busy = False
                if self.signals:
                    return self._interrupted(client)
                return self._failed(client, self._error_line(exc))
            finally:
                self._in_cell = False
        if self.signals:
            return self._interrupted(client)
        return Outcome(0, "")

    @staticmethod
    def _error_line(exc: CellExecutionError) -> str:
        name, value = getattr(exc, "ename", ""), getattr(exc, "evalue", "")
        return f"{name}: {ANSI.sub('', str(value))}" if name else ANSI.sub("", str(exc)).strip().splitlines()[-1]

    def _failed(self, client: StreamingClient, why: str) -> Outcome:
        index = client.current_index
        where = f"at {describe_cell(self.nb, index)}" if index is not None else "before the first cell"
        return Outcome(EXIT_FAILED, f"clorch-notebook: {self.given} failed {where}\n  {why}",
                       index)

    def _interrupted(self, client: StreamingClient) -> Outcome:
        signum = self.signals[0] if self.signals else signal.SIGINT
        index = client.current_index
        where = f" at {describe_cell(self.nb, index)}" if index is not None else ""
        return Outcome(128 + signum, f"clorch-notebook: {self.given} interrupted by "
                                     f"{signal.Signals(signum).name}{where}; the kernel and its ranks were stopped",
                       index)

    def _on_signal(self, signum: int) -> None:
        """First signal: interrupt the running cell, as Kernel > Interrupt does, and stop after it
        (cancelling if it does not end within INTERRUPT_GRACE_S); second signal: stop now (kill
        the kernel; what it started is ended by pid afterwards)."""
        self.signals.append(signum)
        if self._stopping or len(self.signals) > 1:
            if self._work is not None:
                self._work.cancel()
            if self._stopping or not self._in_cell:
                asyncio.ensure_future(self._kill_kernel())
            return
        if not self._in_cell:
            if self._work is not None:
                self._work.cancel()
            return
        asyncio.ensure_future(self._interrupt_then_cancel())
        say(self.err, f"\nclorch-notebook: {signal.Signals(signum).name}: interrupting the running cell, then "
                      "stopping the kernel and its ranks (signal again to stop at once)\n")

    async def _interrupt_then_cancel(self) -> None:
        try:
            if self._km is not None:
                await self._km.interrupt_kernel()
        except Exception as exc:  # the kernel may be gone already; shutdown handles what is left
            logger.warning("could not interrupt the kernel: %s", exc)
        await asyncio.sleep(INTERRUPT_GRACE_S)
        if self._in_cell and self._work is not None and not self._stopping:
            say(self.err, f"clorch-notebook: the cell did not end within {INTERRUPT_GRACE_S:g} s of the interrupt; "
                          "stopping the kernel\n")
            self._work.cancel()

    async def _kill_kernel(self) -> None:
        """SIGKILL the kernel's process group (jupyter_client starts it as a session leader)."""
        try:
            if self._km is not None and self._km.has_kernel:
                await self._km.provisioner.kill()
        except Exception as exc:  # already gone; leftovers are ended by pid afterwards
            logger.warning("could not kill the kernel: %s", exc)

    # -- processes -------------------------------------------------------------------------------

    @staticmethod
    def _kernel_pid(km: AsyncKernelManager) -> int | None:
        process = getattr(km.provisioner, "process", None)
        return getattr(process, "pid", None)

    async def _watch(self, pid: int | None) -> None:
        """Remember every process the kernel starts (ranks run in sessions of their own, so the
        kernel's process group does not hold them): what still runs after the kernel is gone is
        ended by pid. psutil.Process objects refuse to signal a pid that was reused."""
        if pid is None:
            return
        while True:
            self._remember(pid)
            await asyncio.sleep(0.5)

    def _remember(self, pid: int) -> None:
        """Add what runs below ``pid`` now; forget what has ended since (a long notebook starts
        and ends many processes). What still runs elsewhere (a rank orphaned by the kernel's
        death) is kept: that is what :meth:`_end_leftovers` is for."""
        self._seen = {p: proc for p, proc in self._seen.items() if _running(proc)}
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                self._seen.setdefault(proc.pid, proc)
        except psutil.Error:
            return

    async def _shutdown(self, km: AsyncKernelManager, client: StreamingClient) -> None:
        pid = self._kernel_pid(km)
        if pid is not None:
            self._remember(pid)
        try:
            if km.has_kernel:
                now = len(self.signals) > 1
                if self._kernel_busy and not now:
                    await km.interrupt_kernel()  # a cell may still run: let clorch interrupt its ranks
                    await asyncio.sleep(1.0)
                await asyncio.wait_for(km.shutdown_kernel(now=now), SHUTDOWN_WAIT_S + KILL_WAIT_S)
        except Exception as exc:  # shutting down a kernel that died: end what is left below
            logger.warning("kernel shutdown: %s: %s", type(exc).__name__, exc)
        finally:
            if client.kc is not None:
                client.kc.stop_channels()
            await self._end_leftovers()
            try:
                await km.cleanup_resources()
            except Exception as exc:  # connection files of a killed kernel: nothing else to do
                logger.warning("kernel cleanup: %s", exc)

    async def _end_leftovers(self) -> None:
        alive = [p for p in self._seen.values() if _running(p)]
        loop = asyncio.get_running_loop()
        if alive:  # ranks of a killed kernel notice within a second that their parent is gone
            _, alive = await loop.run_in_executor(None, lambda: psutil.wait_procs(alive, timeout=3.0))
        if not alive:
            return
        names = ", ".join(str(p.pid) for p in alive)
        say(self.err, f"clorch-notebook: ending {len(alive)} process(es) the kernel left running: {names}\n")
        for proc in alive:
            try:
                proc.terminate()
            except psutil.Error:
                continue
        _, still = await loop.run_in_executor(None, lambda: psutil.wait_procs(alive, timeout=5.0))
        for proc in still:
            try:
                proc.kill()
            except psutil.Error:
                continue
        await loop.run_in_executor(None, lambda: psutil.wait_procs(still, timeout=KILL_WAIT_S))


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
