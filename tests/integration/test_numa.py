"""clorch_repl.kernel.numa: a rank binding itself at start. Cpulists and a GPU's NUMA cores, without
processes: tests/unit/test_numa_units.py.

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

from clorch_repl.kernel import numa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = sorted(os.sched_getaffinity(0))


def run_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=child_env, cwd=ROOT)


# The child below stands in for a GPU: numa._cpus_for_gpu (GPU index -> its node's CPUs, which
# needs a GPU's sysfs entry) is replaced by one returning the CPUs the test chose. Everything after
# it, the intersection with the real affinity and sched_setaffinity on every thread, is real.
BIND_CHILD = """
    import json, os, sys, threading, time
    from clorch_repl.kernel import numa
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
