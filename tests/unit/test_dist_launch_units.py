"""launch(): every bad input refused before a process starts, and its errors' classes. launch()
and Job on real processes: tests/integration/test_dist_launch.py."""

from __future__ import annotations

import psutil
import pytest

import dist_workers
from clorch_repl import distributed as dist
import clorch_repl.distributed as launch_mod
from clorch_repl.errors import ClorchError, ConfigError, RankFailure


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _not_importable_here() -> None:
    pass


_not_importable_here.__module__ = "__main__"


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "mpi"}, "backend must be one of nccl, gloo"),
    ({"nproc_per_node": None, "devices": [0, 0]}, "devices repeats 0"),
    ({"nproc_per_node": None, "devices": [-1]}, "GPU numbers start at 0"),
    ({"nproc_per_node": None, "devices": [64]}, "(does not exist|no usable GPU)"),
    ({"nproc_per_node": 3, "devices": [0, 1]}, "nproc_per_node 3 and devices 0,1 disagree"),
    ({"nproc_per_node": 0}, "^nproc_per_node must be at least 1"),  # launch()'s own name for it
    ({"nproc_per_node": "two"}, "^nproc_per_node must be a whole number of ranks; got 'two'"),
    ({"pg_timeout_s": -1}, "^pg_timeout_s must be a positive number"),
    # the group's timeout is not the job's: the refusal names launch()'s own option for that, not a magic's
    ({"pg_timeout_s": 0.01}, r"^pg_timeout_s 0.01 s is the process group's.*\(the job's own time limit is timeout_ms\)$"),
    ({"main": "no_such_module_xyz:run"}, "no module named 'no_such_module_xyz'"),
    ({"main": "dist_workers:no_such_function"}, "has no attribute 'no_such_function'"),
    ({"main": "dist_workers"}, "main must be 'module:function'"),
    ({"main": lambda ctx: None}, "lambda or nested function"),
    ({"main": _not_importable_here}, "defined in __main__"),
    ({"main": 42}, "main must be 'module:function' or a function"),
    ({"args": {"model": object()}}, "args cannot be sent to the ranks"),
    ({"args": {"x": float("nan")}}, "args cannot be sent to the ranks"),
    ({"args": {1, 2}}, "args cannot be sent to the ranks"),
    ({"timeout_ms": -5}, "timeout_ms must be a positive number"),
    ({"timeout_ms": "soon"}, "timeout_ms must be a number of milliseconds; got 'soon'"),
    ({"env": {"X": 1}}, "env must map strings to strings"),
])
def test_bad_input_is_refused_before_any_process_starts(kwargs: dict, message: str) -> None:
    params = {"nproc_per_node": 2, "main": "dist_workers:train_small", "args": {"steps": 1}, "timeout_ms": 10_000}
    params.update(kwargs)
    before_jobs, before_children = len(launch_mod.jobs()), _children()
    with pytest.raises(ConfigError, match=message) as info:
        dist.launch(**params)
    assert "\n" not in str(info.value), "the refusal should be one line"
    assert len(launch_mod.jobs()) == before_jobs
    assert _children() <= before_children


def test_missing_main_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"launch needs one of main \(.module:function.\), script"):
        dist.launch(nproc_per_node=2)


def test_config_error_is_a_clorch_error() -> None:
    assert issubclass(ConfigError, ClorchError) and issubclass(RankFailure, ClorchError)
