"""Whether a rank the relay gave up on had in fact returned from its cell (pure logic).

Why: under an output flood the relay used to give up on ranks whose end of the cell it had not
read yet, and reported them as "blocked in native code" while the stacks it printed showed them
idle in their event loops: the rank had returned, its reply was stuck behind its output. A rank is
called stuck only when the evidence shows it in the cell's code (user or native); one that has
returned is reported as such, its request abandoned (its late output dropped and counted), and it
takes the next cell at once.

The evidence, best first: the rank's own answer over its control channel (``in_cell``, see
``diagnosis.probe.cell_frames``), else its faulthandler stack (the main thread in the event loop's
``select``, no cell frame on it).
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+ in (?P<function>\S+)', re.MULTILINE)
#: The frames a kernel's main thread waits in between cells, innermost first: the selector, then
#: the asyncio loop that tornado (ipykernel's event loop) runs.
_WAIT_FILES = ("selectors.py",)
_LOOP = (("asyncio/base_events.py", "_run_once"), ("asyncio/base_events.py", "run_forever"))
#: A frame of any of these means a request is being handled, whatever else the stack shows.
_HANDLING = ("do_execute", "run_cell", "run_code", "execute_request", "_lean_execute", "_lean_execute_request")


def main_thread_block(dump: str) -> str:
    """The main thread's part of a faulthandler dump: the "Current thread" block (the dump is
    taken by a signal handler, which runs on the main thread), else the first block."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    for block in blocks:
        if block.startswith("Current thread"):
            return block
    return blocks[0] if blocks else ""


def idle_in_event_loop(dump: str) -> bool:
    """Whether a faulthandler stack shows the main thread waiting in the kernel's event loop."""
    frames = [(m["file"], m["function"]) for m in _FRAME.finditer(main_thread_block(dump))]
    if not frames or any(function in _HANDLING for _, function in frames):
        return False
    inner = [f for f in frames if not f[0].endswith(_WAIT_FILES)]  # innermost first
    return bool(inner) and any(inner[0][0].endswith(file) and inner[0][1] == function for file, function in _LOOP)


def returned(answer: dict[str, Any] | None, stack: str | None) -> bool:
    """Whether a rank that the relay was still waiting for is no longer running the cell."""
    if answer is not None and "error" not in answer and "in_cell" in answer:
        return not answer["in_cell"]
    return bool(stack) and idle_in_event_loop(stack or "")


def waits_in_group(answer: dict[str, Any] | None) -> bool:
    """Whether a rank's probe answer shows it waiting inside torch.distributed: a group with a
    collective enqueued and not completed (NCCL: the rank waits where it needs the result), or a
    frame of torch.distributed on its main thread's stack. No answer (native code holding its
    Python lock) is no evidence: the group is then left alone."""
    if not answer or "error" in answer:
        return False
    fr = answer.get("fr") or {}
    for status in (fr.get("pg_status") or {}).values():
        if int(status.get("last_enqueued_collective", -1)) > int(status.get("last_completed_collective", -1)):
            return True
    return any("torch/distributed/" in str(frame.get("file", "")).replace("\\", "/")
               for frame in answer.get("stack") or ())
