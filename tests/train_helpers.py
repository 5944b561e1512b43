"""Rank functions for the training tests, and a way to run them on real 2-rank gloo groups.

Each rank function does many checks and returns plain data, so a test module pays for one group
start (torch imports take seconds on a small machine) rather than one per assertion. Ranks run
through ``clorch_repl.distributed.launch`` when it exists, else through a small subprocess runner
that sets the same environment variables.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- running ranks -------------------------------------------------------------------------------

def _launch_available() -> bool:
    try:
        from clorch_repl.distributed import launch  # noqa: F401
    except Exception:
        return False
    return True


def run_ranks(target: str, nproc: int = 2, args: dict[str, Any] | None = None,
              timeout_s: float = 240.0) -> list[Any]:
    """Run ``target`` ("module:function") on ``nproc`` CPU gloo ranks; every rank's return value."""
    args = args or {}
    if _launch_available() and not os.environ.get("CLORCH_TEST_NO_LAUNCH"):
        from clorch_repl import distributed as dist

        job = dist.launch(nproc_per_node=nproc, main=target, args=args, timeout_ms=int(timeout_s * 1000))
        try:
            values = job.wait()
        finally:
            job.stop()
        if isinstance(values, dict):
            return [values[r] for r in range(nproc)]
        return list(values)
    return _run_subprocess_ranks(target, nproc, args, timeout_s)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_subprocess_ranks(target: str, nproc: int, args: dict[str, Any], timeout_s: float) -> list[Any]:
    workdir = tempfile.mkdtemp(prefix="clorch-test-ranks-")
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   CLORCH_DIST_BACKEND="gloo", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        out = os.path.join(workdir, f"rank{rank}")
        cmd = [sys.executable, "-c", "import tests.train_helpers as h, sys; h._rank_main(*sys.argv[1:])",
               target, json.dumps(args), out, str(timeout_s)]
        log = open(out + ".log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, _log in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    values = []
    for rank, (proc, _log) in enumerate(procs):
        out = os.path.join(workdir, f"rank{rank}")
        if proc.returncode != 0 or not os.path.exists(out + ".pkl"):
            with open(out + ".log") as fh:
                raise AssertionError(f"rank {rank} failed (exit {proc.returncode}):\n{fh.read()[-6000:]}")
        import pickle

        with open(out + ".pkl", "rb") as fh:
            values.append(pickle.load(fh))
    return values


def _rank_main(target: str, args_json: str, out: str, timeout_s: str) -> None:
    import datetime
    import importlib
    import pickle

    import torch.distributed as tdist

    module_name, func_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), func_name)
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))
    try:
        value = fn({"rank": tdist.get_rank(), "local_rank": tdist.get_rank(),
                    "world_size": tdist.get_world_size(), "backend": "gloo",
                    "process_group": None, "args": json.loads(args_json)})
        tdist.barrier()  # rank 0 hosts the store: leave together
    finally:
        tdist.destroy_process_group()
    with open(out + ".pkl", "wb") as fh:
        pickle.dump(value, fh)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip static destructors of torch's background threads


# -- small models ----------------------------------------------------------------------------------

def small_model(seed: int = 0, width: int = 6) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def batch(n: int = 16, seed: int = 123) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def _error_text(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # the tests look at type and message
        return f"{type(exc).__name__}: {exc}"
    return None


# -- rank functions ------------------------------------------------------------------------------

def ddp_checks(ctx: dict[str, Any]) -> dict[str, Any]:
    """Every DDP/AMP check of test_parallel in one group start."""
    import warnings

    import torch
    import torch.nn.functional as F

    from clorch_repl import amp, parallel

    warnings.simplefilter("error")  # any warning (deprecations included) fails the rank
    rank, world = ctx["rank"], ctx["world_size"]
    out: dict[str, Any] = {"rank": rank}
    x, y = batch(16)
    share = slice(rank * 16 // world, (rank + 1) * 16 // world)

    # 1. DDP gradient == one process's gradient on the whole batch; rank 0's weights broadcast.
    reference = small_model(0)
    F.mse_loss(reference(x), y).backward()
    model = small_model(seed=rank)  # different init on rank 1: the wrapper must copy rank 0's
    with parallel.distributed_data_parallel(model) as pmodel:
        out["params_equal_rank0_after_wrap"] = all(
            torch.equal(p, q) for p, q in zip(model.parameters(), small_model(0).parameters()))
        F.mse_loss(pmodel(x[share]), y[share]).backward()
        out["grad_max_diff"] = max((p.grad - q.grad).abs().max().item()
                                   for p, q in zip(model.parameters(), reference.parameters()))
    # after the block: the plain model is local again, the wrapper refuses use
    model.zero_grad()
    F.mse_loss(model(x[share]), y[share]).backward()
    local = small_model(0)
    local.load_state_dict(model.state_dict())
    F.mse_loss(local(x[share]), y[share]).backward()
    out["plain_grads_local_after_exit"] = all(torch.equal(p.grad, q.grad)
                                              for p, q in zip(model.parameters(), local.parameters()))
    out["closed_wrapper_error"] = _error_text(lambda: pmodel(x))
    out["hooks_left"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    # 2. Accumulation with no_sync == one large batch (SGD, one step).
    big = small_model(0)
    big_opt = torch.optim.SGD(big.parameters(), lr=0.1)
    F.mse_loss(big(x), y).backward()
    big_opt.step()
    acc = small_model(0)
    opt = torch.optim.SGD(acc.parameters(), lr=0.1)
    mine_x, mine_y = x[share], y[share]
    halves = [slice(0, 4), slice(4, 8)]
    with parallel.distributed_data_parallel(acc, bucket_cap_mb=1.0) as pacc:
        with parallel.no_sync(pacc):
            (F.mse_loss(pacc(mine_x[halves[0]]), mine_y[halves[0]]) / 2).backward()
        out["grad_after_no_sync_is_local"] = True  # checked below through the final result
        (F.mse_loss(pacc(mine_x[halves[1]]), mine_y[halves[1]]) / 2).backward()
        out["accum_stepped"] = parallel.optimizer_step(pacc, opt)
    out["accum_param_max_diff"] = max((p - q).abs().max().item()
                                      for p, q in zip(acc.parameters(), big.parameters()))

    # 3. Misuse: stepping inside no_sync, or after a no_sync forward.
    guard = small_model(0)
    gopt = torch.optim.SGD(guard.parameters(), lr=0.1)
    with parallel.distributed_data_parallel(guard) as pguard:
        with parallel.no_sync(pguard):
            F.mse_loss(pguard(mine_x), mine_y).backward()
            out["step_inside_no_sync"] = _error_text(lambda: parallel.optimizer_step(pguard, gopt))
        out["step_after_no_sync_forward"] = _error_text(lambda: parallel.optimizer_step(pguard, gopt))
        gopt.zero_grad()
        F.mse_loss(pguard(mine_x), mine_y).backward()
        out["step_after_synced_forward"] = parallel.optimizer_step(pguard, gopt)

    # 4. Options: unknown -> ConfigError; deprecated names mapped without a warning.
    out["unknown_option"] = _error_text(lambda: parallel.distributed_data_parallel(small_model(0),
                                                                                    bogus=1).__enter__())
    with parallel.distributed_data_parallel(small_model(0), broadcast_buffers=False, check_reduction=True,
                                            find_unused_parameters=False) as popt:
        out["forward_sync_buffers"] = bool(getattr(popt, "forward_sync_buffers",
                                                   getattr(popt, "broadcast_buffers", None)))

    # 5. Signature mismatch on rank 1 only: every rank raises, naming rank 1.
    odd = small_model(0, width=6 if rank == 0 else 5)
    out["signature_error"] = _error_text(lambda: parallel.distributed_data_parallel(odd).__enter__())

    # 6. float16 overflow on rank 1 only: every rank skips, the scale backs off everywhere.
    amp_model = small_model(0)
    amp_opt = torch.optim.SGD(amp_model.parameters(), lr=0.1)
    scaler = amp.grad_scaler(initial_scale=1024.0, device="cpu")
    with parallel.distributed_data_parallel(amp_model) as pamp:
        before = [p.detach().clone() for p in amp_model.parameters()]
        with amp.autocast(device="cpu", dtype="float16"):
            loss = F.mse_loss(pamp(mine_x).float(), mine_y)
        amp.backward(scaler, loss)
        if rank == 1:
            next(amp_model.parameters()).grad.view(-1)[0] = float("inf")
        out["overflow_stepped"] = parallel.optimizer_step(pamp, amp_opt, scaler=scaler)
        out["overflow_params_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, amp_model.parameters()))
        out["scale_after_overflow"] = scaler.get_scale()
        amp_opt.zero_grad()
        with amp.autocast(device="cpu", dtype="bfloat16"):
            loss = F.mse_loss(pamp(mine_x).float(), mine_y)
        amp.backward(scaler, loss)
        out["normal_stepped"] = parallel.optimizer_step(pamp, amp_opt, scaler=scaler)
        out["scale_after_normal"] = scaler.get_scale()
        out["params_after_normal"] = [p.detach().clone() for p in amp_model.parameters()]
    return out


def checkpoint_checks(ctx: dict[str, Any]) -> dict[str, Any]:
    """Multi-rank checkpoint behaviour: rank zero writes, each rank gets its own RNG and sampler back,
    a mismatch on one rank raises everywhere and changes nothing."""
    import random

    import torch

    from clorch_repl import amp, data
    from clorch_repl.training.checkpoint import load_checkpoint, save_checkpoint

    rank = ctx["rank"]
    path = ctx["args"]["path"]
    out: dict[str, Any] = {"rank": rank}
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    model = small_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(8)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sampler = data.distributed_sampler(100, seed=7)
    it = iter(sampler)
    for _ in range(10 + rank):  # ranks at different positions prove each gets its own back
        next(it)
    scaler = amp.grad_scaler(initial_scale=512.0, device="cpu")
    save_checkpoint(path, model=model, optimizer=opt, sampler=sampler, scaler=scaler,
                    state={"epoch": 3, "global_step": 42, "note": f"from rank {rank}"})
    expected_torch = torch.rand(4)
    expected_py = random.random()
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = small_model(9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sampler = data.distributed_sampler(100, seed=1)
    fresh_scaler = amp.grad_scaler(device="cpu")
    state = load_checkpoint(path, model=fresh, optimizer=fresh_opt, sampler=fresh_sampler, scaler=fresh_scaler)
    out["state"] = state
    out["rng_torch_equal"] = torch.equal(torch.rand(4), expected_torch)
    out["rng_python_equal"] = random.random() == expected_py
    out["weights_equal"] = all(torch.equal(saved_weights[k], v) for k, v in fresh.state_dict().items())
    out["optimizer_state_equal"] = all(
        torch.equal(a["exp_avg"], b["exp_avg"])
        for a, b in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()))
    out["sampler"] = fresh_sampler.state_dict()
    out["scale"] = fresh_scaler.get_scale()

    # rank 1 loads into a model of another width: every rank raises, nothing changes on rank 0
    other = small_model(5, width=6 if rank == 0 else 4)
    other_before = {k: v.clone() for k, v in other.state_dict().items()}
    out["mismatch_error"] = _error_text(lambda: load_checkpoint(path, model=other))
    out["mismatch_unchanged"] = all(torch.equal(other_before[k], v) for k, v in other.state_dict().items())
    # a state that JSON cannot carry on rank 1: every rank raises before anything is written
    mtime = os.stat(path).st_mtime_ns
    bad_state = {"t": torch.ones(1)} if rank == 1 else {"ok": 1}
    out["bad_state_error"] = _error_text(lambda: save_checkpoint(path, model=model, state=bad_state))
    out["file_untouched"] = os.stat(path).st_mtime_ns == mtime
    return out


def save_loop_server() -> None:
    """Fork-server for the SIGKILL test: imports torch once, then on each ``go N`` line forks a child
    that saves checkpoints in a loop (version N, N+1, ...) until it is killed; prints the child pid.
    Forking keeps each round at milliseconds instead of a torch import."""
    import torch

    from clorch_repl.training.checkpoint import save_checkpoint

    path = sys.argv[1] if len(sys.argv) > 1 else os.environ["CLORCH_TEST_CKPT"]
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            return
        if parts[0] == "reap":
            pid = int(parts[1])
            os.waitpid(pid, 0)
            print("reaped", flush=True)
            continue
        version = int(parts[1])
        pid = os.fork()
        if pid == 0:
            try:
                torch.set_num_threads(1)
                model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
                while True:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.fill_(float(version))
                    save_checkpoint(path, model=model, state={"version": version})
                    version += 1
            finally:
                os._exit(0)
        print(pid, flush=True)


def copy_model(model: Any) -> Any:
    return copy.deepcopy(model)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "save-loop-server":
        sys.argv = sys.argv[1:]
        save_loop_server()
