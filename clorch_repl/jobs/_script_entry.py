"""A script job's rank (``launch(script=...)`` / ``module=``): the script run as torchrun's worker
runs it, ``python SCRIPT ARGS``, inside the rank's already formed process group.

What the script finds is what ``%clorch run`` gives it (:mod:`clorch_repl.kernel.script`):
``__name__ == "__main__"``, ``sys.argv`` (``[SCRIPT, *ARGS]``; the module's file for ``module=``),
the script's folder first on ``sys.path`` (the working directory for a module), torchrun's
variables, and its own ``init_process_group`` accepted and ``destroy_process_group`` keeping the
group (:mod:`clorch_repl.kernel.torchrun`, installed here as in a session's rank): the job's
group was formed before the script started (so the job's timeout, hang probe and failure report
cover the whole script), which torch's own ``init_process_group`` would refuse as "initialize the
default process group twice". ``sys.exit(0)`` ends a script cleanly, as under python; any other
status raises :class:`~clorch_repl.errors.ScriptExit`, the one line ``%clorch run`` gives
(:func:`clorch_repl.kernel.script.exit_error`: the status and the script's line; a message given
to ``sys.exit`` printed first), not the traceback of the ``SystemExit`` through argparse's frames
(argparse's own usage and error went to the rank's log, as under python).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import types
from typing import Any

logger = logging.getLogger(__name__)

#: files whose frames a failed script's traceback leaves out above the script's own
RUNNER_FILES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")


def run_script(spec: dict[str, Any]) -> None:
    """Run the spec's ``script`` or ``module`` with its ``argv`` (see the module docstring)."""
    from ..kernel import torchrun
    from ..kernel.script import exit_error
    from ..wire.rank_env import torchrun_extras

    os.environ.update(torchrun_extras(os.environ))
    torchrun.install()
    argv = [str(a) for a in spec.get("argv") or []]
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    try:
        name, path = _enter(spec, argv)
        try:
            _run(spec)
        except SystemExit as exc:
            error = exit_error(exc, name, path)  # python's rule: any status but None and 0 is a failure
            if error is not None:
                raise error from None
            logger.debug("the script ended with sys.exit(%r)", exc.code)  # the group then ends cleanly
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        torchrun.uninstall()  # the job's process_group() then ends its group with torch's own destroy


def _enter(spec: dict[str, Any], argv: list[str]) -> tuple[str, str]:
    """``sys.argv`` and ``sys.path`` as python gives them to the script; the script's name and the
    file whose frames are its own (a module's: its ``__main__`` for a package, as ``-m`` runs)."""
    if spec.get("script"):
        path = spec["script"]
        sys.argv = [path, *argv]
        sys.path.insert(0, os.path.dirname(path))
        return os.path.basename(path), path
    import importlib.util

    sys.path.insert(0, os.getcwd())
    found = importlib.util.find_spec(spec["module"])
    if found is not None and found.submodule_search_locations is not None:
        found = importlib.util.find_spec(f"{spec['module']}.__main__")
    origin = getattr(found, "origin", None) or ""
    sys.argv = [origin or spec["module"], *argv]
    return spec["module"], origin


def _run(spec: dict[str, Any]) -> None:
    if spec.get("script"):
        runpy.run_path(spec["script"], run_name="__main__")
    else:
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)


def script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """A failed script's traceback from the script's own frames on (the runner's and runpy's above
    it are not the user's); ``tb`` itself when it holds no frame of the script."""
    entry = tb
    while entry is not None and _runner(entry.tb_frame.f_code.co_filename):
        entry = entry.tb_next
    return entry if entry is not None else tb


def _runner(filename: str) -> bool:
    return filename in RUNNER_FILES or os.path.abspath(filename) in RUNNER_FILES
