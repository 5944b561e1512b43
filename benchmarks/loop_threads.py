"""Where a launch-bound training loop's time goes in a rank, beside the same loop under torchrun.

    python benchmarks/loop_threads.py [--nproc 2] [--rounds 3] [--epochs 8] [--start-args "--spares 0"]
                                      [--torchrun-one-gpu] [--plain-ipykernel] [--py-spy DIR [--native]]

The loop is the example's (``clorch_repl.examples.distributed_training.train``: a tiny MLP, a
``loss.item()`` every micro-step) with ``benchmarks/training.py``'s options for its launch-bound
case (``LAUNCH_LOOP``: no checkpoint; before 2026-12-01 this harness left the example's default,
a checkpoint written and fsynced every 8 steps, inside the timed loop). Each
round runs it in a ``%%distributed`` cell of a real notebook kernel and in a torchrun launch (who
goes first alternates), and both sides report, measured inside rank 0 around the loop itself:
steps per second; the CPU time (clock ticks, 10 ms each) and the voluntary/involuntary context
switches of every thread of the process, from ``/proc/self/task``; and the time spent in Python's
garbage collector (``gc.callbacks``). A thread that takes CPU or the GIL from the loop shows there,
so the comparison says whether the rank's own threads (ipykernel's control, IOPub and heartbeat
threads, clorch's watchdog) cost the loop anything, rather than inferring it from rates that swing
from round to round. To test one difference between the two sides at a time:
``CLORCH_FLIGHT_RECORDER=0`` in the environment turns the ranks' recording off (torchrun's workers
keep torch's default), and ``--torchrun-one-gpu`` shows each torchrun worker only its own GPU. ``--plain-ipykernel`` adds a third
side: plain ipykernels without clorch_repl, one per rank under torchrun, driven over jupyter_client,
which tells what running the loop in a kernel costs apart from what clorch adds to the kernel. ``--py-spy DIR`` samples rank
0's Python stacks during each loop on both sides (py-spy on PATH) and prints the frames whose share
of the samples differs most between the sides: where the rank's main thread spends what it does
not spend under torchrun.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _threads() -> dict[str, tuple[str, int, int, int]]:
    """tid -> (name, CPU ticks, voluntary, involuntary context switches) of this process's threads."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/self/task/{tid}/status") as fh:
                switches = [int(line.split()[1]) for line in fh if "ctxt_switches" in line]
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(tid) or stat[stat.index("(") + 1:stat.rindex(")")]
        out[tid] = (name, int(fields[11]) + int(fields[12]), switches[0], switches[1])
    return out


#: Set to 1 (``--native``) for profiles with C/C++ frames; read in each side's process.
NATIVE_ENV = "LOOP_THREADS_NATIVE"


def _start_profile(output: str) -> subprocess.Popen | None:
    """py-spy sampling this process's Python stacks into ``output`` (collapsed form), or None without py-spy.

    ``--nonblocking`` reads the stacks without stopping the process, so the profile does not slow
    the loop it describes; idle threads are left out, so what shows is where CPU went.
    """
    import shutil
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not on PATH: no profile", file=sys.stderr)
        return None
    try:  # Yama's ptrace_scope 1 lets only a process's ancestors read it; py-spy is its child
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError) as exc:
        print(f"could not allow py-spy to read this process ({exc}); it may fail", file=sys.stderr)
    # --native (NATIVE_ENV=1) unwinds C/C++ frames too, which needs the process stopped for each sample
    mode = ["--native"] if os.environ.get(NATIVE_ENV) == "1" else ["--nonblocking"]
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", "250", "--format", "raw", *mode,
                             "--output", output], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches before the loop starts
    return proc


def _stop_profile(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.send_signal(2)  # py-spy writes its file on SIGINT
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if proc.returncode:
        print(f"py-spy exited {proc.returncode}: {err.decode(errors='replace')[-1000:]}", file=sys.stderr)


def probe(rank: int, world_size: int, device: Any, epochs: int, profile: str = "") -> dict[str, Any]:
    """Run the loop once in this rank and report what happened around it (see the docstring).

    ``profile``: a file for rank 0's py-spy profile of the loop (``--py-spy``), or empty for none.
    """
    from benchmarks.training import LAUNCH_LOOP
    from clorch_repl.examples.distributed_training import train

    pauses = [0.0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[0] += time.perf_counter() - started[0]

    spy = _start_profile(profile) if profile and rank == 0 else None
    gc.callbacks.append(on_gc)
    try:
        before = _threads()
        record = train(rank, world_size, device, dict(LAUNCH_LOOP, epochs=epochs), log=lambda s: None)
        after = _threads()
    finally:
        gc.callbacks.remove(on_gc)
        _stop_profile(spy)
    threads = {}
    for tid, (name, ticks, vol, invol) in after.items():
        _, t0, v0, i0 = before.get(tid, (name, 0, 0, 0))
        threads[f"{name}#{tid}" if name in {n for t, (n, *_) in after.items() if t != tid} else name] = \
            [ticks - t0, vol - v0, invol - i0]
    return {"steps_per_s": record["global_step"] / record["train_seconds"], "seconds": record["train_seconds"],
            "gc_ms": pauses[0] * 1e3, "threads": threads}


#: Pieces of the code each side runs (formatted with root, one_gpu, epochs, profile, folder).
ONE_GPU = textwrap.dedent("""
    import os, sys
    if {one_gpu!r}:  # as a clorch rank sees it: its own GPU only, as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]
        os.environ["LOCAL_RANK"] = "0"
""")
JOIN = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    from benchmarks.loop_threads import probe
    nccl = torch.cuda.is_available()
    if nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if nccl else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    probe(dist.get_rank(), dist.get_world_size(), device, 1)  # warm-up: the process is new
""")
MEASURE = textwrap.dedent("""
    result = probe(dist.get_rank(), dist.get_world_size(), device, {epochs}, {profile!r})
    if dist.get_rank() == 0:
        print("RESULT", json.dumps(result), flush=True)
""")
TORCHRUN = ONE_GPU + JOIN + MEASURE + "dist.destroy_process_group()\n"
#: A torchrun worker that is a plain ipykernel (no clorch_repl): the third side, ``--plain-ipykernel``,
#: which then runs JOIN and MEASURE as cells.
PLAIN_KERNEL = ONE_GPU + textwrap.dedent("""
    sys.argv = ["ipykernel", "-f", os.path.join({folder!r}, "kernel-%s.json" % os.environ["RANK"])]
    from ipykernel.kernelapp import launch_new_instance
    launch_new_instance()
""")


CELL = ("%%distributed\nimport json, sys\nsys.path.insert(0, {root!r})\nfrom benchmarks.loop_threads import probe\n"
        "result = probe(rank, world_size, device, {epochs}, {profile!r})\nif rank == 0: print('RESULT', json.dumps(result))")


def _result(text: str) -> dict[str, Any]:
    """Rank 0's RESULT line in what a side printed (a notebook's lines carry a rank label first)."""
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def torchrun_round(nproc: int, epochs: int, one_gpu: bool = False, profile: str = "") -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(TORCHRUN.format(root=ROOT, epochs=epochs, one_gpu=one_gpu, profile=profile))
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", fh.name], capture_output=True, text=True)
    finally:
        os.unlink(fh.name)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"torchrun failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def read_profile(path: str) -> tuple[collections.Counter, collections.Counter, int]:
    """py-spy's collapsed stacks -> (samples by innermost frame, samples by any frame, all samples).

    Only the stacks under :func:`probe` count, cut there: what calls it (ipykernel's dispatch and
    IPython's run_cell in a rank, a script's top level under torchrun) differs by construction and
    costs nothing per step; anything else the process sampled is not the loop.
    """
    own: collections.Counter = collections.Counter()
    anywhere: collections.Counter = collections.Counter()
    total = 0
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            cut = [i for i, frame in enumerate(frames) if frame.startswith("probe (")]
            if not cut:
                continue
            frames = frames[cut[0] + 1:] or ["probe itself"]
            total += int(count)
            own[frames[-1]] += int(count)
            for frame in set(frames):
                anywhere[frame] += int(count)
    return own, anywhere, total


def compare_profiles(folder: str, top: int = 25) -> None:
    """Print where rank 0's CPU went on each side, as shares of its samples, the largest differences first."""
    sides = {}
    for side in ("notebook", "torchrun"):
        own, anywhere, total = collections.Counter(), collections.Counter(), 0
        for name in sorted(os.listdir(folder)):
            if name.startswith(side + "-"):
                o, a, t = read_profile(os.path.join(folder, name))
                own.update(o), anywhere.update(a)
                total += t
        sides[side] = (own, anywhere, max(total, 1))
    for label, index in (("innermost frame (self time)", 0), ("anywhere on the stack (inclusive)", 1)):
        print(f"\nrank 0's samples by {label}, % of its samples: notebook / torchrun (samples: "
              f"{sides['notebook'][2]} / {sides['torchrun'][2]})")
        frames = set(sides["notebook"][index]) | set(sides["torchrun"][index])
        share = {f: (100 * sides["notebook"][index][f] / sides["notebook"][2],
                     100 * sides["torchrun"][index][f] / sides["torchrun"][2]) for f in frames}
        for frame in sorted(frames, key=lambda f: -abs(share[f][0] - share[f][1]))[:top]:
            print(f"  {share[frame][0]:6.2f} / {share[frame][1]:6.2f}  {frame}")


def _run_everywhere(clients: list[Any], code: str, timeout_s: float = 600.0) -> str:
    """Execute ``code`` in every kernel at once (collectives need them all) and return what they printed."""
    ids = [c.execute(code) for c in clients]
    text = []
    for client, msg_id in zip(clients, ids):
        reply = client.get_shell_msg(timeout=timeout_s)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = client.get_shell_msg(timeout=timeout_s)
        while True:
            msg = client.get_iopub_msg(timeout=timeout_s)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                text.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                text.append("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"a plain ipykernel failed: {''.join(text)[-2000:]}")
    return "".join(text)


def plain_ipykernel_round(nproc: int, epochs: int, one_gpu: bool = False, profile: str = "") -> dict[str, Any]:
    """The loop in plain ipykernels (no clorch_repl) that torchrun started, one per rank, driven
    over jupyter_client: what a kernel costs the loop, apart from what clorch adds to one."""
    import shutil
    from jupyter_client import BlockingKernelClient

    folder = tempfile.mkdtemp(prefix="loop-ipykernel-")
    script = os.path.join(folder, "kernel.py")
    with open(script, "w") as fh:
        fh.write(PLAIN_KERNEL.format(one_gpu=one_gpu, folder=folder))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    clients: list[Any] = []
    try:
        for rank in range(nproc):
            path = os.path.join(folder, f"kernel-{rank}.json")
            deadline = time.monotonic() + 120
            while True:
                try:
                    with open(path) as fh:
                        if "key" in json.load(fh):
                            break
                except (OSError, ValueError):  # not written yet, or half written
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"plain ipykernel {rank} did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
            client = BlockingKernelClient()
            client.load_connection_file(path)
            client.start_channels()
            client.wait_for_ready(timeout=120)
            clients.append(client)
        _run_everywhere(clients, JOIN.format(root=ROOT))
        out = _run_everywhere(clients, MEASURE.format(epochs=epochs, profile=profile))
        return _result(out)
    finally:
        for client in clients:
            client.shutdown()
            client.stop_channels()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        shutil.rmtree(folder, ignore_errors=True)


def summary(side: str, result: dict[str, Any]) -> str:
    threads = result["threads"]
    main = threads.get("MainThread", [0, 0, 0])
    others = {name: v for name, v in threads.items() if name != "MainThread" and v[0] > 0}
    busy = ", ".join(f"{name} {v[0]} ticks" for name, v in sorted(others.items(), key=lambda kv: -kv[1][0]))
    return (f"{side:<10} {result['steps_per_s']:7.1f} steps/s  loop {result['seconds']:.2f} s  gc {result['gc_ms']:.1f} ms  "
            f"main thread {main[0]} ticks, switches {main[1]} voluntary / {main[2]} involuntary; "
            f"other threads with CPU: {busy or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--start-args", default="", help="more options for %%clorch start")
    parser.add_argument("--torchrun-one-gpu", action="store_true",
                        help="give each torchrun worker only its own GPU (CUDA_VISIBLE_DEVICES), as clorch's ranks have")
    parser.add_argument("--py-spy", metavar="DIR", default="", dest="py_spy",
                        help="profile rank 0's loop on both sides with py-spy (on PATH) into DIR, and compare them")
    parser.add_argument("--plain-ipykernel", action="store_true", dest="plain",
                        help="a third side each round: plain ipykernels (no clorch_repl) under torchrun")
    parser.add_argument("--native", action="store_true",
                        help="with --py-spy: C/C++ frames too (py-spy stops the process for each sample)")
    args = parser.parse_args()
    if args.native:
        os.environ[NATIVE_ENV] = "1"  # both sides inherit it: the notebook kernel's ranks and torchrun
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
        args.py_spy = os.path.abspath(args.py_spy)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from notebook_kernel import NotebookKernel

    nb = NotebookKernel()
    ratios: list[float] = []
    plain_ratios: list[float] = []
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        start = nb.run(f"%clorch start --nproc {args.nproc} {args.start_args}".rstrip(), timeout=300)
        assert start.status == "ok", start.text
        assert nb.run(CELL.format(root=ROOT, epochs=1, profile=""), timeout=300).status == "ok"  # warm-up
        for i in range(args.rounds):
            got = {}
            sides = ["notebook", "torchrun"] + (["ipykernel"] if args.plain else [])
            for side in (sides if i % 2 == 0 else sides[::-1]):
                profile = os.path.join(args.py_spy, f"{side}-{i + 1}.txt") if args.py_spy else ""
                if side == "torchrun":
                    got[side] = torchrun_round(args.nproc, args.epochs, args.torchrun_one_gpu, profile)
                elif side == "ipykernel":
                    got[side] = plain_ipykernel_round(args.nproc, args.epochs, args.torchrun_one_gpu, profile)
                else:
                    reply = nb.run(CELL.format(root=ROOT, epochs=args.epochs, profile=profile), timeout=600)
                    assert reply.status == "ok", reply.text
                    got[side] = _result(reply.text)
            ratios.append(got["notebook"]["steps_per_s"] / got["torchrun"]["steps_per_s"])
            if args.plain:
                plain_ratios.append(got["ipykernel"]["steps_per_s"] / got["torchrun"]["steps_per_s"])
            print(f"round {i + 1}:")
            for side in [s for s in ("torchrun", "ipykernel", "notebook") if s in got]:
                print("  " + summary(side, got[side]))
        nb.run("%clorch stop")
    finally:
        nb.shutdown()
    print(f"\nnotebook/torchrun steps/s, rank 0: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} rounds")
    if plain_ratios:
        print(f"plain ipykernel/torchrun steps/s, rank 0: median {statistics.median(plain_ratios):.3f} "
              f"[{min(plain_ratios):.3f}-{max(plain_ratios):.3f}]")
    if args.py_spy:
        compare_profiles(args.py_spy)


if __name__ == "__main__":
    main()
