"""Models people shard, and what the sharded-checkpoint tests run on each rank.

The models are small but built the way users build large ones: an FSDP2 Transformer made on the
meta device and sharded layer by layer (as pytorch/examples' FSDP2 example does), a tensor-parallel
MLP (``parallelize_module`` with column- then row-wise layers), and both on a 2-D mesh. Each rank
function returns plain data (digests of the *full* tensors, errors as text), so the test compares
what was saved with what was loaded on any number of ranks, or in the test process itself.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

VOCAB, DIM, LAYERS = 32, 16, 2


class Transformer(nn.Module):
    """A small decoder-style Transformer: embedding, encoder layers, a head."""

    def __init__(self, layers: int = LAYERS, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, 2, dim * 2, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class MLP(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim * 4)
        self.down = nn.Linear(dim * 4, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _init(model: nn.Module, seed: int) -> None:
    """Seeded values that do not depend on how the model is sharded (set from full tensors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            full = torch.randn(tuple(p.shape), generator=g) * 0.1
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            else:
                p.copy_(full)


def build(kind: str, seed: int, world_size: int = 1) -> nn.Module:
    """``kind``: "plain" (a Transformer, unsharded), "fsdp" (FSDP2 per layer, meta-device init),
    "tp_plain" (the MLP unsharded), "tp" (the MLP tensor parallel), "2d" (FSDP x TP on a 2-D mesh)."""
    if kind in ("plain", "tp_plain"):
        model = Transformer() if kind == "plain" else MLP()
        _init(model, seed)
        return model
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = Transformer()
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        _init(model, seed)
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    model = MLP()
    if kind == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world_size,)), plan)
    elif kind == "2d":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(kind)
    _init(model, seed)
    return model


def batch(kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind in ("plain", "fsdp"):
        return torch.randint(0, VOCAB, (4, 6), generator=g)
    return torch.randn(4, DIM, generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, kind: str, seed: int = 0) -> None:
    out = model(batch(kind, seed))
    out.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """sha256 of every full tensor of the model's and the optimizer's state, by parameter name
    (a collective where they are sharded: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    h = hashlib.sha256()
    for name, t in sorted(get_model_state_dict(model).items()):
        h.update(name.encode())
        h.update(_full(t).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    if optimizer is not None:
        state = get_optimizer_state_dict(model, optimizer)["state"]
        for name in sorted(state):
            for key in sorted(state[name]):
                value = _full(state[name][key])
                h.update(f"{name}.{key}".encode())
                h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                         if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def _error(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the text
        return f"{type(exc).__name__}: {exc}"
    return None


def save_then_load(ctx: dict[str, Any]) -> dict[str, Any]:
    """Train a step, save (blocking or async), check what loads back; optionally save version 2."""
    from clorch_repl.distributed import load_checkpoint, save_checkpoint

    args, rank, world = ctx["args"], ctx["rank"], ctx["world_size"]
    kind, path = args["kind"], args["path"]
    torch.manual_seed(rank)
    model = build(kind, 0, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, kind)
    saved = digest(model, opt)
    result = save_checkpoint(path, model=model, optimizer=opt, state={"step": 1, "kind": kind},
                             async_save=bool(args.get("async")))
    out: dict[str, Any] = {"rank": rank, "saved": saved}
    if args.get("async"):
        out["returned_before_done"] = not result.done()
        train_step(model, opt, kind, seed=1)  # changes the weights while the save writes
        out["changed_meanwhile"] = digest(model, opt) != saved
        out["waited"] = result.wait()
        out["staged_s"] = result.staged_s
    fresh = build(kind, 7, world)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    out["state"] = load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    out["loaded"] = digest(fresh, fresh_opt)
    if args.get("async"):  # a load right after an asynchronous save reads that save, never the one before
        second = digest(model, opt)
        save_checkpoint(path, model=model, optimizer=opt, state={"step": 2, "kind": kind}, async_save=True)
        out["state_right_after"] = load_checkpoint(path, model=fresh, optimizer=fresh_opt)
        out["right_after_exact"] = digest(fresh, fresh_opt) == second
    return out


def load_only(ctx: dict[str, Any]) -> dict[str, Any]:
    """Build ``kind`` on this many ranks, load ``path`` into it; the digest of what loaded."""
    from clorch_repl.distributed import load_checkpoint

    args = ctx["args"]
    model = build(args["kind"], 3, ctx["world_size"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = load_checkpoint(args["path"], model=model, optimizer=opt)
    return {"rank": ctx["rank"], "loaded": digest(model, opt), "state": state}


def mismatches(ctx: dict[str, Any]) -> dict[str, Any]:
    """Models that do not fit the checkpoint: every rank raises, naming keys; nothing changes."""
    from clorch_repl.distributed import load_checkpoint

    args, world = ctx["args"], ctx["world_size"]
    out: dict[str, Any] = {"rank": ctx["rank"]}
    model = build("fsdp", 5, world)
    before = digest(model)
    deeper = Transformer(layers=LAYERS + 1)  # an extra layer: keys the checkpoint lacks
    out["missing"] = _error(lambda: load_checkpoint(args["path"], model=deeper))
    wider = Transformer(dim=DIM * 2)
    out["shapes"] = _error(lambda: load_checkpoint(args["path"], model=wider))
    shallow = Transformer(layers=LAYERS - 1)
    out["unexpected"] = _error(lambda: load_checkpoint(args["path"], model=shallow))
    out["sgd"] = _error(lambda: load_checkpoint(args["path"], model=model,
                                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    # a path that does not exist, into the sharded model: named as missing, not as "a single file"
    out["nowhere"] = _error(lambda: load_checkpoint(args["path"] + "-nowhere", model=model))
    out["unchanged"] = digest(model) == before
    return out


def dies_while_saving(ctx: dict[str, Any]) -> dict[str, Any]:
    """Save version 1, then rank ``die_rank`` ends itself (os._exit) inside its shard write of
    version 2, blocking or asynchronous; the previous checkpoint must stay whole at the path."""
    import torch.distributed.checkpoint.filesystem as fs

    from clorch_repl.distributed import save_checkpoint
    from clorch_repl.training.checkpoint.storage_writers import ProcessWriter

    args, rank, world = ctx["args"], ctx["rank"], ctx["world_size"]
    model = build("fsdp", 0, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, "fsdp")
    save_checkpoint(args["path"], model=model, optimizer=opt, state={"version": 1})
    print(f"rank {rank}: version 1 saved, digest {digest(model, opt)}", flush=True)
    train_step(model, opt, "fsdp", seed=1)
    if rank == args["die_rank"]:
        # An asynchronous save's shards are written through the rank's writer process (issue 39).
        writer = ProcessWriter if args.get("async") else fs.FileSystemWriter
        original = writer.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            original(self, plan, planner).wait()  # its shards are on disk, the commit never comes
            os._exit(7)

        writer.write_data = write_then_die
    handle = save_checkpoint(args["path"], model=model, optimizer=opt, state={"version": 2},
                             async_save=bool(args.get("async")))
    if args.get("async"):
        handle.wait()
    return {"rank": rank, "survived": True}


def failing_async_write(ctx: dict[str, Any]) -> dict[str, Any]:
    """An asynchronous save whose shard write fails on rank 1 (an injected OSError): ``wait()``
    raises on every rank, the next save still works."""
    from clorch_repl.distributed import load_checkpoint, save_checkpoint
    from clorch_repl.training.checkpoint.storage_writers import ProcessWriter

    args, rank, world = ctx["args"], ctx["rank"], ctx["world_size"]
    model = build("fsdp", 0, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_checkpoint(args["path"], model=model, optimizer=opt, state={"version": 1})
    first = digest(model, opt)
    train_step(model, opt, "fsdp")
    original = ProcessWriter.write_data  # an asynchronous save's shards go through the writer process
    if rank == 1:
        def failing(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError(28, "No space left on device (injected by the test)")

        ProcessWriter.write_data = failing
    handle = save_checkpoint(args["path"], model=model, optimizer=opt, state={"version": 2}, async_save=True)
    out: dict[str, Any] = {"rank": rank, "error": _error(handle.wait), "done": handle.done()}
    ProcessWriter.write_data = original
    fresh = build("fsdp", 4, world)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    out["state_after_failure"] = load_checkpoint(args["path"], model=fresh, optimizer=fresh_opt)
    out["previous_whole"] = digest(fresh, fresh_opt) == first
    # two saves in a row: the second call waits for the first before it starts
    h1 = save_checkpoint(args["path"], model=model, optimizer=opt, state={"version": 3}, async_save=True)
    h2 = save_checkpoint(args["path"] + "-b", model=model, optimizer=opt, state={"version": 4}, async_save=True)
    out["first_done_when_second_returned"] = h1.done()
    out["second"] = h2.wait()
    out["final_state"] = load_checkpoint(args["path"], model=fresh, optimizer=fresh_opt)
    return out


def save_versions(ctx: dict[str, Any]) -> dict[str, Any]:
    """Save versions 1, 2, ... of an FSDP2 model whose every value is the version, until killed."""
    from clorch_repl.distributed import save_checkpoint

    args = ctx["args"]
    model = build("fsdp", 0, ctx["world_size"])
    version = int(args.get("start", 1)) - 1
    while True:
        version += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(version))
        save_checkpoint(args["path"], model=model, state={"version": version})
        if ctx["rank"] == 0:
            print(f"saved {version}", flush=True)
        if version >= args.get("until", 10 ** 9):
            return {"version": version}


def fsdp_scaled_steps(ctx: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 with a MixedPrecisionPolicy and a float16 grad scaler through ``optimizer_step``: an
    inf in rank 1's gradient shard skips the step on every rank; ``no_sync`` holds the reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from clorch_repl import amp
    from clorch_repl import parallel as ddp

    args, rank, world = ctx["args"], ctx["rank"], ctx["world_size"]
    dtype = getattr(torch, args["dtype"])
    from torch.distributed.device_mesh import init_device_mesh

    model = Transformer()
    _init(model, 0)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = amp.grad_scaler(device="cpu", initial_scale=1024.0)
    out: dict[str, Any] = {"rank": rank, "stepped": [], "changed": [], "scales": []}
    for step in range(3):
        before = digest(model)
        loss = model(batch("fsdp", step)).float().pow(2).mean()
        amp.backward(scaler, loss)
        if step == 1 and rank == 1:
            model.head.weight.grad.to_local().view(-1)[0] = float("inf")  # only rank 1's shard
        out["stepped"].append(ddp.optimizer_step(model, opt, scaler=scaler))
        out["changed"].append(digest(model) != before)
        out["scales"].append(scaler.get_scale())
        opt.zero_grad()
    with ddp.no_sync(model):
        model(batch("fsdp", 9)).float().sum().backward()
    out["inside_no_sync"] = _error(lambda: ddp.optimizer_step(model, opt))
    model(batch("fsdp", 9)).float().sum().backward()
    out["after_no_sync"] = ddp.optimizer_step(model, opt)
    return out


def fsdp1_unreadable_metadata_on_one_rank(ctx: dict[str, Any]) -> dict[str, Any]:
    """An FSDP1 model (whose optimizer state dict takes collectives) saved sharded; a save that rank 0
    alone refuses (the target is a folder of other files); then rank 1 loads
    from a copy of the folder whose ``.metadata`` it cannot read (a host's own disk, say), rank 0
    from the good one. Every rank must get the same refusal naming rank 1, and none may hang."""
    import shutil

    from torch.distributed.fsdp import FullyShardedDataParallel

    from clorch_repl.distributed import load_checkpoint, save_checkpoint

    args, rank = ctx["args"], ctx["rank"]
    model = FullyShardedDataParallel(Transformer(), use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, "plain")
    save_checkpoint(args["path"], model=model, optimizer=opt, sharded=True)
    other = args["path"] + "-other"  # a folder of other files: rank 0 refuses to replace it
    if rank == 0:
        os.makedirs(other)
        with open(os.path.join(other, "notes.txt"), "w") as fh:
            fh.write("mine")
    torch.distributed.barrier()
    refused_save = _error(lambda: save_checkpoint(other, model=model, optimizer=opt, sharded=True))
    broken = args["path"] + "-broken"
    if rank == 0:
        shutil.copytree(args["path"], broken)
        with open(os.path.join(broken, ".metadata"), "wb") as fh:
            fh.write(b"not a pickle")
    torch.distributed.barrier()

    def local() -> list[torch.Tensor]:  # FSDP1's state dicts hold ShardedTensors: the local flat shards
        return [t.detach().clone() for p in model.parameters() for t in (p, *opt.state[p].values())]

    before = local()
    error = _error(lambda: load_checkpoint(broken if rank == 1 else args["path"], model=model, optimizer=opt))
    after = local()
    return {"rank": rank, "error": error, "refused_save": refused_save,
            "unchanged": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))}


def fsdp1_round_trip(ctx: dict[str, Any]) -> dict[str, Any]:
    """An FSDP1 model saved with the defaults: whether a folder (the sharded format) was written,
    and whether each rank's local shards and optimizer state load back exactly."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from clorch_repl.distributed import load_checkpoint, save_checkpoint

    args, rank = ctx["args"], ctx["rank"]

    def build_fsdp1(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        inner = Transformer()
        _init(inner, seed)
        model = FullyShardedDataParallel(inner, use_orig_params=True, device_id=torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def local(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [t.detach().clone() for p in model.parameters() for t in (p, *opt.state[p].values())]

    model, opt = build_fsdp1(0)
    train_step(model, opt, "plain")
    save_checkpoint(args["path"], model=model, optimizer=opt)
    fresh, fresh_opt = build_fsdp1(5)
    train_step(fresh, fresh_opt, "plain", seed=3)
    load_checkpoint(args["path"], model=fresh, optimizer=fresh_opt)
    saved, loaded = local(model, opt), local(fresh, fresh_opt)
    return {"rank": rank, "folder": os.path.isdir(args["path"]),
            "exact": len(saved) == len(loaded) and all(torch.equal(a, b) for a, b in zip(saved, loaded))}
