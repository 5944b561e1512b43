"""The one place on the notebook's side that writes a request to the ranks.

A request is a name from the rank's registry (:mod:`clorch_repl.kernel.requests`, where the
decision is explained) and JSON arguments. It still travels as the code of a silent (or, for
``%clorch run``, an ordinary) execute request through the relay, so that it gets a cell's output
budget, interrupts and tracebacks; but that code is always the same fixed line, with the name
and the JSON text as Python string literals::

    __import__('clorch_repl.kernel.requests', fromlist=['_']).call('join', '{"env": {...}}')

so no caller writes Python, and nothing a user typed (a script's path or arguments) can end up
as code: on the rank it arrives as the string it was.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

logger = logging.getLogger(__name__)

#: the module whose ``call`` every request names (imported on the rank only)
RANK_MODULE = "clorch_repl.kernel.requests"
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def request_code(name: str, /, **args: Any) -> str:
    """The code that asks each rank for the request ``name`` with keyword arguments ``args``
    (``name`` is positional only: a handler may take a ``name`` of its own, a value's).

    ``args`` must be JSON data that comes back as it was (strings, finite numbers, booleans,
    None, lists and dicts with string keys): a tuple, a set, a path object or NaN is refused with
    a TypeError naming the argument, since the rank would get something else, or nothing."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise TypeError(f"a request's name is a lower-case identifier, got {name!r}")
    for key, value in args.items():
        _check_json(name, key, value)
    text = json.dumps(args, ensure_ascii=True, allow_nan=False, sort_keys=True)
    if json.loads(text) != args:  # the checks above make this hold; a request must never be altered
        raise TypeError(f"request {name!r}: its arguments do not survive JSON unchanged: {args!r}")
    return f"__import__({RANK_MODULE!r}, fromlist=['_']).call({name!r}, {text!r})"


def _check_json(name: str, where: str, value: Any) -> None:
    """Raise TypeError unless ``value`` is JSON data that decodes to itself."""
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float):
        if math.isfinite(value):
            return
        raise TypeError(f"request {name!r}: argument {where} is {value!r}, which JSON cannot carry")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(name, f"{where}[{i}]", item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"request {name!r}: argument {where} has the key {key!r}; JSON keys are strings")
            _check_json(name, f"{where}[{key!r}]", item)
        return
    raise TypeError(f"request {name!r}: argument {where} is a {type(value).__name__} ({value!r}), not JSON "
                    "data: pass strings, numbers, booleans, None, lists or dicts (a tuple as a list, a path "
                    "as a str)")
