"""Where a rank is, in the words the notebook uses for lines (``Cell In[5], line 3 in <module>``):
from its probe answer, its faulthandler stack when it could not answer, or its prompt.

Pure: a :class:`~.entries.RankEvidence` in, one phrase out (``is at ...``, ``died (...)``,
``is waiting for input ...``); :mod:`.analyse` builds its verdicts from these phrases and
:mod:`.render` its evidence.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .entries import RankEvidence

logger = logging.getLogger(__name__)


def held_at_prompt(state: RankEvidence) -> str:
    """A rank waiting for the user at a prompt: in the debugger (pdb's frames on its stack) or in
    input(), and where."""
    stack = ((state.answer or {}).get("stack") or []) if state.answered else []
    files = [str(f.get("file", "")) for f in stack]
    if not state.answered:  # its faulthandler stack, when it had no time to answer
        files = re.findall(r'File "([^"]+)"', state.fallback_stack or "")
    in_pdb = any(os.path.basename(f) in ("bdb.py", "pdb.py") for f in files)
    what = "is held in the debugger" if in_pdb or state.paused else "is waiting for input"
    user = [f for f in stack if not f.get("library")]
    at = f" at {frame_label(user[-1])}" if user else ""  # (a faulthandler stack's innermost line is the wait)
    if state.prompt is None:
        return f"{what}{at} (paused in the debugger panel)"
    return f"{what}{at} (its prompt {state.prompt!r} waits for your answer in the notebook)"


def where(state: RankEvidence) -> str:
    """Where a rank is, as the notebook names lines: ``Cell In[5], line 3 in <module>``."""
    if state.dead is not None:
        return f"died ({state.dead})"
    if state.prompt is not None or state.paused:
        return held_at_prompt(state)
    if not state.answered:
        why = (state.answer or {}).get("error")
        head = "did not answer" + (f" ({why})" if why else " (native code is holding its Python lock)")
        line = _fallback_line(state.fallback_stack)
        return head + (f"; it is at {line}" if line else "")
    ans = state.answer
    stack = ans.get("stack") or []
    if not ans.get("in_cell"):
        return "is not running a cell"
    user = [f for f in stack if not f.get("library")]
    if not user:
        # Only library frames under run_code: IPython showing the cell's traceback, for example.
        inner = f" ({frame_label(stack[-1])})" if stack else ""
        return f"is in library code outside its cell's lines{inner}"
    text = "is at " + frame_label(user[-1])
    if stack and stack[-1].get("library") and user and not own_frame(stack[-1]):
        inner = stack[-1]
        text += f", inside {inner['function']}() ({_short(inner['file'])}:{inner['line']})"
    if ans.get("cuda_busy"):
        text += ", with its CUDA stream still busy"
    return text


def own_frame(frame: dict[str, Any]) -> bool:
    """A frame of the rank kernel's own machinery (its output stream under a user's print): never
    where the user's code is; a report that named ``clorch_repl/kernel/output.py:98 in _echo()``
    as where a flooding rank was sent its reader into clorch."""
    return (os.sep + os.path.join("clorch_repl", "kernel") + os.sep) in str(frame.get("file", ""))


def frame_label(frame: dict[str, Any]) -> str:
    func = frame.get("function", "?")
    func = func if func.startswith("<") else f"{func}()"
    if frame.get("cell"):
        return f"{frame['cell']}, line {frame['line']} in {func}"
    return f"{_short(frame['file'])}:{frame['line']} in {func}"


def _short(path: str) -> str:
    """A path as short as still recognisable: from the package root, else relative to the cwd."""
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


#: a faulthandler frame: ``File "/path/x.py", line 3 in step`` (the notebook has named cells'
#: files ``Cell In[12]`` by then: clorch_repl.session.cell_files)
_FAULTHANDLER_FRAME = re.compile(r'File "(.+)", line (\d+) in (.+)$')


def _fallback_line(stack: str | None) -> str | None:
    """The innermost line of a faulthandler stack (most recent call first), named as
    :func:`frame_label` names a frame."""
    for line in (stack or "").splitlines():
        line = line.strip()
        if line.startswith("File "):
            match = _FAULTHANDLER_FRAME.match(line)
            if match is None:
                return line
            path, number, function = match.groups()
            cell = path if path.startswith("Cell In[") else None
            return frame_label({"file": path, "line": number, "function": function, "cell": cell})
    return None
