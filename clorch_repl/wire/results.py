"""A launched rank's result file: what crosses from the rank to the process that launched it.

Each rank writes ``rank-<r>.result.json`` once, atomically (:mod:`clorch_repl.common.atomic`), when
``main`` returns or raises; the job's monitor reads it. Standard library only: the launching
process, a notebook, must never initialise CUDA (so CUDA tensors travel as CPU tensors).
"""

from __future__ import annotations

import base64
import json
import pickle
from dataclasses import asdict, dataclass
from typing import Any

from ..common.atomic import write_json_atomic

__all__ = ["RankResult", "encode_value", "write_result", "read_result"]


@dataclass
class RankResult:
    """One rank's outcome. ``value_json`` holds the return value when JSON can carry it, else
    ``value_pickle`` (base64) does. ``failed_at`` is wall-clock time, used to order failures."""

    rank: int
    ok: bool
    value_json: str | None = None
    value_pickle: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    cascade: bool = False
    failed_at: float | None = None

    def value(self) -> Any:
        if self.value_pickle is not None:
            return pickle.loads(base64.b64decode(self.value_pickle))
        return None if self.value_json is None else json.loads(self.value_json)

    @property
    def error_line(self) -> str | None:
        if self.error_type is None:
            return None
        return f"{self.error_type}: {self.error_message}" if self.error_message else self.error_type


def encode_value(value: Any) -> tuple[str | None, str | None]:
    """(json, pickle) for a return value: JSON when it round-trips plainly, else pickle."""
    try:
        return json.dumps(value, allow_nan=True), None
    except (TypeError, ValueError):
        pass
    return None, base64.b64encode(pickle.dumps(_to_cpu(value))).decode()


def _to_cpu(value: Any) -> Any:
    """CUDA tensors (also inside dicts, lists, tuples) to CPU: the parent, a notebook that must
    stay CUDA-free, could not unpickle them without initialising CUDA."""
    if hasattr(value, "detach") and hasattr(value, "cpu") and getattr(value, "is_cuda", False):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items()) if type(value) is dict else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def write_result(path: str, result: RankResult) -> None:
    """Write ``result`` at ``path``, whole or not at all."""
    write_json_atomic(path, asdict(result))


def read_result(path: str) -> RankResult | None:
    """The result at ``path``; None while the rank has not written it (or it cannot be read)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return RankResult(**data)

