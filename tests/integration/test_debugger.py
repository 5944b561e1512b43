"""JupyterLab's debugger on a rank: the Jupyter debug protocol spoken to a real notebook kernel
through jupyter_client (debug_request on the control channel, debug_event on iopub), as
JupyterLab's debugger panel speaks it, after ``%clorch debugger 1``: initialize, attach,
dumpCell, setBreakpoints, configurationDone; a %%distributed cell stops rank 1 at the breakpoint
(in the front end's own name for the cell's source, the notebook's line numbers); stackTrace,
scopes and variables show the rank's frame and a local's value; continue ends the cell."""

from __future__ import annotations

import itertools
import time
from queue import Empty
from typing import Any, Iterator

import pytest

from rank_text import said
from notebook_kernel import NotebookKernel, clorch_session

pytest.importorskip("debugpy")

_seq = itertools.count(1)


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    # The kernel's shutdown ends the ranks: a test may leave them stopped or debugged.
    with clorch_session(stop=False) as kernel:
        yield kernel


@pytest.fixture(scope="module")
def panel(nb: NotebookKernel) -> Iterator[NotebookKernel]:
    """The debugger panel attached to rank 1, once for the module: ipykernel 7.4 does not answer a
    second initialize after a disconnect (a plain kernel neither), so tests share one attach."""
    reply = nb.run("%clorch debugger 1")
    assert reply.status == "ok", reply.text
    init = debug(nb, "initialize", {"clientID": "test-client", "clientName": "testClient", "adapterID": "",
                                    "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
                                    "supportsVariableType": True, "supportsVariablePaging": True,
                                    "supportsRunInTerminalRequest": True, "locale": "en"})
    assert init["success"], init
    attach = debug(nb, "attach")
    assert attach["success"], attach
    yield nb


def debug(nb: NotebookKernel, command: str, arguments: dict[str, Any] | None = None,
          timeout: float = 30.0) -> dict[str, Any]:
    """One debug_request on the control channel, as JupyterLab sends it; its debug_reply's content."""
    msg = nb.kc.session.msg("debug_request", {"type": "request", "seq": next(_seq), "command": command,
                                              "arguments": arguments or {}})
    nb.kc.control_channel.send(msg)
    deadline = time.monotonic() + timeout
    while True:
        reply = nb.kc.control_channel.get_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["msg_type"] == "debug_reply"
            return reply["content"]


def debug_event(nb: NotebookKernel, event: str, timeout: float = 60.0) -> tuple[dict[str, Any], list[dict]]:
    """Wait on iopub for a debug_event named ``event``; every other message read meanwhile is kept."""
    deadline = time.monotonic() + timeout
    other = []
    while time.monotonic() < deadline:
        try:
            msg = nb.kc.get_iopub_msg(timeout=0.2)
        except Empty:
            continue
        if msg["msg_type"] == "debug_event" and msg["content"].get("event") == event:
            return msg["content"], other
        other.append(msg)
    raise TimeoutError(f"no {event} debug_event within {timeout} s; saw {[m['msg_type'] for m in other]}")


def test_debug_protocol_stops_rank_1_at_a_breakpoint_in_a_distributed_cell(panel: NotebookKernel) -> None:
    nb = panel
    info = debug(nb, "debugInfo")
    assert info["success"] and info["body"]["isStarted"], info
    code = ("%%distributed\ndef shard(n):\n    local = n * 10 + rank\n    return local\n"
            "value = shard(4)\nprint('value', value)\n")
    dumped = debug(nb, "dumpCell", {"code": code})
    assert dumped["success"], dumped
    path = dumped["body"]["sourcePath"]
    # the front end's own name for the cell (debugInfo's folder and hash of the whole cell)
    from ipykernel.compiler import murmur2_x86

    assert path == f"{info['body']['tmpFilePrefix']}{murmur2_x86(code, info['body']['hashSeed'])}.py"
    bps = debug(nb, "setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 4}],
                                       "sourceModified": False})
    assert bps["success"] and [b["line"] for b in bps["body"]["breakpoints"]] == [4], bps
    assert debug(nb, "configurationDone")["success"]

    msg_id = nb.send(code)
    stopped, seen = debug_event(nb, "stopped")
    nb._held.extend(seen)  # the cell's output so far, for collect
    thread = stopped["body"]["threadId"]
    stack = debug(nb, "stackTrace", {"threadId": thread})
    assert stack["success"], stack
    top = stack["body"]["stackFrames"][0]
    assert top["name"] == "shard" and top["line"] == 4 and top["source"]["path"] == path, top
    scopes = debug(nb, "scopes", {"frameId": top["id"]})
    locals_ref = next(s["variablesReference"] for s in scopes["body"]["scopes"] if s["name"] == "Locals")
    variables = {v["name"]: v["value"] for v in debug(nb, "variables", {"variablesReference": locals_ref})["body"]["variables"]}
    assert variables.get("local") == "41" and variables.get("n") == "4", variables  # rank 1's frame
    assert debug(nb, "continue", {"threadId": thread})["success"]
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "ok", reply.text
    assert "[rank 0] value 40" in reply.text and "[rank 1] value 41" in reply.text, reply.text
    assert debug(nb, "setBreakpoints", {"source": {"path": path}, "breakpoints": []})["success"]


def test_clorch_debugger_refuses_a_rank_that_does_not_exist(nb: NotebookKernel) -> None:
    reply = nb.run("%clorch debugger 7")
    assert reply.status == "error"
    assert "rank 7, which does not exist" in reply.text, reply.text


def test_hang_notice_says_a_rank_paused_by_the_debugger_panel_is_held_not_hung(panel: NotebookKernel) -> None:
    nb = panel
    code = ("%%distributed --hang-notice 2\nimport torch.distributed as dist\n"
            "def step():\n    dist.barrier()\n    return rank\nprint('done', step())\n")
    path = debug(nb, "dumpCell", {"code": code})["body"]["sourcePath"]
    assert debug(nb, "setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 4}]})["success"]
    assert debug(nb, "configurationDone")["success"]
    msg_id = nb.send(code)
    stopped, seen = debug_event(nb, "stopped")
    nb._held.extend(seen)
    nb.wait_for_output(msg_id, "clorch: not a hang, waiting for your answer; ", timeout=30)
    assert debug(nb, "continue", {"threadId": stopped["body"]["threadId"]})["success"]
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "ok", reply.text
    notices = said(reply.text, "clorch: ")  # clorch's messages, wrapped at the cell's width: one line each
    assert len(notices) == 1, reply.text
    assert "barrier" in notices[0] and "rank 0 waits in it" in notices[0], notices
    assert "rank 1 never called it and is held in the debugger at Cell In[" in notices[0], notices
    assert "(paused in the debugger panel)" in notices[0], notices
    assert "[rank 0] done 0" in reply.text and "[rank 1] done 1" in reply.text, reply.text


def test_debugger_off_gives_the_panel_back_to_the_notebook_kernel(panel: NotebookKernel) -> None:
    nb = panel  # last in the module: it disconnects the rank's debugger
    assert debug(nb, "disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    off = nb.run("%clorch debugger off")
    assert off.status == "ok", off.text
    after = debug(nb, "debugInfo")  # the notebook kernel answers again, with its own state
    assert after["success"] and not after["body"]["isStarted"], after
    assert after["body"]["tmpFilePrefix"].endswith(f"ipykernel_{nb.pid}/"), after
