"""Validation and placement of ranks: pure functions, no processes."""

from __future__ import annotations

import re
from typing import Any

import pytest

from clorch_repl.errors import ConfigError
from clorch_repl.common.topology import resolve_topology


def test_gpu_defaults_and_placement() -> None:
    topo = resolve_topology(gpu_count=4)
    assert (topo.nproc, topo.backend, topo.devices) == (4, "nccl", (0, 1, 2, 3))
    topo = resolve_topology(devices="2,0", gpu_count=4)
    assert (topo.nproc, topo.devices) == (2, (2, 0))
    assert resolve_topology(gpu_count=0).devices == (None, None)  # 2 CPU ranks with gloo


def test_rank_devices_are_translated_through_the_callers_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = resolve_topology(devices="0,1", gpu_count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # a scheduler gave this notebook GPUs 2 and 3
    assert [topo.visible_devices(r) for r in (0, 1)] == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [topo.visible_devices(r) for r in (0, 1)] == ["0", "1"]
    assert resolve_topology(gpu_count=0).visible_devices(0) == ""  # CPU ranks see no GPU


def test_session_ranks_get_the_translated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from clorch_repl.launchers.local import LocalLauncher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    launcher = LocalLauncher(resolve_topology(devices="1", gpu_count=2))
    try:
        env = launcher.rank_env(0, master_port=29500)
        assert env["CUDA_VISIBLE_DEVICES"] == "7" and env["CLORCH_GPU_INDEX"] == "7"
    finally:
        launcher.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": "0,2", "gpu_count": 2}, "devices names GPU 2, which does not exist (0-1)"),
    ({"devices": "1", "gpu_count": 1}, "devices names GPU 1, which does not exist (only 0)"),
    ({"devices": "1,1", "gpu_count": 2}, "devices repeats 1"),
    ({"devices": "-1", "gpu_count": 2}, "GPU numbers start at 0"),
    ({"nproc": 3, "gpu_count": 2}, "nproc 3 needs 3 GPUs but 2 are visible"),
    ({"nproc": 2, "devices": "0", "gpu_count": 2}, "nproc 2 and devices 0 disagree"),
    ({"devices": "", "gpu_count": 2}, "devices is empty"),
])
def test_bad_layouts_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_topology(**kwargs)


@pytest.mark.parametrize("kwargs, api, magic", [
    ({"nproc": 0}, "nproc must be at least 1; got 0", "--nproc must be at least 1; got 0"),
    ({"nproc": 3, "devices": "0,1", "gpu_count": 2}, "nproc 3 and devices 0,1 disagree",
     "--nproc 3 and --devices 0,1 disagree"),
    ({"devices": "0", "gpu_count": 0}, "devices 0 were given, but this machine has no usable GPU; leave out devices",
     "--devices 0 were given, but this machine has no usable GPU; leave out --devices"),
    ({"devices": "0,x", "gpu_count": 2}, "devices must be comma-separated integers", "--devices must be comma-"),
    ({"backend": "nccl", "gpu_count": 0}, "use backend gloo", "use --backend gloo"),
    ({"timeout_s": "-1"}, "timeout must be a positive number", "--timeout must be a positive number"),
])
def test_one_check_names_the_options_as_each_caller_typed_them(kwargs: dict, api: str, magic: str) -> None:
    """The Python API's ``nproc=`` is refused as ``nproc``; ``%clorch start --nproc`` as ``--nproc``
    (it said ``nproc``, where the user typed ``--nproc``), from the one check."""
    from clorch_repl.errors import TopologyError
    from clorch_repl.magics.arguments import OPTION_NAMES

    with pytest.raises(TopologyError) as err:
        resolve_topology(**kwargs)
    assert api in str(err.value) and "--" not in str(err.value)
    assert magic in err.value.spelled(OPTION_NAMES) and "----" not in err.value.spelled(OPTION_NAMES)


@pytest.mark.parametrize("visible, count", [
    (None, 2), ("0,1", 2), ("1", 1), ("1,0", 2), (" 0 , 1 ", 2), ("1abc", 1),
    ("2,3", 0), ("3", 0), ("0,0", 0), ("0,abc,1", 1), ("", 0), ("-1", 0),
    ("GPU-5f3d1a2b", None), ("MIG-a,MIG-b", None),
])
def test_visible_devices_are_counted_as_cuda_counts_them(monkeypatch: Any, visible: str | None,
                                                        count: int | None) -> None:
    # The GPU count from NVML (no torch import) on a 2-GPU host, filtered by CUDA_VISIBLE_DEVICES as
    # CUDA reads it: ordinals up to the first invalid or absent one, none if one repeats; UUIDs
    # and MIG names are left to torch's own path (None).
    from clorch_repl import cuda

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cuda._visible_count(2) == count


@pytest.mark.parametrize("text", ['"0,2"', "'0,2'", ' " 0, 2 " '])
def test_a_rank_list_in_quotes_is_read_without_them(text: str) -> None:
    """IPython's magic parsers keep quotes (``%%distributed --ranks "0,2"``): read as a shell would."""
    from clorch_repl.common.topology import parse_int_list

    assert parse_int_list(text, "--ranks") == [0, 2]


@pytest.mark.parametrize("text", ['"0,2', "'0,2\"", '""'])
def test_unpaired_or_empty_quotes_are_still_refused(text: str) -> None:
    from clorch_repl.common.topology import parse_int_list
    from clorch_repl.errors import ConfigError

    with pytest.raises(ConfigError, match="--ranks"):
        parse_int_list(text, "--ranks")


@pytest.mark.parametrize("text, ranks", [("0-1", [0, 1]), ("0-3,6", [0, 1, 2, 3, 6]), ("2 - 4", [2, 3, 4]), ("5-5", [5])])
def test_rank_sets_as_messages_write_them_can_be_typed_back(text: str, ranks: list[int]) -> None:
    """Messages name rank sets as ``0-3,6`` (rank_sets.ranks_text); --ranks reads that spelling."""
    from clorch_repl.common.rank_sets import ranks_text
    from clorch_repl.common.topology import parse_int_list

    assert parse_int_list(text, "--ranks") == ranks
    assert parse_int_list(ranks_text(ranks), "--ranks") == ranks


def test_a_backwards_range_is_refused_saying_how_to_write_it() -> None:
    from clorch_repl.common.topology import parse_int_list
    from clorch_repl.errors import ConfigError

    with pytest.raises(ConfigError, match="the range 3-1 runs backwards; write it 1-3"):
        parse_int_list("3-1", "--ranks")


def test_a_topology_refusal_survives_pickling_and_is_named_for_its_caller(monkeypatch: Any) -> None:
    """A refusal sent between processes keeps its template (it was formatted twice, eating braces
    in the value, and lost the option names); local_session says ``timeout_s``, its parameter; a
    count from ``$CLORCH_NPROC`` is blamed on the variable, not on a ``--nproc`` nobody typed."""
    import pickle

    from clorch_repl import cuda
    from clorch_repl.common.topology import host_topology
    from clorch_repl.errors import TopologyError
    from clorch_repl.magics.arguments import OPTION_NAMES
    from clorch_repl.session.engine import local_session

    with pytest.raises(TopologyError) as err:
        resolve_topology(backend="{mpi}")
    back = pickle.loads(pickle.dumps(err.value))
    assert str(back) == str(err.value) == "backend must be one of nccl, gloo; got '{mpi}'"
    assert back.spelled(OPTION_NAMES) == "--backend must be one of nccl, gloo; got '{mpi}'"
    with pytest.raises(TopologyError, match=r"^timeout_s must be a positive number"):
        local_session(2, "gloo", timeout_s=-1)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)  # a stand-in: this box has no GPU
    monkeypatch.setenv("CLORCH_NPROC", "3")
    with pytest.raises(TopologyError) as err:
        host_topology(None, None, None, None)
    assert err.value.spelled(OPTION_NAMES) == ("$CLORCH_NPROC 3 needs 3 GPUs but 2 are visible: one NCCL rank per "
                                              "GPU (two ranks cannot share one GPU)")
    with pytest.raises(TopologyError) as err:
        host_topology("3", None, None, None)  # typed: the option's name
    assert err.value.spelled(OPTION_NAMES).startswith("--nproc 3 needs 3 GPUs")
