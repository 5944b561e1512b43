"""Rank-zero checkpoints that a crash can never leave half-written, and that load no pickled code.

One file holds everything: model weights, optimizer state, every rank's RNG state (torch CPU, CUDA
where CUDA is initialised, Python ``random``, NumPy), every rank's sampler state, the scaler state
and the JSON metadata (the caller's ``state`` map). One file is one unit: new weights can never sit
beside old metadata.

Public names: ``clorch_repl.distributed.save_checkpoint`` / ``load_checkpoint`` (``dist.`` in
API.md). A checkpoint is training state, so it lives with :mod:`.ddp`, :mod:`.sampler` and
:mod:`.amp`, whose objects it saves.

Writing: rank zero writes ``.<name>.clorch-tmp.<pid>.<random>`` in the same folder, fsyncs it,
``os.replace``s it over the target (atomic on POSIX) and fsyncs the folder
(:func:`clorch_repl.atomic.write_atomically`), so after a crash the path holds either the
previous checkpoint or the new one. Temporary files left by a killed writer
are removed by the next save. The file gets the mode a plain ``open()`` would give it (0666 less
the umask), like ``torch.save``.

Reading: the zip container's CRCs are verified first (``torch.load`` does not check them, so a
flipped byte in the weights would otherwise load silently), then ``torch.load(weights_only=True)``
reads it (no pickled code runs: RNG states are tensors and metadata is a JSON string). Everything
is checked against the model, optimizer, sampler and scaler *before* any of them is changed; a
missing, truncated, corrupt or foreign checkpoint raises :class:`~clorch_repl.errors.ClorchError`
and leaves them as they were.

Ranks: with an initialised process group both functions are collectives (every rank calls them).
Ranks agree on success before returning, so a failure on one rank raises on every rank (naming
it) instead of leaving the others waiting at a barrier. Without a process group they work in a
single process. "No pickled code" is about the file: the ranks exchange their RNG and sampler
states and their verdicts with ``all_gather_object``, which pickles between the group's own
processes, over the loopback group that the launcher started.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import secrets
import threading
import time
import zipfile
from typing import Any

import torch
import torch.distributed as tdist

from ..atomic import remove_quietly, write_atomically
from ..distributed import _c10d
from ..errors import CheckpointError, ClorchError, ConfigError
from .ddp import unwrap

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint_metadata", "CheckpointError"]

FORMAT = "clorch-checkpoint"
FORMAT_VERSION = 1
_TMP_MARK = ".clorch-tmp."


# -- ranks ----------------------------------------------------------------------------------------

def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (small Python objects only), in rank order."""
    if _c10d.world_size() == 1:
        return [obj]
    out: list[Any] = [None] * _c10d.world_size()
    tdist.all_gather_object(out, obj)
    return out


def _raise_if_any(errors: list[str | None], doing: str) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if len(failed) == 1 and _c10d.world_size() == 1:
        raise CheckpointError(failed[0][1])
    if len(failed) == 1:
        rank, message = failed[0]
        raise CheckpointError(f"{doing} failed on rank {rank}: {message}; nothing was changed on any rank")
    lines = "; ".join(f"rank {r}: {e}" for r, e in failed)
    raise CheckpointError(f"{doing} failed on ranks {', '.join(str(r) for r, _ in failed)} ({lines}); "
                          "nothing was changed on any rank")


# -- what gets saved -----------------------------------------------------------------------------

def _model_signature(state_dict: dict[str, Any]) -> list[list[Any]]:
    return [[name, list(t.shape), str(t.dtype).replace("torch.", "")]
            for name, t in state_dict.items() if isinstance(t, torch.Tensor)]


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states as tensors (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(list(internal), dtype=torch.int64),
        "python_version": int(version),
        "python_gauss": gauss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    internal = tuple(int(v) for v in state["python"].tolist())
    random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        import numpy as np

        np.random.set_state((numpy_state["kind"], numpy_state["keys"].cpu().numpy().astype("uint32"),
                             int(numpy_state["pos"]), int(numpy_state["has_gauss"]),
                             float(numpy_state["cached_gaussian"])))


def _check_state_map(state: Any) -> str:
    if state is None:
        state = {}
    if not isinstance(state, dict):
        raise ConfigError(f"state must be a dict (it is stored as JSON); got {type(state).__name__}")
    try:
        return json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"state must be JSON-serialisable (numbers, strings, lists, dicts): {exc}. "
                          "Convert tensors with .item() or .tolist() first") from None


# -- writing -------------------------------------------------------------------------------------

def _remove_stale_temps(folder: str, base: str) -> None:
    """Delete temporary files of earlier saves whose writer is gone (killed mid-write)."""
    prefix = f".{base}{_TMP_MARK}"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split(".", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() and name.endswith(".old") and _PENDING_UNLINKS:
            continue  # this process is deleting it right now
        if pid != os.getpid() and _pid_alive(pid):
            continue
        logger.debug("removing %s, left in %s by a save that did not finish (pid %d)", name, folder, pid)
        remove_quietly(os.path.join(folder, name))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PENDING_UNLINKS: list[threading.Thread] = []


def _join_pending_unlinks() -> None:
    while _PENDING_UNLINKS:
        _PENDING_UNLINKS.pop().join()


atexit.register(_join_pending_unlinks)


def _sync_while_writing(fd: int, done: threading.Event, errors: list[OSError]) -> None:
    """Push what torch.save has written so far to disk while it keeps writing, so the fsync that
    durability needs at the end waits only for the tail, not for the whole file."""
    sync = getattr(os, "fdatasync", os.fsync)
    while not done.wait(0.01):
        try:
            sync(fd)
        except OSError as exc:  # the final fsync reports it
            errors.append(exc)
            return


def _write_atomically(path: str, payload: dict[str, Any]) -> None:
    """``torch.save`` through :func:`~clorch_repl.atomic.write_atomically`.

    The previous checkpoint's inode is kept alive by a hard link until the rename is done and then
    deleted in the background: freeing a large file's blocks takes as long as writing a good part
    of it, and it is not needed for the new file to be durable. Whatever a killed process leaves
    behind carries its pid in the name and is removed by the next save.
    """
    folder, base = os.path.split(path)
    folder = folder or "."
    os.makedirs(folder, exist_ok=True)
    _PENDING_UNLINKS[:] = [t for t in _PENDING_UNLINKS if t.is_alive()]
    _remove_stale_temps(folder, base)
    stem = os.path.join(folder, f".{base}{_TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    old = stem + ".old"
    kept_old = False

    def save(tmp: str, fd: int) -> None:
        done, errors = threading.Event(), []
        syncer = threading.Thread(target=_sync_while_writing, args=(fd, done, errors), daemon=True,
                                  name="clorch-checkpoint-sync")
        syncer.start()
        try:
            torch.save(payload, tmp)  # by path: torch's own buffered writer, the fastest route
        finally:
            done.set()
            syncer.join()

    def keep_old() -> None:
        nonlocal kept_old
        try:
            os.link(path, old)
            kept_old = True
        except OSError:  # no previous checkpoint, or a filesystem without hard links
            pass

    try:
        # 0o666 so the umask decides, as with open() and torch.save
        write_atomically(path, save, mode=0o666, temp_path=stem + ".new", before_replace=keep_old)
    except BaseException:
        if kept_old:
            remove_quietly(old)
        raise
    if kept_old:
        thread = threading.Thread(target=remove_quietly, args=(old,), name="clorch-checkpoint-unlink")
        thread.start()
        _PENDING_UNLINKS.append(thread)


# -- save ----------------------------------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike[str], model: Any = None, optimizer: Any = None,
                    sampler: Any = None, scaler: Any = None, state: dict[str, Any] | None = None) -> str:
    """Write a checkpoint from rank zero; every rank must call it. Returns the absolute path.

    Every rank's RNG and sampler state are gathered so that each rank resumes its own streams;
    model, optimizer and scaler states are taken from rank zero (identical on every rank under
    DDP). ``state`` must be JSON-serialisable; :func:`load_checkpoint` returns it.
    """
    target = os.path.abspath(os.fspath(path))
    local_error: str | None = None
    rng = sampler_state = None
    metadata_json = ""
    try:
        metadata_json = _check_state_map(state)
        if sampler is not None and not callable(getattr(sampler, "state_dict", None)):
            raise ConfigError(f"sampler {type(sampler).__name__} has no state_dict(); use "
                              "clorch_repl.data.distributed_sampler, or leave sampler out")
        if os.path.isdir(target):
            raise ConfigError(f"{target} is a folder; give a file path such as {target}/model.pt")
        rng = _rng_state()
        sampler_state = sampler.state_dict() if sampler is not None else None
    except ClorchError as exc:
        local_error = str(exc)
    gathered = _gather((local_error, rng, sampler_state))
    _raise_if_any([g[0] for g in gathered], "saving the checkpoint")

    write_error: str | None = None
    if _c10d.rank() == 0:
        try:
            module = unwrap(model) if model is not None else None
            model_state = module.state_dict() if module is not None else None
            meta = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "state": json.loads(metadata_json),
                "saved_at": time.time(),
                "torch": torch.__version__,
                "world_size": _c10d.world_size(),
                "model_signature": _model_signature(model_state) if model_state is not None else None,
                "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
                "contents": [name for name, obj in (("model", model), ("optimizer", optimizer),
                                                    ("sampler", sampler), ("scaler", scaler)) if obj is not None],
            }
            payload = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "metadata": json.dumps(meta),
                "model": model_state,
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "sampler": [g[2] for g in gathered] if sampler is not None else None,
                "rng": [g[1] for g in gathered],
            }
            _write_atomically(target, payload)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
            logger.debug("writing the checkpoint %s failed", target, exc_info=True)
            write_error = f"writing {target} failed: {type(exc).__name__}: {exc}"
    statuses = _gather(write_error)
    _raise_if_any(statuses, "saving the checkpoint")
    return target


# -- load ----------------------------------------------------------------------------------------

def _target_device(module: Any) -> torch.device:
    devices = {t.device for t in list(module.parameters()) + list(module.buffers())} if module is not None else set()
    if len(devices) == 1:
        return next(iter(devices))
    return torch.device("cpu")


def _read(path: str, device: torch.device) -> dict[str, Any]:
    """Open, verify and unpickle (weights only) one checkpoint file; raise CheckpointError on anything odd."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: check the path, or save one first")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder, not a checkpoint file")
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from None
    # One open file for both passes: a save replacing the path meanwhile cannot mix two files.
    with handle:
        try:
            with zipfile.ZipFile(handle) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint {path} is truncated or not a checkpoint file ({exc}); "
                                  "it cannot be loaded: use an earlier checkpoint") from None
        if bad is not None:
            raise CheckpointError(f"the checkpoint {path} is corrupt (record {bad!r} fails its checksum); "
                                  "it cannot be loaded: use an earlier checkpoint")
        handle.seek(0)
        try:
            payload = torch.load(handle, map_location=device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised as a CheckpointError, its stack logged here
            logger.debug("torch.load of the checkpoint %s failed", path, exc_info=True)
            message = str(exc)
            text = message.splitlines()[0] if message else type(exc).__name__
            if "weights_only" in message or "Unpickl" in type(exc).__name__:
                raise CheckpointError(f"refused to load {path}: it contains Python objects other than "
                                      f"tensors and plain data, and loading them could run code ({text}). "
                                      "Only load checkpoints written by save_checkpoint") from None
            raise CheckpointError(f"the checkpoint {path} could not be read ({type(exc).__name__}: "
                                  f"{text}); use an earlier checkpoint") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a torch file but not a clorch_repl checkpoint (written by "
                              "save_checkpoint); load it with torch.load yourself")
    if payload.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is a version {payload.get('version')} checkpoint; this clorch_repl "
                              f"reads version {FORMAT_VERSION}: upgrade clorch_repl")
    try:
        payload["metadata"] = json.loads(payload["metadata"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"the checkpoint {path} has unreadable metadata; use an earlier checkpoint") from None
    return payload


def read_checkpoint_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON metadata of a checkpoint (its ``state`` map, torch version, contents) without loading it."""
    return _read(os.path.abspath(os.fspath(path)), torch.device("cpu"))["metadata"]


def _check_model(path: str, saved: Any, module: Any) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"the checkpoint {path} holds no model weights; leave out model=")
    current = module.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [f"{k}: saved {list(saved[k].shape)}, model {list(current[k].shape)}"
              for k in current if k in saved and isinstance(current[k], torch.Tensor)
              and isinstance(saved[k], torch.Tensor) and saved[k].shape != current[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        if shapes:
            parts.append(f"different shapes ({'; '.join(shapes[:4])}{' ...' if len(shapes) > 4 else ''})")
        raise CheckpointError(f"the checkpoint {path} is from another model: {'; '.join(parts)}. "
                              "Build the model the checkpoint was saved from, or use a matching checkpoint")


def _check_optimizer(path: str, saved: Any, optimizer: Any, saved_class: Any) -> None:
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        raise CheckpointError(f"the checkpoint {path} holds no optimizer state; leave out optimizer=")
    if saved_class and saved_class != type(optimizer).__name__:
        raise CheckpointError(f"the checkpoint {path} holds {saved_class} state but the optimizer is "
                              f"{type(optimizer).__name__}; build the same optimizer to resume")
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"])
                                               for g, s in zip(groups, saved_groups)):
        raise CheckpointError(f"the checkpoint {path} has optimizer parameter groups of sizes "
                              f"{[len(s['params']) for s in saved_groups]} but this optimizer has "
                              f"{[len(g['params']) for g in groups]}; build the optimizer over the same "
                              "parameters")
    params = {sid: p for g, s in zip(groups, saved_groups) for sid, p in zip(s["params"], g["params"])}
    for sid, entry in saved["state"].items():
        param = params.get(sid)
        if param is None or not isinstance(entry, dict):
            raise CheckpointError(f"the checkpoint {path} has optimizer state for an unknown parameter {sid!r}")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"the checkpoint {path} has optimizer state {key!r} of shape "
                                      f"{list(value.shape)} for a parameter of shape {list(param.shape)}; "
                                      "it is from another model")


def _check_scaler(path: str, saved: Any, scaler: Any) -> None:
    if saved is None:
        raise CheckpointError(f"the checkpoint {path} holds no grad scaler state; leave out scaler=")
    if scaler.is_enabled() and not saved:
        raise CheckpointError(f"the checkpoint {path} was saved with a disabled grad scaler (not a float16 "
                              "run); leave out scaler= or start the scale afresh")


def _check_sampler(path: str, saved: Any, sampler: Any, rank: int) -> Any:
    if not isinstance(saved, list) or not saved:
        raise CheckpointError(f"the checkpoint {path} holds no sampler state; leave out sampler=")
    entry = saved[rank] if rank < len(saved) else saved[0]
    check = getattr(sampler, "check_state_dict", None)
    if check is not None:
        try:
            check(entry)
        except ClorchError as exc:
            raise CheckpointError(f"the sampler state in {path} does not fit: {exc}") from None
    elif not callable(getattr(sampler, "load_state_dict", None)):
        raise CheckpointError(f"sampler {type(sampler).__name__} has no load_state_dict()")
    return entry


def load_checkpoint(path: str | os.PathLike[str], model: Any = None, optimizer: Any = None,
                    sampler: Any = None, scaler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns its ``state`` map. Every rank must call it.

    Each rank reads the file itself, mapping tensors to its model's device (so ranks do not all land
    on GPU 0). Each rank restores its own saved RNG and sampler state (rank zero's when the
    checkpoint came from fewer ranks). Nothing is changed on any rank unless every rank validated
    the checkpoint.
    """
    source = os.path.abspath(os.fspath(path))
    module = unwrap(model) if model is not None else None
    rank = _c10d.rank()
    error: str | None = None
    payload: dict[str, Any] = {}
    sampler_entry = None
    try:
        payload = _read(source, _target_device(module))
        meta = payload["metadata"]
        if module is not None:
            _check_model(source, payload.get("model"), module)
        if optimizer is not None:
            _check_optimizer(source, payload.get("optimizer"), optimizer, meta.get("optimizer_class"))
        if scaler is not None:
            _check_scaler(source, payload.get("scaler"), scaler)
        if sampler is not None:
            sampler_entry = _check_sampler(source, payload.get("sampler"), sampler, rank)
        rngs = payload.get("rng")
        if restore_rng and (not isinstance(rngs, list) or not rngs or "torch" not in rngs[0]):
            raise CheckpointError(f"the checkpoint {source} holds no RNG state; pass restore_rng=False")
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - anything unexpected while validating counts as "does not fit"
        logger.debug("checking the checkpoint %s failed", source, exc_info=True)
        error = f"the checkpoint {source} could not be checked: {type(exc).__name__}: {exc}"
    _raise_if_any(_gather(error), "loading the checkpoint")

    try:
        if module is not None:
            module.load_state_dict(payload["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(payload["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(payload["scaler"])
        if sampler is not None:
            sampler.load_state_dict(sampler_entry)
        if restore_rng:
            rngs = payload["rng"]
            _set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
        logger.debug("applying the checkpoint %s failed", source, exc_info=True)
        error = f"applying the checkpoint {source} failed: {type(exc).__name__}: {exc}"
    errors = _gather(error)
    if any(errors):
        failed = [(r, e) for r, e in enumerate(errors) if e]
        raise CheckpointError(f"loading the checkpoint failed on rank {failed[0][0]}: {failed[0][1]}; the "
                              "ranks may now differ, so load it again (or restart the ranks)")
    state = payload["metadata"].get("state", {})
    return state if isinstance(state, dict) else {}
