"""A real notebook kernel driven through jupyter_client, as JupyterLab drives one.

Tests use it where the in-process IPython shell cannot stand in: Kernel > Interrupt (SIGINT to the
notebook kernel), SIGKILL of the notebook kernel, and timing a cell as a Jupyter client sees it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Callable, Iterator, Sequence

from jupyter_client import KernelManager

from rank_text import lines_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Reply:
    status: str
    outputs: list[dict[str, Any]] = field(default_factory=list)
    idle_at: float = 0.0  # time.perf_counter() when the kernel reported idle for this request
    #: the input_request prompts the front end was asked, in order (see NotebookKernel.collect)
    prompts: list[str] = field(default_factory=list)
    #: the number the front end shows for the cell (``[12]``), from the execute_reply
    execution_count: int | None = None

    @property
    def text(self) -> str:
        """Everything the cell showed, as text (streams, text/plain of displays, tracebacks)."""
        parts = []
        for msg in self.outputs:
            c = msg["content"]
            if msg["msg_type"] == "stream":
                parts.append(c["text"])
            elif msg["msg_type"] in ("display_data", "execute_result", "update_display_data"):
                parts.append(c["data"].get("text/plain", "") + "\n")
            elif msg["msg_type"] == "error":
                parts.append("\n".join(c["traceback"]) + "\n")
        return "".join(parts)


def cell_text(cell: Any) -> str:
    """Everything an executed notebook cell (nbformat) showed, as text."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "\n".join(parts)


class NotebookKernel:
    """Start a python3 ipykernel (the notebook's own kernel) in the repository's directory."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """``env``: variables to set in the kernel's environment, beside this process's."""
        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {}))
        self.km.start_kernel(env=env, cwd=ROOT)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self._held: list[dict[str, Any]] = []  # read by wait_for_output, not yet by collect
        self._pending: list[str] = []  # cells sent and not yet collected to their idle status
        #: the reply of ``%clorch start`` when the kernel came from :func:`clorch_session`
        self.start_reply: Reply | None = None

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def send(self, code: str, allow_stdin: bool = False) -> str:
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
        self._pending.append(msg_id)
        return msg_id

    def settle(self, timeout: float = 60.0) -> None:
        """Interrupt and read out the cells a test left running (it failed half-way), so that
        what comes next (``%clorch stop``) is not queued behind a cell that never ends."""
        if not self._pending:
            return
        self.km.interrupt_kernel()
        for msg_id in list(self._pending):
            self.collect(msg_id, timeout=timeout)

    def wait_for_output(self, msg_id: str, text: str, count: int = 1, timeout: float = 60.0) -> None:
        """Block until the cell has printed ``text`` ``count`` times (its messages stay for collect)."""
        deadline = time.monotonic() + timeout
        seen = 0
        shown = ""
        while seen < count:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"{text!r} was printed {seen} of {count} time(s) within {timeout} s; the cell "
                                   f"showed:\n{shown}") from None
            self._held.append(msg)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen += msg["content"]["text"].count(text)
                shown += msg["content"]["text"]

    def wait_for_ranks(self, msg_id: str, line: str, ranks: Sequence[int] = (0, 1),
                       timeout: float = 60.0) -> None:
        """Block until every rank of ``ranks`` has printed ``line``, merged (``[ranks 0-1] line``)
        or one label per rank: which of the two a user sees depends on how close together the
        ranks printed it (``display.MERGE_HOLD_S``), which a loaded machine does not promise."""
        deadline = time.monotonic() + timeout
        text = ""
        while any(line not in lines_of(text, r) for r in ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {list(ranks)} did not all print {line!r} within {timeout} s;"
                                   f" the cell showed:\n{text}")
            try:
                msg = self.kc.get_iopub_msg(timeout=remaining)
            except Empty:
                continue
            self._held.append(msg)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                text += msg["content"]["text"]

    def collect(self, msg_id: str, timeout: float = 120.0,
                answers: Sequence[str] | Callable[[str], str | None] | None = None) -> Reply:
        """Read the cell's output up to its idle status. With ``answers``, its input_requests are
        answered on the stdin channel as a front end does (JupyterLab's input box): the next
        string of the list, or what the callable returns for the prompt (None: leave it open);
        every prompt is recorded in ``Reply.prompts``."""
        deadline = time.monotonic() + timeout
        reply = Reply(status="?")
        queue = list(answers) if answers is not None and not callable(answers) else None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no idle status within {timeout} s; got so far:\n{reply.text}\n"
                                   f"prompts: {reply.prompts}")
            if answers is not None:
                self._answer(msg_id, reply, queue if queue is not None else answers)
            try:
                wait = remaining if answers is None else min(remaining, 0.05)
                msg = self._held.pop(0) if self._held else self.kc.get_iopub_msg(timeout=wait)
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "status" and msg["content"]["execution_state"] == "idle":
                reply.idle_at = time.perf_counter()
                break
            if kind in ("stream", "display_data", "execute_result", "update_display_data", "error",
                        "clear_output"):
                reply.outputs.append(msg)
        shell = self.kc.get_shell_msg(timeout=10)
        while shell["parent_header"].get("msg_id") != msg_id:
            shell = self.kc.get_shell_msg(timeout=10)
        reply.status = shell["content"]["status"]
        reply.execution_count = shell["content"].get("execution_count")
        if msg_id in self._pending:
            self._pending.remove(msg_id)
        return reply

    def _answer(self, msg_id: str, reply: Reply, answers: Any) -> None:
        while True:
            try:
                msg = self.kc.get_stdin_msg(timeout=0)
            except Empty:
                return
            assert msg["msg_type"] == "input_request", msg
            assert msg["parent_header"].get("msg_id") == msg_id, "an input_request of another request"
            prompt = msg["content"]["prompt"]
            reply.prompts.append(prompt)
            if isinstance(answers, list):
                if not answers:
                    raise AssertionError(f"an unexpected prompt {prompt!r}; prompts so far: {reply.prompts}")
                value: str | None = answers.pop(0)
            else:
                value = answers(prompt)
            if value is not None:
                self.kc.input(value)

    def run(self, code: str, timeout: float = 120.0,
            answers: Sequence[str] | Callable[[str], str | None] | None = None) -> Reply:
        """Run ``code``; with ``answers`` the cell is sent with allow_stdin=True (see collect)."""
        return self.collect(self.send(code, allow_stdin=answers is not None), timeout, answers)

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)




#: What most tests start: two CPU ranks (gloo), also on a machine with GPUs.
CPU_RANKS = "--nproc 2 --backend gloo"


@contextlib.contextmanager
def clorch_session(start: str = CPU_RANKS, *, stop: bool = True,
                   env: dict[str, str] | None = None) -> Iterator[NotebookKernel]:
    """A notebook kernel with ``%load_ext clorch_repl`` run and ranks started (``%clorch start
    START``, its reply kept as ``start_reply``); afterwards ``%clorch stop`` (asserted to succeed,
    unless ``stop`` is False: tests that kill the notebook, or only need the kernel's own exit to
    end the ranks) and the kernel's shutdown, whatever happened. ``env``: set in the kernel's
    environment (see NotebookKernel)."""
    kernel = NotebookKernel(env)
    try:
        assert kernel.run("%load_ext clorch_repl").status == "ok"
        reply = kernel.run(f"%clorch start {start}")
        assert reply.status == "ok", reply.text
        kernel.start_reply = reply
        yield kernel
        if stop:
            kernel.settle()
            stopped = kernel.run("%clorch stop")
            assert stopped.status == "ok", stopped.text
    finally:
        kernel.shutdown()
