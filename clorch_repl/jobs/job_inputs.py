"""What ``launch`` is asked to run, checked in the launching process before any rank starts:
``main`` (a function), or a torchrun script (``script=`` a file, ``module=`` a module, with its
command-line ``args``), and the job's arguments and extra environment (its private directory is
:mod:`.job_dirs`'s).

A script job runs the script as torchrun's worker would (``python SCRIPT ARGS``), in a rank whose
process group is already formed: the script's own ``init_process_group`` is accepted and its
``destroy_process_group`` keeps the group, as under ``%clorch run``
(:mod:`clorch_repl.jobs._script_entry`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from ._target import target_spec

logger = logging.getLogger(__name__)


def what_to_run(main: str | Callable[..., Any] | None, script: str | os.PathLike[str] | None,
                module: str | None, args: Any) -> tuple[dict[str, Any], str]:
    """The job spec's entries for what each rank runs, and how the job names it (``main`` of its
    status): ``{"main", "args"}`` for a function, ``{"script"|"module", "argv"}`` for a script."""
    given = [name for name, value in (("main", main), ("script", script), ("module", module)) if value is not None]
    if len(given) != 1:
        said = f"got {' and '.join(given)}" if given else "got none"
        raise ConfigError(f"launch needs one of main ('module:function'), script ('train.py') or module "
                          f"('pkg.train'): what every rank runs; {said}")
    if main is not None:
        spec = target_spec(main)
        return {"main": spec, "args": json_args(args)}, spec
    argv = script_args(args)
    where = f"on host {socket.gethostname()} (working directory {os.getcwd()})"
    if script is not None:
        path = os.path.abspath(os.fspath(script))
        if not os.path.isfile(path):
            raise ConfigError(f"script: no file {os.fspath(script)!r} {where}; give the path of a torchrun script")
        return {"script": path, "argv": argv}, f"script {os.path.basename(path)}"
    name = str(module)
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"module {name!r} cannot be found {where} ({type(exc).__name__}: {exc})") from None
    if found is None:
        raise ConfigError(f"module: no module {name!r} {where}; the ranks import it from the same sys.path")
    return {"module": name, "argv": argv}, f"module {name}"


def script_args(args: Any) -> list[str]:
    """A script's command-line arguments: a list of strings (``sys.argv[1:]``), or None for none."""
    if args is None:
        return []
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)) \
            or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"args of a script job are its command line, a list of strings such as ['--epochs', "
                          f"'2']; got {args!r}")
    return list(args)


def json_args(args: Any) -> Any:
    """``main``'s args as the ranks will get them (they travel as JSON)."""
    try:
        return json.loads(json.dumps(args, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"args cannot be sent to the ranks: they travel as JSON (dicts with string keys, lists, "
                          f"strings, finite numbers, booleans, None) and {exc}; pass paths or plain values "
                          "instead of objects") from None


def extra_env(env: Mapping[str, str] | None) -> dict[str, str]:
    extra = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"env must map strings to strings; got {key!r}: {value!r}")
        extra[key] = value
    return extra
