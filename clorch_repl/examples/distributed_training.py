"""DDP or FSDP2 training with gradient accumulation, mixed precision and resumable checkpoints.

``run_local([0, 1])`` launches one rank per device with :func:`clorch_repl.distributed.launch`,
each running :func:`train_worker`: a small regression MLP trained on synthetic data (generated
from the seed, identically on every rank) with DDP, the distributed sampler, ``no_sync``
accumulation, autocast (and a loss scaler for float16) and a checkpoint after every epoch.

``strategy="fsdp"`` shards the same model with FSDP2 instead (``fully_shard`` per layer and at the
root; bfloat16 and float16 through its ``MixedPrecisionPolicy`` rather than autocast) and saves
sharded checkpoints (a folder, every rank writing its shards) that it resumes from.

On a machine without a GPU, ``devices`` only sets the number of ranks: ``run_local([0, 1])`` runs
two CPU ranks joined with gloo, so the example runs anywhere (on CPU, bfloat16 and float16 autocast
are torch's CPU autocast). With GPUs, each rank gets its device and the ranks use NCCL.

``train`` is the loop itself, usable from a ``%%distributed`` cell, a ``torchrun`` script or a
launched worker alike (the notebook and the benchmark use it).

It lives inside the package (not in the repository's ``examples/`` folder) because launched ranks
and notebook kernels import it by name: a kernel that JupyterLab started in ``notebooks/``, or a
notebook copied elsewhere, finds it wherever the package is installed.
``python -m clorch_repl.examples.distributed_training`` and ``examples/distributed_training.py``
run :func:`main`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler

from clorch_repl import amp, data, parallel
from clorch_repl.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["run_local", "train_worker", "train", "make_model", "make_data", "TrainingResult", "DEFAULTS", "main"]

DEFAULTS: dict[str, Any] = {
    "epochs": 4, "sample_count": 1024, "batch_size": 32, "accumulation": 2, "precision": "bfloat16",
    "checkpoint_path": "/tmp/clorch-ddp.pt", "resume": False, "seed": 1337, "lr": 3e-3,
    "features": 16, "hidden": 64, "checkpoint_every": None, "stop_after_steps": None, "log_every": None,
    "strategy": "ddp",
}
STRATEGIES = ("ddp", "fsdp")


@dataclass
class TrainingResult:
    """What :func:`run_local` returns. ``losses[rank]`` holds one loss per optimizer step."""

    devices: list[int]
    backend: str
    world_size: int
    precision: str
    losses: dict[int, list[float]]
    logs: dict[int, str]
    checkpoint_path: str
    state: dict[str, Any]
    skipped_steps: dict[int, int] = field(default_factory=dict)
    param_digests: dict[int, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: the device each rank trained on, as torch names it ("cuda:0", "cpu")
    rank_devices: dict[int, str] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        """Rank zero's last step loss (every rank trains the same replica on different data)."""
        return self.losses[0][-1] if self.losses.get(0) else float("nan")


def make_data(sample_count: int, features: int = 16, seed: int = 1337) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression problem every rank can regenerate identically (no files to share)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sample_count, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = torch.tanh(x @ w / math.sqrt(features)) + 0.05 * torch.randn(sample_count, 1, generator=g)
    return x, y


def make_model(features: int = 16, hidden: int = 64, seed: int = 1337) -> nn.Module:
    """A small MLP with dropout (so resuming must restore the RNG to continue bit-identically)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, 1))


def _param_digest(model: nn.Module) -> str:
    """A digest of the full parameters (an FSDP2 model's gathered from its shards: a collective)."""
    h = hashlib.sha256()
    for p in parallel.unwrap(model).parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fully_shard(model: nn.Module, precision: str) -> None:
    """Shard ``model`` in place with FSDP2: each Linear layer, then the root (one mesh of every
    rank); bfloat16/float16 through FSDP2's own policy (parameters cast for compute, gradients
    reduced in float32)."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (tdist.get_world_size(),))
    dtype = amp.resolve_dtype(precision)
    policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32
              else MixedPrecisionPolicy())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _resolve(args: dict[str, Any] | None) -> dict[str, Any]:
    merged = dict(DEFAULTS)
    unknown = set(args or {}) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown training option(s) {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}")
    merged.update(args or {})
    for key in ("epochs", "sample_count", "batch_size", "accumulation", "features", "hidden"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a whole number >= 1; got {value!r}")
    amp.resolve_dtype(merged["precision"])
    if merged["strategy"] not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}; got {merged['strategy']!r}")
    return merged


@dataclasses.dataclass
class _Run:
    """What one rank trains with: the data, the model (sharded with ``strategy="fsdp"``), its
    optimizer, sampler and scaler, and where a resumed run starts."""

    cfg: dict[str, Any]
    device: torch.device
    x_all: torch.Tensor
    y_all: torch.Tensor
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: Any
    scaler: Any
    start_epoch: int = 0
    global_step: int = 0
    resumed_from: dict[str, int] | None = None

    def save(self, epoch: int, global_step: int, world_size: int) -> None:
        path = self.cfg["checkpoint_path"]
        if path:
            from clorch_repl.distributed import save_checkpoint

            save_checkpoint(path, model=self.model, optimizer=self.optimizer, sampler=self.sampler,
                            scaler=self.scaler, state={"epoch": epoch, "global_step": global_step,
                                                       "precision": self.cfg["precision"], "world_size": world_size})


def _prepare(rank: int, world_size: int, device: torch.device, cfg: dict[str, Any],
             log: Callable[[str], None]) -> _Run:
    """Data, model, optimizer, sampler and scaler; the checkpoint loaded into them when resuming."""
    precision = str(cfg["precision"])
    x_all, y_all = make_data(cfg["sample_count"], cfg["features"], cfg["seed"])
    model = make_model(cfg["features"], cfg["hidden"], cfg["seed"]).to(device)
    if cfg["strategy"] == "fsdp":
        _fully_shard(model, precision)  # before the optimizer, which then holds the shards
    run = _Run(cfg, device, x_all.to(device), y_all.to(device), model,
               torch.optim.AdamW(model.parameters(), lr=cfg["lr"]),
               data.distributed_sampler(cfg["sample_count"], num_replicas=world_size, rank=rank, seed=cfg["seed"]),
               amp.grad_scaler(device=device.type) if amp.needs_scaler(precision) else None)
    path = cfg["checkpoint_path"]
    if cfg["resume"] and path and os.path.exists(path):
        from clorch_repl.distributed import load_checkpoint

        state = load_checkpoint(path, model=run.model, optimizer=run.optimizer, sampler=run.sampler,
                                scaler=run.scaler)
        run.start_epoch, run.global_step = int(state["epoch"]), int(state["global_step"])
        run.resumed_from = {"epoch": run.start_epoch, "global_step": run.global_step,
                            "position": run.sampler.position}
        log(f"rank {rank}: resumed from {path} at epoch {run.start_epoch}, step {run.global_step}, "
            f"sample {run.sampler.position} of the epoch")
    return run


def train(rank: int, world_size: int, device: torch.device | str, args: dict[str, Any] | None = None,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """The training loop of one rank inside an initialised process group; returns its record.

    Resumes from ``checkpoint_path`` when ``resume`` is true and the checkpoint exists: mid-epoch
    checkpoints (``checkpoint_every`` steps) continue with the very next micro-batch. With
    ``strategy="fsdp"`` the model is sharded before the checkpoint is loaded into it, so the
    checkpoint (a sharded folder) is read shard by shard, however many ranks saved it.
    """
    cfg = _resolve(args)
    device = torch.device(device)
    precision, strategy = str(cfg["precision"]), str(cfg["strategy"])
    run = _prepare(rank, world_size, device, cfg, log)
    sampler, scaler, optimizer = run.sampler, run.scaler, run.optimizer
    global_step, losses, skipped, stopped = run.global_step, [], 0, False
    batch, accumulation = cfg["batch_size"], cfg["accumulation"]
    micro_per_epoch = math.ceil(sampler.num_samples / batch)
    stop_after, every = cfg["stop_after_steps"], cfg["checkpoint_every"]
    started = time.perf_counter()
    state = {"epoch": run.start_epoch, "global_step": global_step}
    autocast = strategy == "ddp"  # FSDP2 casts through its MixedPrecisionPolicy
    wrapped = parallel.distributed_data_parallel(run.model) if strategy == "ddp" else contextlib.nullcontext(run.model)
    with wrapped as pmodel:
        for epoch in range(run.start_epoch, cfg["epochs"]):
            sampler.set_epoch(epoch)
            micro = sampler.position // batch
            step_loss = 0.0
            for indices in BatchSampler(sampler, batch, drop_last=False):
                group_start = micro - micro % accumulation
                group_len = min(accumulation, micro_per_epoch - group_start)
                last = micro - group_start == group_len - 1
                micro += 1
                sync = contextlib.nullcontext() if last else parallel.no_sync(pmodel)
                with sync:
                    with amp.autocast(device=device.type, dtype=precision, enabled=autocast):
                        prediction = pmodel(run.x_all[indices])
                    loss = F.mse_loss(prediction.float(), run.y_all[indices]) / group_len
                    amp.backward(scaler, loss)
                step_loss += loss.item()
                if not last:
                    continue
                if not parallel.optimizer_step(pmodel, optimizer, scaler=scaler):
                    skipped += 1
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                losses.append(step_loss)
                step_loss = 0.0
                if cfg["log_every"] and global_step % cfg["log_every"] == 0:
                    log(f"rank {rank}: step {global_step} loss {losses[-1]:.5f}")
                if every and global_step % every == 0 and micro < micro_per_epoch:
                    run.save(epoch, global_step, world_size)  # mid-epoch: the sampler position says where to continue
                if stop_after and global_step >= stop_after:
                    stopped = True
                    state = {"epoch": epoch, "global_step": global_step}
                    break
            if stopped:
                break
            epoch_losses = losses[-math.ceil(micro_per_epoch / accumulation):]
            mean = sum(epoch_losses) / max(len(epoch_losses), 1)
            scale = f", scale {scaler.get_scale():.0f}" if scaler is not None else ""
            log(f"rank {rank}: epoch {epoch + 1}/{cfg['epochs']} step {global_step} mean loss {mean:.5f}{scale}")
            run.save(epoch + 1, global_step, world_size)
            state = {"epoch": epoch + 1, "global_step": global_step}
    return {"rank": rank, "losses": losses, "global_step": global_step, "skipped_steps": skipped,
            "param_digest": _param_digest(run.model), "device": str(device), "precision": precision,
            "resumed_from": run.resumed_from, "stopped_early": stopped,
            "train_seconds": time.perf_counter() - started, "state": state}


def _rank_device(backend: str) -> torch.device:
    if backend == "nccl" or torch.cuda.is_available():
        # the GPU the job's process group chose (dist.process_group): the only one a main= job's
        # rank sees, or cuda:{LOCAL_RANK} where the rank sees its host's GPUs
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train_worker(ctx: dict[str, Any]) -> dict[str, Any]:
    """Entry point of each launched rank (``main=f"{__name__}:train_worker"``)."""
    device = _rank_device(str(ctx.get("backend", "gloo")))
    return train(int(ctx["rank"]), int(ctx["world_size"]), device, ctx.get("args") or {},
                 log=lambda line: print(line, flush=True))


# The ranks import the worker by this name; never "__main__", which is the launcher's own script.
_MODULE = "clorch_repl.examples.distributed_training"


def run_local(devices: list[int], epochs: int = 4, sample_count: int = 1024, batch_size: int = 32,
              accumulation: int = 2, precision: str = "bfloat16", checkpoint_path: str = "/tmp/clorch-ddp.pt",
              resume: bool = False, timeout_ms: int = 600_000, strategy: str = "ddp",
              **options: Any) -> TrainingResult:
    """Train on one rank per entry of ``devices`` and wait; returns losses, logs and the checkpoint path.

    Without a GPU, ``len(devices)`` CPU ranks run with gloo (the device numbers are not used).
    ``strategy``: ``"ddp"`` or ``"fsdp"`` (FSDP2; the checkpoint is then a sharded folder).
    ``options`` are the other keys of :data:`DEFAULTS` (``seed``, ``lr``, ``checkpoint_every``,
    ``stop_after_steps``, ...). Raises :class:`clorch_repl.errors.RankFailure` naming the rank that
    failed.
    """
    from clorch_repl import cuda
    from clorch_repl import distributed as dist

    device_list = [int(d) for d in devices]
    if not device_list:
        raise ConfigError("devices is empty: give one device per rank, e.g. run_local([0, 1])")
    args = _resolve({"epochs": epochs, "sample_count": sample_count, "batch_size": batch_size,
                     "accumulation": accumulation, "precision": precision, "checkpoint_path": checkpoint_path,
                     "resume": resume, "strategy": strategy, **options})
    if args["checkpoint_path"]:
        args["checkpoint_path"] = os.path.abspath(args["checkpoint_path"])
    gpu = cuda.device_count() > 0
    started = time.perf_counter()
    job = dist.launch(nproc_per_node=len(device_list), devices=device_list if gpu else None,
                      backend="nccl" if gpu else "gloo", main=f"{_MODULE}:train_worker",
                      args=args, timeout_ms=timeout_ms)
    with job:
        records = job.wait()
        logs = {r: job.logs(r, tail=None) for r in range(len(device_list))}
    elapsed = time.perf_counter() - started
    return TrainingResult(
        devices=device_list, backend="nccl" if gpu else "gloo", world_size=len(device_list),
        precision=str(precision), losses={r: rec["losses"] for r, rec in enumerate(records)}, logs=logs,
        checkpoint_path=args["checkpoint_path"], state=records[0]["state"],
        skipped_steps={r: rec["skipped_steps"] for r, rec in enumerate(records)},
        param_digests={r: rec["param_digest"] for r, rec in enumerate(records)}, elapsed_s=elapsed,
        rank_devices={r: str(rec.get("device")) for r, rec in enumerate(records)})


def main(argv: list[str] | None = None) -> int:
    """``python -m clorch_repl.examples.distributed_training [--devices 0,1] [--epochs 4] ...``."""
    import argparse

    parser = argparse.ArgumentParser(description="Train the example model with DDP on one rank per device "
                                                 "(CPU ranks with gloo where there is no GPU).")
    parser.add_argument("--devices", default="0,1", help="comma-separated GPU indices, one rank each (default 0,1)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--sample-count", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--precision", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--checkpoint-path", default="/tmp/clorch-ddp.pt")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-path")
    parser.add_argument("--strategy", default="ddp", choices=list(STRATEGIES),
                        help="ddp (replicas) or fsdp (FSDP2 shards; sharded checkpoints)")
    ns = parser.parse_args(argv)
    devices = [int(d) for d in ns.devices.split(",") if d.strip()]
    result = run_local(devices, epochs=ns.epochs, sample_count=ns.sample_count, batch_size=ns.batch_size,
                       accumulation=ns.accumulation, precision=ns.precision, checkpoint_path=ns.checkpoint_path,
                       resume=ns.resume, strategy=ns.strategy)
    for text in result.logs.values():
        print(text, end="")
    print(f"loss of the last step {result.final_loss:.5f}; checkpoint at {result.checkpoint_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
