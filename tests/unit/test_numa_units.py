"""clorch_repl.kernel.numa without processes: cpulists, PCI names, a GPU's NUMA cores, and the variables
a rank reads, all on this machine's own sysfs. Binding real processes: tests/integration/test_numa.py."""

from __future__ import annotations

import os
import shutil

import pytest

from clorch_repl.kernel import numa


PCI = numa.PCI_DEVICES


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3,8-11", {0, 1, 2, 3, 8, 9, 10, 11}),
    ("0-27,56-83\n", set(range(0, 28)) | set(range(56, 84))),  # a 2-socket node with SMT, as sysfs writes it
    ("0", {0}),
    ("5,7", {5, 7}),
    ("0-15:4", {0, 4, 8, 12}),
    ("\n", set()),  # a memory-only node
])
def test_cpulists_as_the_kernel_writes_them(text: str, cpus: set[int]) -> None:
    assert numa.parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["0-", "a-b", "3-1", "0,,x", "1-4:0", "-1"])
def test_a_bad_cpulist_is_refused_with_what_was_wrong(bad: str) -> None:
    with pytest.raises(ValueError, match="not a cpulist"):
        numa.parse_cpulist(bad)


def test_format_cpulist_gives_back_the_ranges() -> None:
    assert numa.format_cpulist({0, 1, 2, 3, 8, 9, 10, 11, 20}) == "0-3,8-11,20"
    assert numa.parse_cpulist(numa.format_cpulist(set(range(0, 28)) | {56})) == set(range(0, 28)) | {56}


def test_bus_ids_of_nvidia_smi_become_sysfs_names() -> None:
    assert numa.sysfs_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert numa.sysfs_bus_id("00000001:AB:00.0") == "0001:ab:00.0"
    assert numa.sysfs_bus_id("0000:3b:00.0") == "0000:3b:00.0"  # NVML's legacy form passes through
    with pytest.raises(ValueError, match="not a PCI bus id"):
        numa.sysfs_bus_id("GPU-1234")


@pytest.mark.skipif(not os.path.isdir(PCI) or not os.listdir(PCI), reason="no PCI devices in sysfs here")
def test_a_real_pci_device_gives_its_node_cores_or_says_it_has_no_node() -> None:
    device = sorted(os.listdir(PCI))[0]
    cpus, why = numa.cpus_for_bus_id(device)
    with open(os.path.join(PCI, device, "numa_node")) as fh:
        node = int(fh.read())
    if node < 0:
        assert cpus is None and why.startswith(numa.NO_NODE) and device in why
    else:
        with open(os.path.join(PCI, device, "local_cpulist")) as fh:
            assert cpus == numa.parse_cpulist(fh.read())
    missing, why = numa.cpus_for_bus_id("0000:ff:1f.7" if device != "0000:ff:1f.7" else "0000:fe:1f.7")
    assert missing is None and "no NUMA node" in why


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_the_cores_are_unknown_and_the_log_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger=numa.__name__)
    assert numa.cpus_for_gpu(0) is None
    assert "no CPU cores known for GPU 0" in caplog.text
    assert "nvidia-smi" in caplog.text  # the reason: no nvidia-smi (and no pynvml)


def test_a_gpu_that_does_not_exist_has_no_cores() -> None:
    assert numa.cpus_for_gpu(10_000) is None


def test_the_variables_a_rank_reads() -> None:
    # "none", the default, reads nothing else and binds nothing, whatever the GPU variable holds.
    assert numa.apply_from_env({numa.CPU_BIND_ENV: "none", numa.GPU_INDEX_ENV: "GPU-not-a-gpu"}) == ("none", None)
    assert numa.apply_from_env({}) == ("", None)
    assert numa.apply_from_env({numa.CPU_BIND_ENV: "numa", "CUDA_VISIBLE_DEVICES": ""}) == ("numa", None)  # CPU rank
    with pytest.raises(ValueError, match="CLORCH_CPU_BIND='sockets': unknown CPU binding mode"):
        numa.apply_from_env({numa.CPU_BIND_ENV: "sockets"})
    with pytest.raises(ValueError, match="CLORCH_GPU_INDEX='cuda:0' is not a GPU index"):
        numa.apply_from_env({numa.CPU_BIND_ENV: "numa", numa.GPU_INDEX_ENV: "cuda:0"})
    if shutil.which("nvidia-smi") is None:
        with pytest.raises(ValueError, match="no GPU with that UUID"):
            numa.apply_from_env({numa.CPU_BIND_ENV: "numa", numa.GPU_INDEX_ENV: "GPU-bebd79c4-790f"})
