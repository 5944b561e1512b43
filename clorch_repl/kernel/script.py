"""The rank's half of ``%clorch run``: run a torchrun script as ``python SCRIPT ARGS`` would,
inside this rank's live process (and group), with IPython's ``%run`` semantics.

The notebook (:mod:`clorch_repl.session.script_run`) first asks every chosen rank to :func:`check`
the script (so a script missing on one node fails before any rank starts it, instead of leaving the
others waiting for that rank in their first collective), then sends :func:`run` as the cell.

What the script sees is what torchrun gives it: ``__name__ == "__main__"``, ``sys.argv``
(``[SCRIPT, *ARGS]``; the module's file for ``-m``), the script's folder (``-m``: the working
directory) first on ``sys.path``, a ``__main__`` module of its own in ``sys.modules`` (so that
pickling what it defines works) and torchrun's variables in ``os.environ`` (set when the rank
joined: :func:`clorch_repl.wire.rank_env.torchrun_extras`). A fresh namespace, as ``%run`` gives; its
globals are copied into the rank's namespace afterwards, also when the script failed (the
moment one most wants to look at them). ``-i`` runs it in the rank's own namespace instead.

``sys.exit(0)`` and ``SystemExit(None)`` end the script cleanly; any other status raises
:class:`~clorch_repl.errors.ScriptExit`, one line naming the status (a message given to
``sys.exit`` is printed first, as Python prints it, so argparse's usage and error show as
argparse wrote them). Other exceptions propagate as they are, rendered from the script's own
frames (:func:`clorch_repl.kernel.tracebacks.user_traceback`).
"""

from __future__ import annotations

import builtins
import importlib.util
import logging
import os
import socket
import sys
import types
from dataclasses import dataclass
from typing import Any

from ..errors import ScriptExit, ScriptNotFound
from . import tracebacks
from .shell import rank_shell
from .tracebacks import hide_own_frames

logger = logging.getLogger(__name__)
tracebacks.hide_frames_of(__file__, runner=True)

#: names of the script's namespace that describe the script, not what it made: not copied over
_OWN_NAMES = frozenset({"__name__", "__file__", "__builtins__", "__spec__", "__loader__", "__package__",
                        "__cached__", "__doc__"})
_MISSING = object()


class _Exit:
    """``exit``/``quit`` as a script run by python has them: ``SystemExit(code)``. IPython hides
    the builtins' during a cell, and its own (the rank namespace's) would shut the rank's kernel
    down; site's closes ``sys.stdin`` first, which a kernel must keep."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() to end the script"

    def __call__(self, code: Any = None) -> None:
        raise SystemExit(code)


_EXITS = {"exit": _Exit("exit"), "quit": _Exit("quit")}


@dataclass(frozen=True)
class Target:
    """What a rank runs: a file, or a module found on its ``sys.path``."""

    path: str  # the file's absolute path (a module's origin)
    argv0: str  # sys.argv[0]: the path as given (python SCRIPT), the module's file (python -m)
    module: str | None  # the module's name for -m, else None
    spec: Any  # the module's ModuleSpec (None for a file)
    search_dir: str  # put first on sys.path: the script's folder, or the working directory for -m


def _where() -> str:
    """The host and working directory (the notebook labels the rank itself: identical messages of
    ranks on one host then merge into one)."""
    return f"host {socket.gethostname()} (working directory {os.getcwd()})"


def resolve(script: str, module: bool) -> Target:
    """The script or module, as this rank finds it; :class:`ScriptNotFound` saying where it looked."""
    if module:
        return _resolve_module(script)
    path = os.path.abspath(os.path.expanduser(script))
    if os.path.isdir(path):
        raise ScriptNotFound(f"{script!r} is a directory on {_where()}: give the script file, or -m PACKAGE "
                             "to run a package's __main__")
    if not os.path.isfile(path):
        raise ScriptNotFound(f"no script {script!r} on {_where()}: it must exist on every node that runs a rank "
                             "(a shared filesystem, or copy it there), at that path or one relative to the "
                             "rank's working directory")
    if path.endswith((".ipynb", ".ipy")):
        raise ScriptNotFound(f"{script!r} is not a Python script: %clorch run runs .py files on the ranks "
                             "(clorch-notebook export NB.ipynb turns a notebook into one)")
    return Target(path, script, None, None, os.path.dirname(path))


def _resolve_module(name: str) -> Target:
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # python -m searches the working directory first
        sys.path.insert(0, cwd)
    try:
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
                spec = importlib.util.find_spec(f"{name}.__main__")
                if spec is None:
                    raise ScriptNotFound(f"{name!r} is a package without a __main__ module on {_where()}: "
                                         f"-m runs {name}.__main__; name a module of it instead")
        except (ImportError, ValueError) as exc:
            raise ScriptNotFound(f"cannot find module {name!r} on {_where()}: {exc}") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if spec is None or spec.loader is None or not spec.origin or not hasattr(spec.loader, "get_code"):
        raise ScriptNotFound(f"no module {name!r} on {_where()} (sys.path and the working directory searched): "
                             "install it on every node, or run its file with %clorch run PATH")
    return Target(spec.origin, spec.origin, spec.name, spec, cwd)


def check(script: str, module: bool) -> None:
    """The notebook's pre-flight request: raises on this rank when the script is not here, or
    does not compile (python, too, reads the whole script before it runs a line of it; a
    SyntaxError is then the notebook's one line, ``SyntaxError: invalid syntax (train.py, line
    2)``, where the cell's rendering of it would list IPython's and clorch's frames)."""
    _code(resolve(script, module))


def _code(target: Target) -> types.CodeType:
    if target.spec is not None:
        return target.spec.loader.get_code(target.spec.name)
    with open(target.path, "rb") as fh:  # bytes: compile honours a coding cookie, as python does
        source = fh.read()
    return compile(source, target.path, "exec", dont_inherit=True)


def run(script: str, args: list[str], module: bool = False, interactive: bool = False) -> None:
    """Run the script on this rank (see the module docstring)."""
    shell = rank_shell("%clorch run")
    target = resolve(script, module)
    code = _code(target)  # compiled by check() a moment ago: a SyntaxError stopped it there
    if interactive:
        ns = shell.user_ns
        main_mod = shell.user_module
        saved = {name: ns.get(name, _MISSING) for name in ("__file__", *_EXITS)}
    else:
        main_mod = shell.new_main_mod(target.path, "__main__")
        ns = main_mod.__dict__
        ns.update(__builtins__=builtins, __spec__=target.spec, __loader__=getattr(target.spec, "loader", None),
                  __package__=target.module.rpartition(".")[0] if target.module else None, __cached__=None)
    ns.update(_EXITS, __name__="__main__", __file__=target.path)
    saved_argv, saved_main = sys.argv, sys.modules.get("__main__")
    sys.argv = [target.argv0, *args]
    sys.modules["__main__"] = main_mod
    sys.path.insert(0, target.search_dir)
    try:
        exec(code, ns)  # noqa: S102 - running the user's script is the point
    except SystemExit as exc:
        _exited(exc, target)
    except BaseException as exc:
        hide_own_frames(exc)
        raise
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        try:
            sys.path.remove(target.search_dir)
        except ValueError:
            logger.debug("the script took %s off sys.path itself", target.search_dir)
        if interactive:
            for name, value in saved.items():
                if name != "__file__" and ns.get(name) is not _EXITS[name]:
                    continue  # the script bound the name itself: its value stays, as any global's
                if value is _MISSING:
                    ns.pop(name, None)
                else:
                    ns[name] = value
        else:
            shell.user_ns.update({k: v for k, v in ns.items()
                                  if k not in _OWN_NAMES and v is not _EXITS.get(k)})
            shell.user_ns["__builtins__"] = builtins  # what IPython's %run restores too


def _exited(exc: SystemExit, target: Target) -> None:
    error = exit_error(exc, target.module or os.path.basename(target.path), target.path)
    if error is not None:
        raise error from None


def exit_error(exc: SystemExit, name: str, path: str) -> ScriptExit | None:
    """sys.exit's status as python gives it to the shell, as the error a script's runner reports:
    None when the script ended cleanly (None and 0); else :class:`ScriptExit` naming the status
    and the script's line (``name`` is how the script is called, ``path`` the file whose frames
    are the script's). An int is the status; anything else (a message) is printed to stderr first,
    as python prints it, and the status is 1. Shared by ``%clorch run`` and a batch job's script
    (:mod:`clorch_repl.jobs._script_entry`), so both say the same."""
    code = exc.code
    if code is None or code == 0:
        return None
    if isinstance(code, int) and not isinstance(code, bool):
        status = code
    elif isinstance(code, bool):
        status = int(code)
    else:
        sys.stdout.flush()  # what the script printed first is shown first (its stream is buffered, this one not)
        print(code, file=sys.stderr, flush=True)
        status = 1
    where = _exit_line(exc.__traceback__, path)
    return ScriptExit(f"{name} exited with status {status} (sys.exit{where})", status)


def _exit_line(tb: types.TracebackType | None, path: str) -> str:
    """`` at train.py:41``: the script's last line on the way to sys.exit (argparse's included)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at {os.path.basename(path)}:{line}" if line is not None else ""
