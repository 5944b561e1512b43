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


def held_at_prompt(state: RankEvidence, *, many: bool = False) -> str:
    """A rank waiting for the user at a prompt: in the debugger (pdb's frames on its stack) or in
    input(), and where. ``many``: said of several ranks whose phrase is the same (see :func:`where`)."""
    stack = ((state.answer or {}).get("stack") or []) if state.answered else []
    files = [str(f.get("file", "")) for f in stack]
    if not state.answered:  # its faulthandler stack, when it had no time to answer
        files = re.findall(r'File "([^"]+)"', state.fallback_stack or "")
    in_pdb = any(os.path.basename(f) in ("bdb.py", "pdb.py") for f in files)
    what = f"{_is(many)} held in the debugger" if in_pdb or state.paused else f"{_is(many)} waiting for input"
    user = [f for f in stack if not f.get("library")]
    at = f" at {frame_label(user[-1])}" if user else ""  # (a faulthandler stack's innermost line is the wait)
    if state.prompt is None:
        return f"{what}{at} (paused in the debugger panel)"
    if many:
        return f"{what}{at} (their prompts {state.prompt!r} wait for your answers in the notebook)"
    return f"{what}{at} (its prompt {state.prompt!r} waits for your answer in the notebook)"


def where(state: RankEvidence, *, many: bool = False) -> str:
    """Where a rank is, as the notebook names lines: ``Cell In[5], line 3 in <module>``.

    ``many``: the same phrase said of several ranks at once (``ranks 0-2 are not running a
    cell``), its verbs and pronouns plural; the verdicts name ranks whose phrase is the same
    together (:func:`clorch_repl.common.rank_sets.merge_blocks`), so the one rank that differs
    is not buried in a list of copies. Written here in both numbers rather than turned plural
    afterwards: a rewrite of the text would also touch a prompt's or a function's own words."""
    if state.dead is not None:
        return f"died ({state.dead})"
    if state.prompt is not None or state.paused:
        return held_at_prompt(state, many=many)
    if not state.answered:
        why = (state.answer or {}).get("error")
        lock = "their Python locks" if many else "its Python lock"
        line = _fallback_line(state.fallback_stack)
        if not why and _idle_in_loop(state.fallback_stack, line):
            return (f"did not answer in time, though {'their stacks show them' if many else 'its stack shows it'} "
                    "idle, waiting for a request (not running a cell): a busy host, not a held Python lock")
        head = "did not answer" + (f" ({why})" if why else f" (native code is holding {lock})")
        return head + (f"; {'they are' if many else 'it is'} at {line}" if line else "")
    ans = state.answer
    stack = ans.get("stack") or []
    if not ans.get("in_cell"):
        return f"{_is(many)} not running a cell"
    user = [f for f in stack if not f.get("library")]
    if reporting_error(stack):
        return f"{'have' if many else 'has'} raised an error in {'their cells' if many else 'its cell'} " \
               f"(IPython is writing {'their tracebacks' if many else 'its traceback'})"
    if not user:
        # Only library frames under run_code: a library's callback IPython runs, for example.
        inner = f" ({frame_label(stack[-1])})" if stack else ""
        cells = "their cells'" if many else "its cell's"
        return f"{_is(many)} in library code outside {cells} lines{inner}"
    text = f"{_is(many)} at " + frame_label(user[-1])
    if stack and stack[-1].get("library") and user and not own_frame(stack[-1]):
        inner = stack[-1]
        text += f", inside {inner['function']}() ({_short(inner['file'])}:{inner['line']})"
    if ans.get("cuda_busy"):
        text += f", with {'their CUDA streams' if many else 'its CUDA stream'} still busy"
    return text


def _is(many: bool) -> str:
    """The verb of :func:`where`'s phrases, for one rank or several."""
    return "are" if many else "is"


def own_frame(frame: dict[str, Any]) -> bool:
    """A frame of clorch_repl's own code (its output stream under a user's print, the probe that
    answers this very question, a watcher thread): never where the user's code is; a report that
    named ``clorch_repl/kernel/output.py:98 in _echo()`` as where a flooding rank was sent its
    reader into clorch. The one test every view of a stack uses (the main thread's, every
    thread's): the rank marks the frame whose code file lies inside its clorch_repl package
    (:func:`clorch_repl.diagnosis.probe.is_own`), as only the rank knows where that is."""
    return bool(frame.get("own"))


#: IPython's functions that write a failed cell's traceback (``InteractiveShell``'s)
_REPORTING = frozenset({"showtraceback", "_showtraceback", "showsyntaxerror", "showindentationerror"})


def reporting_error(stack: list[dict[str, Any]]) -> bool:
    """Whether a stack (from IPython's call of the cell inwards) is IPython writing the cell's
    traceback: the cell's code has raised and is off the stack. A survivor of a dead peer is
    often found there when asked; its frames (IPython, pygments, stack_data) said "in library code
    outside its cell's lines", as if the rank were somewhere unknown, while its own traceback,
    shown below the verdict, says where its cell failed."""
    return bool(stack) and stack[0].get("function") in _REPORTING \
        and str(stack[0].get("file", "")).endswith("interactiveshell.py")


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


def _idle_in_loop(stack: str | None, innermost: str | None) -> bool:
    """Whether a faulthandler stack is a kernel's between requests: no cell's frame, and its
    innermost call its event loop's wait (``selectors.py ... in select()``). Such a rank's probe
    went unanswered only because its control thread got no core in time (a try-out on a loaded
    2-core box), never because native code held its Python lock: ``select`` releases it."""
    line = innermost or ""
    return bool(stack) and "Cell In[" not in str(stack) and "selectors.py" in line and "select()" in line


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
