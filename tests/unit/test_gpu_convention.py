"""torchrun's GPU convention (issue 35): the environment each rank of a multi-GPU layout gets, from
the pure functions that compute it, so that ``cuda:{LOCAL_RANK}`` / ``set_device(LOCAL_RANK)`` /
``.to(LOCAL_RANK)`` is the rank's own GPU, and NUMA binding, ``%clorch top``'s GPU figures, the
status table and the hang probe all name that same GPU.

No GPU exists on the machines that run these tests: the layouts below are described (a GPU count
given to resolve_topology, the GPU lists remote ranks report), never probed. The ranks reaching
their device on real (CPU) ranks is tests/integration/test_torch_code.py's."""

from __future__ import annotations

from typing import Any

import pytest

from clorch_repl.kernel import numa
from clorch_repl.errors import ConfigError
from clorch_repl.kernel.torchrun import GroupFacts, disagreement
from clorch_repl.wire.rank_env import (GPU_INDEX_ENV, RankPlace, device_index, host_gpu_lists, rank_environment,
                                       visible_devices)
from clorch_repl.common.topology import Topology, resolve_topology


def local_envs(topo: Topology) -> list[dict[str, str]]:
    """Every rank's environment as the local launcher builds it (launchers/local.py rank_env)."""
    return [rank_environment(RankPlace(
        rank=r, local_rank=r, world_size=topo.nproc, local_world_size=topo.nproc, master_addr="127.0.0.1",
        master_port=29500, backend=topo.backend, timeout_s=60.0, gpu=topo.visible_devices(r) or None,
        host_gpus=topo.host_gpus()), base={}) for r in range(topo.nproc)]


def test_four_gpus_every_rank_sees_all_and_its_own_is_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    topo = resolve_topology(gpu_count=4)
    envs = local_envs(topo)
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "4", "4")
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert device_index(env) == r  # join_group's cuda:{LOCAL_RANK}, the current device
        assert env[GPU_INDEX_ENV] == str(r)
        assert topo.device_label(r) == f"cuda:{r}"


def test_a_devices_subset_is_listed_in_local_rank_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """--devices 2,3 on a 4-GPU host: each rank sees "2,3", so cuda:1 of local rank 1 is GPU 3;
    NUMA binding and NVML read the host's number of the rank's GPU, never its cuda:N."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    topo = resolve_topology(devices="2,3", gpu_count=4)
    envs = local_envs(topo)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2,3", "2,3"]
    assert [device_index(e) for e in envs] == [0, 1]
    assert [e[GPU_INDEX_ENV] for e in envs] == ["2", "3"]
    assert [topo.device_label(r) for r in (0, 1)] == ["cuda:0 (GPU 2)", "cuda:1 (GPU 3)"]
    bound: list[Any] = []
    monkeypatch.setattr(numa, "apply_cpu_bind", lambda mode, gpu: bound.append(gpu))  # no NUMA nodes here
    for env in envs:
        numa.apply_from_env({**env, numa.CPU_BIND_ENV: "numa"})
    assert bound == [2, 3]
    # devices given in another order: still each rank's own GPU at its LOCAL_RANK
    envs = local_envs(resolve_topology(devices="3,1", gpu_count=4))
    assert [(e["CUDA_VISIBLE_DEVICES"], device_index(e), e[GPU_INDEX_ENV]) for e in envs] == [("3,1", 0, "3"),
                                                                                             ("3,1", 1, "1")]


def test_a_notebook_that_sees_some_gpus_translates_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the notebook's device 2 is the host's GPU 6
    topo = resolve_topology(devices="2,3", gpu_count=4)
    envs = local_envs(topo)
    assert [(e["CUDA_VISIBLE_DEVICES"], device_index(e), e[GPU_INDEX_ENV]) for e in envs] == [("6,7", 0, "6"),
                                                                                             ("6,7", 1, "7")]


def test_cpu_ranks_see_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    envs = local_envs(resolve_topology(gpu_count=0))
    assert [(e["CUDA_VISIBLE_DEVICES"], device_index(e), GPU_INDEX_ENV in e) for e in envs] == [("", None, False)] * 2


def test_two_hosts_each_rank_sees_its_hosts_gpus() -> None:
    """Two hosts of 2 GPUs each (torchrun or srun gave every task its node's GPUs): ranks 2 and 3
    are local ranks 0 and 1 of host b, each sees b's "0,1" and its own at LOCAL_RANK."""
    reported = [("a", 0, "0", ["0", "1"]), ("a", 1, "1", ["0", "1"]), ("b", 0, "0", ["0", "1"]),
                ("b", 1, "1", ["0", "1"])]
    lists = host_gpu_lists(reported)
    assert lists == [("0", "1")] * 4
    for rank, ((_, local, gpu, _), listed) in enumerate(zip(reported, lists)):
        env = rank_environment(RankPlace(rank=rank, local_rank=local, world_size=4, local_world_size=2,
                                         master_addr="10.0.0.1", master_port=29500, backend="nccl", timeout_s=60.0,
                                         gpu=gpu, host_gpus=listed), base={})
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and device_index(env) == local == int(env["LOCAL_RANK"])
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"


def test_one_gpu_per_task_keeps_the_rank_on_its_own_gpu() -> None:
    """srun --gpus-per-task=1: each task is allowed its own GPU only, so the convention cannot hold;
    the rank sees that one GPU as cuda:0 instead of a list naming GPUs it may not use."""
    reported = [("a", 0, "0", ["0"]), ("a", 1, "1", ["1"])]
    lists = host_gpu_lists(reported)
    assert lists == [(), ()]
    assert visible_devices("1", 1, lists[1]) == "1"
    assert device_index({"CUDA_VISIBLE_DEVICES": "1", GPU_INDEX_ENV: "1", "LOCAL_RANK": "1"}) == 0
    # a host where one rank has no GPU: nobody there gets a list with a gap
    assert host_gpu_lists([("a", 0, "0", ["0", "1"]), ("a", 1, None, ["0", "1"])]) == [(), ()]


def test_a_host_list_naming_one_gpu_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="local rank 1: its host's GPUs 0,0 name one GPU twice"):
        visible_devices("0", 1, ("0", "0"))


def test_remote_topology_labels_name_the_gpu_as_the_rank_does() -> None:
    topo = Topology(nproc=2, devices=(2, 3), backend="nccl", timeout_s=60.0, in_process=(0, 1))
    assert [topo.device_label(r) for r in (0, 1)] == ["cuda:0 (GPU 2)", "cuda:1 (GPU 3)"]


GPU1 = GroupFacts(backend="nccl", world_size=4, rank=1, device="cuda:1")
CPU = GroupFacts(backend="gloo", world_size=2, rank=1, device="cpu")


@pytest.mark.parametrize("facts, device_id", [(GPU1, 1), (GPU1, "cuda:1"), (GPU1, "cuda"), (CPU, "cpu")])
def test_init_with_the_ranks_own_device_agrees(facts: GroupFacts, device_id: Any) -> None:
    import torch

    assert disagreement(facts, device_id=device_id) == []
    assert disagreement(facts, device_id=torch.device(str(device_id) if not isinstance(device_id, int)
                                                      else f"cuda:{device_id}")) == []


def test_init_with_another_device_gives_advice_that_works() -> None:
    found = disagreement(GPU1, device_id=0)
    assert len(found) == 1 and found[0].startswith("device_id=cuda:0, but this rank's GPU is cuda:1"), found
    found = disagreement(CPU, device_id="cuda:0")
    assert len(found) == 1 and "device_id=device, which is cpu here" in found[0], found
