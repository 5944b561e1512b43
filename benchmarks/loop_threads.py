"""Where a launch-bound training loop's time goes in a rank, beside the same loop under torchrun.

    python benchmarks/loop_threads.py [--nproc 2] [--rounds 3] [--epochs 8] [--start-args "--spares 0"]
                                      [--sides torchrun,notebook,...] [--torchrun-one-gpu]
                                      [--pin CPUS[;CPUS...]] [--py-spy DIR [--native]]

The loop is the example's (``clorch_repl.examples.distributed_training.train``: a tiny MLP, a
``loss.item()`` every micro-step) with ``benchmarks/training.py``'s options for its launch-bound
case (``LAUNCH_LOOP``: no checkpoint; before 2026-12-01 this harness left the example's default,
a checkpoint written and fsynced every 8 steps, inside the timed loop).

**Sides.** Each side is a set of processes, one per rank, that stays up for the whole run; every
round runs the loop once on each side in turn (``--epochs`` epochs; the first side rotates from
round to round), so a machine's drift (clocks, other tenants) falls on all sides alike. The
sides (``--sides``, comma-separated; torchrun is always there, as the baseline):

* ``torchrun``: a script under ``torchrun --standalone`` that waits for the driver between rounds;
* ``notebook``: ``%%distributed`` cells of a clorch session in a real notebook kernel;
  ``notebook:ARGS`` a second session with ``ARGS`` added to its ``%clorch start``;
* ``ipykernel``: plain ipykernels (no clorch_repl) under torchrun, driven over jupyter_client:
  what running the loop in a kernel costs;
* ``rank-kernel``: clorch's rank kernel (``clorch_repl.kernel.app``) under torchrun, without
  the session around it: what clorch adds to the kernel;
* each of the last three with ``+PART`` for any of :data:`PARTS`, one thing a clorch rank does
  in joining its group that torch's defaults do not: ``+env`` (its TORCH_* variables and the
  flight recorder's size), ``+filestore`` (a FileStore rendezvous), ``+device_id`` (the NCCL
  communicator made eagerly), ``+join`` (all of them, through clorch's own ``join_group``).

``--plain-ipykernel`` is short for adding ``ipykernel``. Every side reports, measured inside rank
0 around the loop itself: steps per second; the CPU time (clock ticks, 10 ms each) and the
voluntary/involuntary context switches of every thread of the process, from
``/proc/self/task``; and the time spent in Python's garbage collector (``gc.callbacks``). The
summary gives each side's median rate with its spread, and its ratio to torchrun's rate in the
same round (median, min-max). ``CLORCH_FLIGHT_RECORDER=0`` in the environment turns the ranks'
recording off (torchrun keeps torch's default); ``--pin`` binds every side's rank r to the same
cores during its loops (the others are idle meanwhile), so that placement is alike; ``--torchrun-one-gpu`` shows each torchrun worker
(and kernel) only its own GPU, as a rank sees it. ``--py-spy DIR`` samples rank 0's Python stacks
during each loop (py-spy on PATH) and prints the frames whose share of the samples differs most
between the notebook and torchrun: where the rank's main thread spends what it does not spend
under torchrun.
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
    # Python 3.11 leaves the thread objects' native_id as it was in the parent after a fork (a
    # forked rank's MainThread kept its zygote's), so the calling thread is named by its own id
    names[str(threading.get_native_id())] = threading.current_thread().name
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
#: ``--pin``: one cpulist per rank, ``;``-separated; read in each side's process.
PIN_ENV = "LOOP_THREADS_PIN"


def _pin(rank: int) -> set[int] | None:
    """Bind every thread of this process to rank ``rank``'s CPUs of ``--pin`` for the loop; returns
    the CPUs it could use before (to go back to), or None when not asked. Every side's rank r runs
    on the same cores then, one side after another, so where the scheduler happens to place a
    process is no longer part of the comparison."""
    spec = os.environ.get(PIN_ENV, "")
    if not spec:
        return None
    from clorch_repl.kernel import numa

    lists = spec.split(";")
    if rank >= len(lists):
        raise ValueError(f"--pin {spec!r} names CPUs for {len(lists)} rank(s); rank {rank} has none")
    before = os.sched_getaffinity(0)
    numa._bind_all_threads(numa.parse_cpulist(lists[rank]))
    return before


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
    unpinned = _pin(rank)
    gc.callbacks.append(on_gc)
    try:
        before = _threads()
        record = train(rank, world_size, device, dict(LAUNCH_LOOP, epochs=epochs), log=lambda s: None)
        after = _threads()
    finally:
        gc.callbacks.remove(on_gc)
        _stop_profile(spy)
        if unpinned is not None:
            from clorch_repl.kernel import numa

            numa._bind_all_threads(unpinned)
    threads = {}
    for tid, (name, ticks, vol, invol) in after.items():
        _, t0, v0, i0 = before.get(tid, (name, 0, 0, 0))
        threads[f"{name}#{tid}" if name in {n for t, (n, *_) in after.items() if t != tid} else name] = \
            [ticks - t0, vol - v0, invol - i0]
    return {"steps_per_s": record["global_step"] / record["train_seconds"], "seconds": record["train_seconds"],
            "gc_ms": pauses[0] * 1e3, "threads": threads}


#: Pieces of the code each side runs (formatted with root, one_gpu, folder and the init's options).
ONE_GPU = textwrap.dedent("""
    import os, sys
    if {one_gpu!r}:  # as a clorch rank sees it: its own GPU only, as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]
        os.environ["LOCAL_RANK"] = "0"
""")
JOIN_HEAD = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    from benchmarks.loop_threads import probe
    nccl = torch.cuda.is_available()
""")
#: How torchrun's workers and the kernels form their group: torch's defaults, or with some of the
#: things a clorch rank does differently (``+env``, ``+filestore``, ``+device_id``; see PARTS).
PLAIN_INIT = textwrap.dedent("""
    if nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    kwargs = {{}}
    if {env!r}:
        from clorch_repl.wire.rank_env import world_environment
        os.environ.update((k, v) for k, v in world_environment("nccl", 600.0, base={{}}).items() if k.startswith("TORCH"))
        from clorch_repl.diagnosis import record
        record.enable()
    if {filestore!r}:
        kwargs.update(store=dist.FileStore(os.path.join({folder!r}, "store"), int(os.environ["WORLD_SIZE"])),
                      rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if {device_id!r} and nccl:
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if nccl else "gloo", **kwargs)
""")
#: How a clorch rank forms its group (clorch_repl.kernel.group.join_group: its environment,
#: its private FileStore, the flight recorder's size, device_id), in a process that is not one:
#: the ``+join`` sides, which tell the join's cost apart from the kernel's.
CLORCH_INIT = textwrap.dedent("""
    from clorch_repl.wire.rank_env import world_environment
    os.environ.update(world_environment("nccl" if nccl else "gloo", 600.0,
                                        os.path.join({folder!r}, "store"), base={{}}))
    if not nccl:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as for a CPU rank (ONE_GPU named a GPU there is none of)
    from clorch_repl.kernel.group import join_group
    join_group()
    device = torch.device("cuda", 0) if nccl else torch.device("cpu")
""")
WARM = "probe(dist.get_rank(), dist.get_world_size(), device, 1)  # warm-up: the process is new\n"
#: One burst of the loop, as a cell (rank 0 prints the result); formatted with epochs, profile.
MEASURE = textwrap.dedent("""
    result = probe(dist.get_rank(), dist.get_world_size(), device, {epochs}, {profile!r})
    if dist.get_rank() == 0:
        print("RESULT", json.dumps(result), flush=True)
""")
#: A torchrun worker that stays up between bursts: it waits for the driver's ``cmd-N`` file
#: (``{{"epochs": E, "profile": P}}`` or ``"stop"``) and rank 0 answers in ``res-N.json``.
TORCHRUN_LOOP = textwrap.dedent("""
    import time
    n = 1
    while True:
        path = os.path.join({folder!r}, "cmd-%d" % n)
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path) as fh:
            cmd = json.load(fh)
        if cmd == "stop":
            break
        result = probe(dist.get_rank(), dist.get_world_size(), device, cmd["epochs"], cmd["profile"])
        if dist.get_rank() == 0:
            with open(os.path.join({folder!r}, "res-%d.tmp" % n), "w") as fh:
                json.dump(result, fh)
            os.replace(os.path.join({folder!r}, "res-%d.tmp" % n), os.path.join({folder!r}, "res-%d.json" % n))
        n += 1
    dist.destroy_process_group()
""")
#: A torchrun worker that is a kernel: a plain ipykernel (no clorch_repl), or clorch's rank kernel
#: (clorch_repl.kernel.app, as a session starts it, minus the session around it), driven over
#: jupyter_client; it runs JOIN_HEAD + its init + WARM as one cell, then MEASURE once a burst.
KERNEL_MAINS = {
    "ipykernel": "from ipykernel.kernelapp import launch_new_instance\nlaunch_new_instance()\n",
    "rank-kernel": "from clorch_repl.kernel.app import main\nmain(sys.argv[1:])\n",
}
KERNEL_SCRIPT = ONE_GPU + textwrap.dedent("""
    sys.path.insert(0, {root!r})
    sys.argv = ["kernel", "-f", os.path.join({folder!r}, "kernel-%s.json" % os.environ["RANK"])]
""")
#: What a side's name may add to a torchrun worker or a kernel, each one thing a clorch rank does
#: that torch's defaults do not: ``env`` (its TORCH_* variables and the flight recorder's size),
#: ``filestore`` (the group's store a private FileStore), ``device_id`` (NCCL's communicator made
#: eagerly, bound to the device), ``join`` (all of them, by clorch's own join_group, on one GPU).
PARTS = ("env", "filestore", "device_id", "join")


CELL = ("%%distributed\nimport json, sys\nsys.path.insert(0, {root!r})\nfrom benchmarks.loop_threads import probe\n"
        "result = probe(rank, world_size, device, {epochs}, {profile!r})\nif rank == 0: print('RESULT', json.dumps(result))")


def _result(text: str) -> dict[str, Any]:
    """Rank 0's RESULT line in what a side printed (a notebook's lines carry a rank label first)."""
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def _init_code(parts: set[str], folder: str) -> str:
    init = CLORCH_INIT if "join" in parts else PLAIN_INIT
    return (JOIN_HEAD + init + WARM).format(root=ROOT, folder=folder, env="env" in parts,
                                            filestore="filestore" in parts, device_id="device_id" in parts)


def _torchrun(nproc: int, script: str, **popen: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", script], **popen)


class Side:
    """One way of running the loop, up for the whole run: :meth:`burst` runs it once, :meth:`close` ends it."""

    name = ""

    def burst(self, epochs: int, profile: str) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NotebookSide(Side):
    """``%%distributed`` cells in a real notebook kernel with a clorch session (``start_args`` added)."""

    def __init__(self, name: str, nproc: int, start_args: str) -> None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from notebook_kernel import NotebookKernel

        self.name = name
        self.nb = NotebookKernel()
        try:
            assert self.nb.run("%load_ext clorch_repl").status == "ok"
            start = self.nb.run(f"%clorch start --nproc {nproc} {start_args}".rstrip(), timeout=300)
            assert start.status == "ok", start.text
            assert self.nb.run(CELL.format(root=ROOT, epochs=1, profile=""), timeout=300).status == "ok"  # warm-up
        except BaseException:
            self.nb.shutdown()
            raise

    def burst(self, epochs: int, profile: str) -> dict[str, Any]:
        reply = self.nb.run(CELL.format(root=ROOT, epochs=epochs, profile=profile), timeout=600)
        assert reply.status == "ok", reply.text
        return _result(reply.text)

    def close(self) -> None:
        try:
            self.nb.run("%clorch stop")
        finally:
            self.nb.shutdown()


class TorchrunSide(Side):
    """The workers of one torchrun launch, up for the whole run (see :data:`TORCHRUN_LOOP`)."""

    def __init__(self, name: str, nproc: int, parts: set[str], one_gpu: bool) -> None:
        self.name = name
        self.folder = tempfile.mkdtemp(prefix="loop-torchrun-")
        script = os.path.join(self.folder, "worker.py")
        with open(script, "w") as fh:
            fh.write(ONE_GPU.format(one_gpu=one_gpu or "join" in parts) + _init_code(parts, self.folder)
                     + TORCHRUN_LOOP.format(folder=self.folder))
        self.log = open(os.path.join(self.folder, "torchrun.log"), "w+")  # noqa: SIM115 - closed in close()
        self.proc = _torchrun(nproc, script, stdout=self.log, stderr=subprocess.STDOUT)
        self.n = 0

    def _send(self, cmd: Any) -> None:
        self.n += 1
        tmp = os.path.join(self.folder, "cmd.tmp")
        with open(tmp, "w") as fh:
            json.dump(cmd, fh)
        os.replace(tmp, os.path.join(self.folder, f"cmd-{self.n}"))

    def burst(self, epochs: int, profile: str) -> dict[str, Any]:
        self._send({"epochs": epochs, "profile": profile})
        path = os.path.join(self.folder, f"res-{self.n}.json")
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} ended ({self.proc.returncode}):\n{self.log.read()[-3000:]}")
            time.sleep(0.01)
        with open(path) as fh:
            return json.load(fh)

    def close(self) -> None:
        import shutil

        try:
            if self.proc.poll() is None:
                self._send("stop")
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self.log.close()
            shutil.rmtree(self.folder, ignore_errors=True)


class KernelSide(Side):
    """Kernels that torchrun started, one per rank, driven over jupyter_client: a plain ipykernel
    or clorch's rank kernel without the session around it (:data:`KERNEL_MAINS`), the group
    formed with torch's defaults or with some of :data:`PARTS`. They tell apart what a kernel costs
    the loop, what clorch's kernel adds, and what each part of clorch's way of joining adds."""

    def __init__(self, name: str, nproc: int, kernel: str, parts: set[str], one_gpu: bool) -> None:
        from jupyter_client import BlockingKernelClient

        self.name = name
        self.folder = tempfile.mkdtemp(prefix="loop-kernel-")
        script = os.path.join(self.folder, "kernel.py")
        with open(script, "w") as fh:
            fh.write(KERNEL_SCRIPT.format(root=ROOT, one_gpu=one_gpu or "join" in parts, folder=self.folder)
                     + KERNEL_MAINS[kernel])
        self.proc = _torchrun(nproc, script, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.clients: list[Any] = []
        try:
            for rank in range(nproc):
                path = os.path.join(self.folder, f"kernel-{rank}.json")
                deadline = time.monotonic() + 120
                while True:
                    try:
                        with open(path) as fh:
                            if "key" in json.load(fh):
                                break
                    except (OSError, ValueError):  # not written yet, or half written
                        pass
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: kernel {rank} did not start: "
                                           f"{self.proc.stderr.read().decode()[-2000:]}")
                    time.sleep(0.1)
                client = BlockingKernelClient()
                client.load_connection_file(path)
                client.start_channels()
                client.wait_for_ready(timeout=120)
                self.clients.append(client)
            _run_everywhere(self.clients, _init_code(parts, self.folder))
        except BaseException:
            self.close()
            raise

    def burst(self, epochs: int, profile: str) -> dict[str, Any]:
        return _result(_run_everywhere(self.clients, MEASURE.format(epochs=epochs, profile=profile)))

    def close(self) -> None:
        import shutil

        for client in self.clients:
            client.shutdown()
            client.stop_channels()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def make_side(name: str, nproc: int, start_args: str, one_gpu: bool) -> Side:
    """A side by its name (see the module docstring): ``notebook[:ARGS]``, ``torchrun[+PART...]``,
    ``ipykernel[+PART...]``, ``rank-kernel[+PART...]``."""
    if name == "notebook" or name.startswith("notebook:"):
        return NotebookSide(name, nproc, f"{start_args} {name.partition(':')[2]}".strip())
    base, *parts = name.split("+")
    if base == "torchrun":
        return TorchrunSide(name, nproc, set(parts), one_gpu)
    return KernelSide(name, nproc, base, set(parts), one_gpu)


def parse_sides(text: str) -> list[str]:
    """``--sides``: names as :func:`make_side` reads them; torchrun (the baseline) is always first."""
    sides = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    for name in sides:
        if name == "notebook" or name.startswith("notebook:"):
            continue
        base, *parts = name.split("+")
        if base not in ("torchrun", *KERNEL_MAINS) or any(p not in PARTS for p in parts):
            raise argparse.ArgumentTypeError(
                f"cannot read the side {name!r}: a side is notebook[:START-ARGS], or torchrun, ipykernel or "
                f"rank-kernel, each with +PART for any of {', '.join(PARTS)}")
    return ["torchrun", *(s for s in sides if s != "torchrun")]


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
            raise RuntimeError(f"a kernel failed: {''.join(text)[-2000:]}")
    return "".join(text)


def summary(side: str, result: dict[str, Any]) -> str:
    threads = result["threads"]
    main = threads.get("MainThread", [0, 0, 0])
    others = {name: v for name, v in threads.items() if name != "MainThread" and v[0] > 0}
    busy = ", ".join(f"{name} {v[0]} ticks" for name, v in sorted(others.items(), key=lambda kv: -kv[1][0]))
    return (f"{side:<24} {result['steps_per_s']:7.1f} steps/s  loop {result['seconds']:.2f} s  gc {result['gc_ms']:.1f} ms  "
            f"main thread {main[0]} ticks, switches {main[1]} voluntary / {main[2]} involuntary; "
            f"other threads with CPU: {busy or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8, help="epochs of the loop per side and round")
    parser.add_argument("--start-args", default="", help="more options for %%clorch start (every notebook side)")
    parser.add_argument("--torchrun-one-gpu", action="store_true",
                        help="give each torchrun worker only its own GPU (CUDA_VISIBLE_DEVICES), as clorch's ranks have")
    parser.add_argument("--py-spy", metavar="DIR", default="", dest="py_spy",
                        help="profile rank 0's loop on every side with py-spy (on PATH) into DIR, and compare "
                             "the notebook's with torchrun's")
    parser.add_argument("--sides", default="torchrun,notebook", type=parse_sides,
                        help="the sides, comma-separated (see above): notebook[:START-ARGS], and torchrun, "
                             f"ipykernel or rank-kernel, each with +PART for any of {', '.join(PARTS)}")
    parser.add_argument("--plain-ipykernel", action="store_true", dest="plain",
                        help="add the ipykernel side (as --sides torchrun,notebook,ipykernel)")
    parser.add_argument("--native", action="store_true",
                        help="with --py-spy: C/C++ frames too (py-spy stops the process for each sample)")
    parser.add_argument("--pin", metavar="CPUS[;CPUS...]", default="",
                        help="bind rank r of every side to the r-th cpulist during its loop (e.g. \"2-5;6-9\")")
    args = parser.parse_args()
    if args.pin:
        os.environ[PIN_ENV] = args.pin  # every side inherits it, as NATIVE_ENV
    names = args.sides + (["ipykernel"] if args.plain and "ipykernel" not in args.sides else [])
    if args.native:
        os.environ[NATIVE_ENV] = "1"  # every side inherits it: the notebook kernel's ranks, torchrun's workers
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
        args.py_spy = os.path.abspath(args.py_spy)
    sides: list[Side] = []
    rates: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    try:
        for name in names:
            started = time.monotonic()
            sides.append(make_side(name, args.nproc, args.start_args, args.torchrun_one_gpu))
            print(f"{name}: up and warmed in {time.monotonic() - started:.1f} s", flush=True)
        for i in range(args.rounds):
            got = {}
            shift = i % len(sides)
            for side in sides[shift:] + sides[:shift]:
                safe = "".join(c if c.isalnum() or c in "+-" else "_" for c in side.name)
                profile = os.path.join(args.py_spy, f"{safe}-{i + 1}.txt") if args.py_spy else ""
                got[side.name] = side.burst(args.epochs, profile)
            print(f"round {i + 1} (first: {sides[shift].name}):", flush=True)
            for name in names:
                print("  " + summary(name, got[name]), flush=True)
                rates[name].append(got[name]["steps_per_s"])
                if name != "torchrun":
                    ratios[name].append(got[name]["steps_per_s"] / got["torchrun"]["steps_per_s"])
    finally:
        for side in reversed(sides):
            side.close()
    print(f"\nrank 0's steps/s over {args.rounds} rounds: median [min-max]; against torchrun in the same round")
    for name in names:
        line = f"  {name:<24} {statistics.median(rates[name]):7.1f} [{min(rates[name]):.1f}-{max(rates[name]):.1f}]"
        if name in ratios:
            values = ratios[name]
            line += f"   {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"
        print(line)
    if args.py_spy:
        compare_profiles(args.py_spy)


if __name__ == "__main__":
    main()
