"""Code users bring, unchanged (issue 35), on a real 2-rank gloo session, each compared with what
real torchrun (``python -m torch.distributed.run --nproc-per-node 2``, gloo on the CPU, the same
seed) gives in the same test: pytorch/examples' DDP tutorial (``LOCAL_RANK``-indexed device
code), and Lightning Fabric and Trainer with ``strategy="ddp"``, which refuse an interactive
interpreter (``sys.ps1``). A rank answers "am I interactive?" as torchrun's worker does."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl.common.procs import free_port
from rank_text import lines_of, outputs_shown

pytestmark = pytest.mark.usefixtures("ranks")

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_scripts")


def torchrun(script: str, *args: str) -> dict[int, list[str]]:
    """The script's lines under real torchrun, by rank, each rank's stdout in a file of its own
    (``--redirects 3``: the workers share one pipe otherwise, and two prints interleave).

    torchrun is the baseline here, not what is tested. CI saw workers print their lines and then
    die in torch's own teardown of a gloo group (SIGABRT, "terminate called without an active
    exception"): a Fabric script that left its group undestroyed, and then the DDP tutorial, which
    destroys it, twice in a row on the loaded 2-core box. The lines such a run printed are
    torchrun's numbers all the same, so they are taken when every rank printed, a worker's stderr
    ends with that abort and none shows an error or a traceback (a fresh run saw Fabric's baseline
    abort so three times in a row). Any other failure is tried again, up to three runs."""
    failures = []
    for _ in range(3):
        found, failure, teardown_only = _torchrun_once(script, *args)
        if failure is None or (teardown_only and all(found.values())):
            return found
        failures.append(failure)
    raise AssertionError("\n\n".join(failures))


#: what a worker's stderr holds when torch's teardown of its gloo group aborts the process after
#: the script's end (a C++ thread object destroyed while still joinable)
TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun_once(script: str, *args: str) -> tuple[dict[int, list[str]], str | None, bool]:
    """(lines by rank, why the run failed or None, whether the failure was only the teardown
    abort in the workers: see :func:`torchrun`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORCH_")}
    logs = tempfile.mkdtemp(prefix="torchrun-logs-")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "--log-dir", logs, "--redirects", "3",
                          os.path.join(SCRIPTS, script), *args], capture_output=True, text=True, timeout=300, env=env)
    found = {}
    for r in (0, 1):
        paths = glob.glob(os.path.join(logs, "*", "attempt_0", str(r), "stdout.log"))
        assert len(paths) == 1, (paths, out.stdout, out.stderr)
        with open(paths[0]) as fh:
            found[r] = [line for line in fh.read().splitlines() if " rank " in f" {line}"]
    if out.returncode == 0:
        return found, None, False
    said = {path: open(path).read()[-3000:] for path in glob.glob(os.path.join(logs, "*", "attempt_0", "*",
                                                                            "stderr.log"))}
    # the abort is a worker's last word, and no worker raised (the script's own log lines, such as
    # Lightning's "Seed set to 7", come before it)
    teardown_only = (any(text.rstrip().endswith(TEARDOWN_ABORT) for text in said.values())
                     and not any("Traceback" in text or "Error" in text for text in said.values()))
    return found, (f"torchrun failed ({out.returncode}): {out.stderr[-2000:]}\nranks' stderr: {said}\n"
                   f"stdout: {found}"), teardown_only


def clorch(ip: Any, line: str) -> tuple[Any, Any]:
    with capture_output() as cap:
        result = ip.run_cell(line)
    return result, cap


def test_a_rank_is_not_interactive_to_libraries_and_ipython_still_works(ip: Any, tmp_path: Any) -> None:
    res, cap = clorch(ip, "%%distributed\nimport sys, __main__\n"
                          "print(hasattr(sys, 'ps1'), hasattr(sys, 'ps2'), sys.flags.interactive, "
                          "hasattr(__main__, '__file__'))\nrank * 10 + 1")
    assert res.success, cap.stdout + cap.stderr
    for r in (0, 1):  # torchrun's worker: no prompts, not -i; a cell has no file
        assert lines_of(cap.stdout, r) == ["False False 0 False"], cap.stdout
    shown = sorted(o.data["text/plain"] for o in outputs_shown(cap.outputs))
    assert shown == ["[rank 0] 1", "[rank 1] 11"]  # IPython's displayhook
    script = tmp_path / "asks.py"
    script.write_text("import sys, __main__\nprint('script', hasattr(sys, 'ps1'), __main__.__file__ == __file__)\n")
    res, cap = clorch(ip, f"%clorch run {script}")
    assert res.success and all(lines_of(cap.stdout, r) == ["script False True"] for r in (0, 1)), cap.stdout


def test_local_rank_indexed_device_code_reaches_the_ranks_device(ip: Any) -> None:
    """The idioms of torchrun scripts name the rank's own device; on CPU ranks that is the CPU
    (no GPU here: the GPU side is tests/gpu and tests/unit/test_gpu_convention.py)."""
    code = ("import os, torch\nlr = int(os.environ['LOCAL_RANK'])\n"
            "dev = torch.device(f'cuda:{lr}' if torch.cuda.is_available() else 'cpu')\n"
            "print(lr == local_rank == rank, os.environ['LOCAL_WORLD_SIZE'], dev == device, "
            "torch.ones(2).to(dev).device == device, os.environ['CUDA_VISIBLE_DEVICES'] == '')")
    res, cap = clorch(ip, "%%distributed\n" + code)
    assert res.success, cap.stdout + cap.stderr
    assert all(lines_of(cap.stdout, r) == ["True 2 True True True"] for r in (0, 1)), cap.stdout
    # FSDP2's example: init_process_group(device_id=device) with the rank's own (CPU) device
    res, cap = clorch(ip, "%%distributed\nimport torch.distributed as dist\n"
                          "dist.init_process_group('gloo', device_id=device)\nprint('kept', dist.get_world_size())")
    assert res.success and all(lines_of(cap.stdout, r) == ["kept 2"] for r in (0, 1)), cap.stdout + cap.stderr


def test_the_ddp_tutorial_gives_torchruns_numbers(ip: Any) -> None:
    expected = torchrun("ddp_tutorial.py", "3")
    assert all(len(expected[r]) == 1 and "device cpu" in expected[r][0] for r in (0, 1)), expected
    res, cap = clorch(ip, f"%clorch run {os.path.join(SCRIPTS, 'ddp_tutorial.py')} 3")
    assert res.success, cap.stdout + cap.stderr
    # the script's own lines (the rank also says, once, that its destroy_process_group() kept the group)
    assert {r: [x for x in lines_of(cap.stdout, r) if x.startswith("rank ")] for r in (0, 1)} == expected


def test_lightning_fabric_ddp_runs_with_torchruns_numbers(ip: Any) -> None:
    expected = torchrun("lightning_fabric.py")
    assert all(len(expected[r]) == 1 for r in (0, 1)), expected
    res, cap = clorch(ip, f"%clorch run {os.path.join(SCRIPTS, 'lightning_fabric.py')}")
    assert res.success, cap.stdout + cap.stderr
    assert {r: [x for x in lines_of(cap.stdout, r) if x.startswith("fabric")] for r in (0, 1)} == expected
    with open(os.path.join(SCRIPTS, "lightning_fabric.py")) as fh:  # pasted into a cell: the same
        source = fh.read()
    pasted = source.replace("main(*sys.argv[1:3])", "main()")  # a cell's sys.argv is the kernel's
    assert pasted != source
    res, cap = clorch(ip, "%%distributed\n" + pasted)
    assert res.success, cap.stdout + cap.stderr
    assert {r: [x for x in lines_of(cap.stdout, r) if x.startswith("fabric")] for r in (0, 1)} == expected


def test_lightning_trainer_ddp_runs_with_torchruns_numbers(ip: Any, tmp_path: Any) -> None:
    expected = torchrun("lightning_trainer.py", str(tmp_path / "torchrun"))
    assert all(len(expected[r]) == 1 for r in (0, 1)), expected
    res, cap = clorch(ip, f"%clorch run {os.path.join(SCRIPTS, 'lightning_trainer.py')} {tmp_path / 'clorch'}")
    assert res.success, cap.stdout + cap.stderr
    assert {r: [x for x in lines_of(cap.stdout, r) if x.startswith("trainer")] for r in (0, 1)} == expected
    with open(os.path.join(SCRIPTS, "lightning_trainer.py")) as fh:  # pasted into a cell: the same
        source = fh.read()
    pasted = source.replace("main(sys.argv[1])", f"main({str(tmp_path / 'cell')!r})")  # a cell's argv is the kernel's
    assert pasted != source
    res, cap = clorch(ip, "%%distributed\n" + pasted)
    assert res.success, cap.stdout + cap.stderr
    assert {r: [x for x in lines_of(cap.stdout, r) if x.startswith("trainer")] for r in (0, 1)} == expected
    res, cap = clorch(ip, "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
                          "dist.all_reduce(t)\nprint('after', t.item())")  # the session's group still works
    assert res.success and all(lines_of(cap.stdout, r) == ["after 2.0"] for r in (0, 1)), cap.stdout
