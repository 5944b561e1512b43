"""JupyterLab's debugger panel on one rank: the Jupyter debug protocol forwarded to that rank.

A front end that speaks the debug protocol (JupyterLab's debugger) sends ``debug_request`` on the
notebook kernel's control channel; ipykernel answers them with debugpy running in its own
process. With ``%clorch debugger RANK`` the notebook kernel's handler for ``debug_request`` is
replaced by :meth:`DebugForwarder.handle`, which sends each request to that rank's control channel
(the rank is an ipykernel with debugpy too) and returns the rank's ``debug_reply``; the rank's
``debug_event`` messages (a breakpoint hit, a step done) come back through the relay, which reads
the rank's iopub, and are republished on the notebook kernel's iopub.

The one thing to translate is where a cell's code lives. The front end names a cell's source by
hashing the cell's code (``debugInfo`` tells it how: ipykernel's Murmur2 of the code, in the
kernel's temporary folder), and ipykernel compiles a cell under that same name, so breakpoints
set in the editor match the running code. The front end hashes the whole cell, ``%%distributed``
line included; the rank runs only the cell's body, named by the body's hash in the rank's folder,
one line higher. So ``dumpCell`` of a ``%%distributed`` cell is forwarded with the body IPython
will pass to the magic, and every path and line of the rank's cell is translated both ways
(requests: notebook to rank; replies and events: rank to notebook). ``debugInfo`` answers with the
notebook kernel's own folder and seed, so that the front end's own hashes stay right.

The rank's control requests run on the notebook kernel's control thread, on its event loop, with
an asyncio client of their own, so a rank stopped at a breakpoint never blocks the notebook.
"""

from __future__ import annotations

import ast
import copy
import logging
from typing import Any

logger = logging.getLogger(__name__)

#: How long a rank may take to answer one debug request (debugpy's attach is the slowest).
REQUEST_TIMEOUT_S = 30.0


class DebugForwarder:
    """Forwards the notebook kernel's debug_request to one rank (see the module docstring)."""

    def __init__(self, kernel: Any, shell: Any, rank_handle: Any, rank: int) -> None:
        self.kernel = kernel
        self.shell = shell
        self.rank = rank
        self._rank = rank_handle
        self._client: Any = None
        self._original = kernel.control_handlers.get("debug_request")
        #: notebook source path -> (rank source path, lines the rank's copy is shorter at the top)
        self._to_rank_paths: dict[str, tuple[str, int]] = {}
        self._to_notebook_paths: dict[str, tuple[str, int]] = {}

    # ------------------------------------------------------------------------------- lifetime
    @classmethod
    def for_notebook(cls, rank_handle: Any, rank: int) -> "DebugForwarder":
        """A forwarder of this notebook kernel's debug requests to ``rank``, installed."""
        from IPython.core.getipython import get_ipython

        from ..errors import ClorchError

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None or not isinstance(getattr(kernel, "control_handlers", None), dict):
            raise ClorchError("%clorch debugger needs the notebook to run in a Jupyter kernel (ipykernel), "
                              "whose front end speaks the debug protocol (JupyterLab)")
        forwarder = cls(kernel, shell, rank_handle, rank)
        forwarder.install()
        return forwarder

    def install(self) -> None:
        self.kernel.control_handlers["debug_request"] = self.handle

    def uninstall(self) -> None:
        """The notebook kernel answers debug requests itself again."""
        if self.kernel.control_handlers.get("debug_request") == self.handle:
            if self._original is not None:
                self.kernel.control_handlers["debug_request"] = self._original
            else:
                del self.kernel.control_handlers["debug_request"]
        if self._client is not None:
            try:
                self._client.stop_channels()
            except Exception as exc:  # noqa: BLE001 - the rank may be gone already
                logger.debug("closing the debug channel of rank %d: %s", self.rank, exc)
            self._client = None

    # ----------------------------------------------------------------------------- requests
    async def handle(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """The notebook kernel's control handler for ``debug_request`` while this forwarder is on."""
        request = copy.deepcopy(parent.get("content") or {})
        try:
            reply = await self._forward(request)
        except Exception as exc:  # noqa: BLE001 - the front end must get an answer, saying why
            logger.warning("debug request %r for rank %d failed: %s", request.get("command"), self.rank, exc)
            reply = {"type": "response", "request_seq": request.get("seq"), "command": request.get("command"),
                     "success": False, "message": f"rank {self.rank}: {type(exc).__name__}: {exc}"}
        self.kernel.session.send(stream, "debug_reply", reply, parent, ident)

    async def _forward(self, request: dict[str, Any]) -> dict[str, Any]:
        command = request.get("command")
        full_code = None
        if command == "dumpCell":
            full_code = request.get("arguments", {}).get("code", "")
            body = self._body(full_code)
            if body is not None:
                request["arguments"]["code"] = body
            else:
                full_code = None
        elif command == "setBreakpoints":
            self._request_to_rank(request)
        elif command == "source":
            src = request.get("arguments", {}).get("source") or {}
            if src.get("path") in self._to_rank_paths:
                src["path"] = self._to_rank_paths[src["path"]][0]
        reply = await self._ask(request)
        if command == "dumpCell" and full_code is not None and reply.get("success"):
            self._remember(full_code, reply)
        elif command == "debugInfo" and reply.get("success"):
            self._debug_info(reply)
        elif command == "setBreakpoints":
            path = request.get("arguments", {}).get("source", {}).get("path")
            offset = self._to_notebook_paths.get(path, ("", 0))[1]
            for bp in (reply.get("body") or {}).get("breakpoints") or []:
                if "line" in bp and "source" not in bp:  # with a source, to_notebook shifts it
                    bp["line"] += offset
        return self.to_notebook(reply)

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._client is None:
            from jupyter_client.asynchronous import AsyncKernelClient

            # Made here, on the control thread's event loop, which alone uses it.
            self._client = AsyncKernelClient(**self._rank.connection_info(session=True))
            self._client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        msg = self._client.session.msg("debug_request", request)
        self._client.control_channel.send(msg)
        while True:
            reply = await self._client.control_channel.get_msg(timeout=REQUEST_TIMEOUT_S)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    # -------------------------------------------------------------------------- translation
    def _body(self, full_code: str) -> str | None:
        """The code the rank runs for a notebook cell: the body IPython passes to %%distributed."""
        if not full_code.lstrip().startswith("%%distributed"):
            return None
        try:
            tree = ast.parse(self.shell.transform_cell(full_code))
            call = tree.body[0].value  # get_ipython().run_cell_magic('distributed', line, body)
            return ast.literal_eval(call.args[2])
        except (SyntaxError, AttributeError, IndexError, ValueError) as exc:
            logger.warning("could not find the body of a %%%%distributed cell: %s", exc)
            return None

    def _remember(self, full_code: str, reply: dict[str, Any]) -> None:
        from ipykernel.compiler import get_file_name

        rank_path = reply["body"]["sourcePath"]
        notebook_path = get_file_name(full_code)  # what the front end computes from debugInfo
        # the body starts on the line after the magic's
        offset = full_code[:full_code.index("%%distributed")].count("\n") + 1
        self._to_rank_paths[notebook_path] = (rank_path, offset)
        self._to_notebook_paths[rank_path] = (notebook_path, offset)
        reply["body"]["sourcePath"] = notebook_path

    def _debug_info(self, reply: dict[str, Any]) -> None:
        import os

        from ipykernel.compiler import get_tmp_directory, get_tmp_hash_seed

        body = reply.setdefault("body", {})
        body["hashSeed"] = get_tmp_hash_seed()
        body["tmpFilePrefix"] = get_tmp_directory() + os.sep
        for entry in body.get("breakpoints") or []:
            path, offset = self._to_notebook_paths.get(entry.get("source"), (entry.get("source"), 0))
            entry["source"] = path
            for bp in entry.get("breakpoints") or []:
                if "line" in bp:
                    bp["line"] += offset

    def _request_to_rank(self, request: dict[str, Any]) -> None:
        args = request.get("arguments") or {}
        source = args.get("source") or {}
        path = source.get("path")
        if path not in self._to_rank_paths:
            return
        rank_path, offset = self._to_rank_paths[path]
        source["path"] = rank_path
        for bp in args.get("breakpoints") or []:
            if "line" in bp:
                bp["line"] -= offset
        if "lines" in args:
            args["lines"] = [line - offset for line in args["lines"]]

    def to_notebook(self, message: Any) -> Any:
        """Rank paths and lines in a reply or an event, as the front end knows them."""
        if isinstance(message, list):
            return [self.to_notebook(m) for m in message]
        if not isinstance(message, dict):
            return message
        out = {k: self.to_notebook(v) for k, v in message.items()}
        source = message.get("source")
        if isinstance(source, dict) and source.get("path") in self._to_notebook_paths:
            _, offset = self._to_notebook_paths[source["path"]]
            for key in ("line", "endLine"):
                if isinstance(out.get(key), int):
                    out[key] += offset
        if isinstance(out.get("path"), str) and out["path"] in self._to_notebook_paths:
            out["path"] = self._to_notebook_paths[out["path"]][0]
        return out

    # ------------------------------------------------------------------------------- events
    def event(self, rank: int, msg: dict[str, Any]) -> None:
        """A rank's debug_event (read by the relay): republished on the notebook's iopub."""
        if rank != self.rank:
            return
        content = self.to_notebook(msg.get("content") or {})
        self.kernel.session.send(self.kernel.iopub_socket, "debug_event", content,
                                 parent=self.kernel.get_parent("shell"))
