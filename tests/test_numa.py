"""clorch_repl.numa: cpulists, a GPU's NUMA cores, and a rank binding itself at start.

Everything runs for real on this machine: sysfs is the machine's own, affinities are changed in
child processes (never in the test process), and the rank kernel is the real worker entry point.
The one stand-in: this machine has no GPU, so where a GPU's cores are needed, the lookup from a
GPU index to its NUMA node's CPUs is replaced in the child (said where it happens).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from clorch_repl import numa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PCI = numa.PCI_DEVICES
ALLOWED = sorted(os.sched_getaffinity(0))


def run_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=child_env, cwd=ROOT)


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


# The child below stands in for a GPU: numa._cpus_for_gpu (GPU index -> its node's CPUs, which
# needs a GPU's sysfs entry) is replaced by one returning the CPUs the test chose. Everything after
# it, the intersection with the real affinity and sched_setaffinity on every thread, is real.
BIND_CHILD = """
    import json, os, sys, threading, time
    from clorch_repl import numa
    node_cpus = set(json.loads(sys.argv[1]))
    numa._cpus_for_gpu = lambda index: (node_cpus, "") if index == 3 else (None, "no GPU %d here" % index)
    def allowed_of(tid):
        with open(f"/proc/self/task/{tid}/status") as fh:
            line = next(l for l in fh if l.startswith("Cpus_allowed_list:"))
        return sorted(numa.parse_cpulist(line.split(":", 1)[1]))
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)
    early.start()
    while early.native_id is None:
        time.sleep(0.001)
    before = sorted(os.sched_getaffinity(0))
    bound = numa.apply_cpu_bind(sys.argv[2], int(sys.argv[3]))
    late = threading.Thread(target=stop.wait, daemon=True)
    late.start()
    while late.native_id is None:
        time.sleep(0.001)
    print(json.dumps({"before": before, "bound": sorted(bound) if bound is not None else None,
                      "after": sorted(os.sched_getaffinity(0)),
                      "early_thread": allowed_of(early.native_id), "late_thread": allowed_of(late.native_id)}))
    stop.set()
"""


def bind_in_child(node_cpus: list[int], mode: str = "numa", gpu: int = 3) -> tuple[dict, str]:
    out = run_child(f"import sys; sys.argv[1:] = {[json.dumps(node_cpus), mode, str(gpu)]!r}\n"
                    + textwrap.dedent(BIND_CHILD))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif(len(ALLOWED) < 2, reason="binding to a subset needs at least 2 usable CPUs")
def test_numa_binding_really_changes_the_process_affinity_every_thread_included() -> None:
    subset = ALLOWED[:1]
    result, _ = bind_in_child(subset)
    assert result["before"] == ALLOWED
    assert result["bound"] == subset
    assert result["after"] == subset
    assert result["early_thread"] == subset  # a thread that ran before the binding was rebound
    assert result["late_thread"] == subset  # one started after inherits it


@pytest.mark.skipif(len(ALLOWED) < 2, reason="binding to a subset needs at least 2 usable CPUs")
def test_the_binding_keeps_within_the_cpus_already_allowed() -> None:
    # The node lists a CPU this process may not use (a cgroup's limit, say): only the allowed ones.
    result, _ = bind_in_child([ALLOWED[-1], max(ALLOWED) + 1000])
    assert result["bound"] == result["after"] == [ALLOWED[-1]]


def test_a_node_with_none_of_the_allowed_cpus_leaves_the_process_unbound_and_says_so() -> None:
    result, stderr = bind_in_child([max(ALLOWED) + 1000])
    assert result["bound"] is None
    assert result["after"] == result["before"] == ALLOWED  # never an empty binding
    assert "not bound, none of its node's CPUs" in stderr


def test_mode_none_and_a_cpu_rank_change_nothing() -> None:
    for mode, gpu in (("none", 3), ("numa", 7)):  # 7: no such GPU here
        result, stderr = bind_in_child(ALLOWED[:1], mode=mode, gpu=gpu)
        assert result["bound"] is None and result["after"] == ALLOWED
    assert "no GPU 7 here" in stderr  # why it was not bound
    with pytest.raises(ValueError, match="unknown CPU binding mode 'socket'"):
        numa.apply_cpu_bind("socket", 0)
    assert numa.apply_cpu_bind("numa", None) is None  # a CPU rank: nothing to bind to


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


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: GPU 0 may bind")
def test_a_rank_whose_binding_fails_starts_anyway_and_its_log_says_why(tmp_path) -> None:
    """The real rank entry point (clorch_repl.kernel.app) asked to bind on a machine without
    a GPU: its kernel starts and runs a cell, unbound, and its log (stderr) holds the warning."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = tmp_path / "kernels" / "rank"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "clorch_repl.kernel.app", "-f", "{connection_file}"],
        "display_name": "rank", "language": "python"}))
    log_path = tmp_path / "rank0.log"
    env = dict(os.environ, RANK="0", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               **{numa.CPU_BIND_ENV: "numa", numa.GPU_INDEX_ENV: "0"})
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    km = KernelManager(kernel_name="rank", kernel_spec_manager=specs)
    with open(log_path, "wb") as log:
        km.start_kernel(env=env, stdout=log, stderr=log, cwd=ROOT)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive("import os; print(sorted(os.sched_getaffinity(0)))", timeout=60,
                                       output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    text = log_path.read_text()
    assert "clorch_repl: rank 0: warning: CPU binding 'numa' for GPU 0: not bound" in text
