"""Real gloo ranks (plain processes, no kernels) that hang on purpose; each answers the probe from
a second thread while its main thread is blocked, exactly as a rank's control thread does, and
hands the answer back as JSON. The analysis tests run on these recorded answers.

With ``nccl`` as the sixth argument (a CUDA machine, ``CUDA_VISIBLE_DEVICES`` set per rank) the
same scenarios run on NCCL: its collectives return at once, so a rank then blocks where it needs
the result (``.item()``), as a training step does."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

#: Seconds the probe thread waits before reading: every rank is where the scenario leaves it.
SETTLE_S = 1.5
#: "evicted": the second group's collectives, past the recorder size the test gives that scenario
EVICTING_CALLS = 100


def load_batch() -> None:
    time.sleep(4)


def scenario(name: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)                       # #2: every rank (the group's barrier is #1)
    if name == "skip":                        # rank 1 skips all_reduce #3 and loads a batch
        if rank == 1:
            load_batch()
        else:
            dist.all_reduce(t)
            t.sum().item()                    # NCCL: where the rank waits for the result
    elif name == "sizes":                     # NCCL: all_reduce #3 with different sizes
        u = torch.ones(4 if rank == 0 else 1 << 20, device=device)
        dist.all_reduce(u)
        u.sum().item()
    elif name == "mismatch":                  # broadcast #3 with a different size on rank 1
        dist.broadcast(torch.ones(4 if rank == 0 else 8), 0)
        if rank == 0:                         # #4: all_reduce on rank 0, broadcast on rank 1
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), 0)
    elif name == "mismatch3":                 # #3: broadcast on rank 0, all_reduce on the others
        if rank == 0:
            dist.broadcast(torch.ones(4), 0)
        else:
            dist.all_reduce(torch.ones(4))
    elif name == "subgroup":                  # group of ranks 0, 1: rank 1 is late; rank 2 is no member
        sub = dist.new_group([0, 1])
        if rank == 0:
            dist.all_reduce(torch.ones(2), group=sub)
        elif rank == 1:
            load_batch()
    elif name == "evicted":                   # rank 1 skips all_reduce #3 while a thread on each
        other = dist.new_group([0, 1])        # rank floods a second group past the recorder's size
        flood = threading.Thread(target=lambda: [dist.all_reduce(torch.ones(1), group=other)
                                                 for _ in range(EVICTING_CALLS)])
        flood.start()
        if rank == 0:
            dist.all_reduce(t)
        else:
            flood.join()
            load_batch()
    elif name == "p2p_skip":                  # two sends from rank 0 to rank 1, all_reduce #3, then
        for _ in range(2):                    # rank 1 skips #4: gloo's group status numbers the sends
            if rank == 0:                     # too (#3 is operation 5, #4 operation 6)
                dist.send(torch.ones(8), 1)
            else:
                dist.recv(torch.empty(8), 0)
        dist.all_reduce(t)
        if rank == 1:
            load_batch()
        else:
            dist.all_reduce(t)
    elif name == "compute":                   # nothing pending: every rank computes
        end = time.monotonic() + 3
        while time.monotonic() < end:
            sum(range(1000))


def main() -> None:
    name, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
    from clorch_repl.diagnosis import probe, record
    from clorch_repl.wire.probe import ProbeRequest

    record.enable()
    import torch
    import torch.distributed as dist

    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=4 if backend == "gloo" else 30), **kwargs)
    dist.barrier()

    def answer() -> None:
        time.sleep(SETTLE_S)
        with open(out + ".tmp", "w") as fh:
            json.dump(probe.answer(ProbeRequest()), fh)
        os.replace(out + ".tmp", out)
        if backend == "nccl":
            # A blocked NCCL rank waits until the watchdog aborts it; the answer is all we need.
            os._exit(0)

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    try:
        scenario(name, rank)
    except RuntimeError:
        pass  # the group's timeout ends the ranks that waited
    answering.join(60)
    os._exit(0)  # gloo's teardown of a timed-out group can block; nothing is left to flush


def record(name: str, world: int, out_dir: str, backend: str = "gloo", env: dict | None = None) -> list:
    """Run scenario ``name`` on ``world`` real ranks (this file as a script, one process each;
    with ``nccl`` one GPU each) and return their answers as the probe gave them while the ranks
    were blocked, one ``RankEvidence`` per rank. The tests' way to get recorded answers. ``env``:
    more variables for the ranks (a smaller flight recorder, say)."""
    import subprocess

    from clorch_repl.diagnosis.analyse import RankEvidence
    from clorch_repl.common.procs import free_port

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in [os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")] if p)
    port = str(free_port())
    outs = [os.path.join(out_dir, f"{backend}-{name}-{r}.json") for r in range(world)]
    procs = []
    try:
        for r in range(world):
            rank_env = dict(os.environ, PYTHONPATH=path, **(env or {}))
            if backend == "nccl":
                rank_env["CUDA_VISIBLE_DEVICES"] = str(r)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), name, str(r), str(world),
                                           port, outs[r], backend], env=rank_env))
        for p in procs:
            assert p.wait(timeout=60 if backend == "gloo" else 90) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    states = []
    for r, out in enumerate(outs):
        with open(out) as fh:
            states.append(RankEvidence(r, answer=json.load(fh)))
    return states


if __name__ == "__main__":
    main()


# ------------------------------------------------------------------ launch() job targets
def job_skips_barrier(ctx: dict) -> None:
    """A launch() main: rank 1 skips the barrier and sits in its data loading."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(16))
    if ctx["rank"] == 1:
        load_batch_forever()
    else:
        dist.barrier()


def load_batch_forever() -> None:
    while True:
        time.sleep(0.2)
