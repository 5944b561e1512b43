"""The rank's registry of what the notebook may ask it: a request is a name and JSON arguments.

Why a registry, not source: the notebook used to send each request as Python written by string
operations (a join's environment spliced in with ``repr``, a per-rank path built from
``__import__('os').environ['RANK']``). Every caller then wrote code, and a value typed by the
user (a ``%clorch run`` script's arguments) travelled inside it. Now the only code a request
carries is the fixed line :func:`clorch_repl.wire.requests.request_code` writes, which calls
:func:`call` here with a name and a JSON text: the arguments are data, decoded by ``json.loads``,
never evaluated. The transport is unchanged (an execute request through the relay: the cell's
output budget, interrupts and tracebacks are a cell's).

* :data:`HANDLERS` maps each name to ``module:function``, imported when first asked: a join does
  not import the profiler, and this module imports nothing of the package at load time but
  :mod:`.tracebacks` (standard library only), with which it registers its own file: a request
  that fails shows the handler's frames and the cause, never this dispatcher's.
* What differs per rank (its file in a value transfer or a profile) is worked out by the handler
  from its own ``RANK``: one request serves every rank, and nothing rank-specific is spliced in.
* A name this rank does not know, or arguments its handler does not take, raise
  :class:`~clorch_repl.errors.UnknownRequest` saying which, on which rank, and that the notebook
  and the rank run different versions of clorch_repl.
* The cell that calls :func:`call` is a request's one line, clorch's code though IPython compiled
  it as a cell: :func:`call` remembers its compiled file (:func:`is_request_cell`), so that a hang
  report's stack (:func:`clorch_repl.diagnosis.probe.is_own`) leaves its frame out with clorch's
  own, as :mod:`.tracebacks` leaves it out of a traceback, instead of showing
  ``Cell In[7], line 1`` and the request's text as the user's line.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
from typing import Any, Callable

from . import tracebacks

logger = logging.getLogger(__name__)

#: request name -> "module:function" of its handler (the handler's keyword arguments are the
#: request's JSON arguments)
HANDLERS: dict[str, str] = {
    "join": "clorch_repl.kernel.group:join_group",
    "regroup": "clorch_repl.kernel.group:rejoin",
    "export_value": "clorch_repl.kernel.transfer:export_value",
    "import_value": "clorch_repl.kernel.transfer:import_value",
    "script_check": "clorch_repl.kernel.script:check",
    "script_run": "clorch_repl.kernel.script:run",
    "profile_start": "clorch_repl.kernel.profiler:start",
    "profile_stop": "clorch_repl.kernel.profiler:stop",
    "finish_saves": "clorch_repl.training.checkpoint.in_flight:finish",
}
_resolved: dict[str, Callable[..., Any]] = {}
#: the compiled files of the cells that called :func:`call` on this rank (see the module docstring).
#: A cell's file is named after its code (ipykernel: a hash of it), so a file here holds nothing
#: but a request's line; a set, as the requests' texts are few (one per name and arguments).
_REQUEST_CELLS: set[str] = set()

tracebacks.hide_frames_of(__file__)


def _this_rank() -> str:
    return f"rank {os.environ.get('RANK', '?')}"


def _version_hint() -> str:
    from .. import __version__

    return (f"this rank runs clorch_repl {__version__}: the notebook and its ranks must run the same "
            "version (install it on every host, then %clorch restart)")


def is_request_cell(filename: str) -> bool:
    """Whether code compiled from ``filename`` is a request's cell on this rank: clorch's one line
    that called :func:`call`, not a cell of the user's."""
    return filename in _REQUEST_CELLS


def handler(name: str, handlers: dict[str, str] | None = None) -> Callable[..., Any]:
    """The function registered as ``name``, imported on first use."""
    table = HANDLERS if handlers is None else handlers
    target = table.get(name)
    if target is None:
        from ..errors import UnknownRequest

        raise UnknownRequest(f"{_this_rank()} has no request {name!r} (it knows {', '.join(sorted(table))}); "
                             + _version_hint())
    if handlers is None and name in _resolved:
        return _resolved[name]
    module, _, function = target.partition(":")
    found = getattr(importlib.import_module(module), function)
    if handlers is None:
        _resolved[name] = found
    return found


def call(name: str, arguments: str = "{}", handlers: dict[str, str] | None = None) -> Any:
    """Run the request ``name`` with ``arguments`` (a JSON object: the handler's keyword
    arguments); what the handler returns (None for every request the notebook sends, so that a
    non-silent request shows no ``Out``). ``handlers``: another table (tests)."""
    caller = sys._getframe(1).f_code
    if caller.co_name == "<module>":  # the request's cell (its one line), not a function calling call() itself
        _REQUEST_CELLS.add(caller.co_filename)  # before anything can hang
    found = handler(name, handlers)
    args = json.loads(arguments)
    if not isinstance(args, dict):
        raise TypeError(f"request {name!r}: its arguments must be a JSON object, got {type(args).__name__}")
    try:
        inspect.signature(found).bind(**args)
    except TypeError as exc:
        from ..errors import UnknownRequest

        raise UnknownRequest(f"{_this_rank()} cannot take request {name!r} with arguments "
                             f"{', '.join(sorted(args)) or 'none'} ({exc}); " + _version_hint()) from None
    try:
        return found(**args)
    except BaseException as exc:
        tracebacks.hide_own_frames(exc)  # the handler's frames and the cause, not this dispatcher's
        raise
