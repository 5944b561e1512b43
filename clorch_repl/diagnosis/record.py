"""torch's flight recorder: turned on before a process group is created, read in-process.

torch records every collective (op, sequence number per process group, shapes, dtypes, state) in
a ring buffer sized by ``TORCH_FR_BUFFER_SIZE`` (older torch: ``TORCH_NCCL_TRACE_BUFFER_SIZE``),
read when the process group is created; gloo groups are recorded too, in a buffer of their own:
NCCL's collectives go to NCCL's recorder (see :data:`DUMPERS`). Recent torch (2.13 here)
records 2,000 entries by default; older versions record nothing unless the variable is set, so
:func:`enable` sets it where the user has not. Reading it costs
a fraction of a millisecond and takes no lock the blocked collective holds, so a rank's control
thread can read it while the main thread waits in that collective.

The JSON dump is preferred: the pickled one would be unpickled, and it symbolises every entry's
stack (seconds per dump); we take stacks from ``sys._current_frames`` instead.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..common import env_vars
from ..common.imported import imported

logger = logging.getLogger(__name__)

#: Entries kept per process (a ring buffer): enough for the last cells of a training loop.
BUFFER_ENTRIES = 2000
BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: Set to 0 by a user (or the benchmark) to run without recording.
OFF_ENV = env_vars.FLIGHT_RECORDER.name
#: ``recorder/pg_id`` of backends replaced by a re-form of their group (kernel.regroup): their
#: records stay in torch's ring (an aborted collective reads as pending there for ever), but they
#: are no evidence about the group any more, so :func:`read` leaves them out.
_RETIRED: set[str] = set()


def enable(environ: Any = None) -> bool:
    """Turn recording on in ``environ`` (default ``os.environ``) unless the user chose a size, or
    off where ``CLORCH_FLIGHT_RECORDER=0``; must run before the process group is created.
    Returns whether it is on."""
    env = os.environ if environ is None else environ
    if env_vars.FLIGHT_RECORDER.get(env) == "0":
        for name in BUFFER_ENVS:
            env.pop(name, None)
        env[_buffer_env()] = "0"  # recent torch records by default: off must be said
        return False
    if not any(name in env for name in BUFFER_ENVS):
        env[_buffer_env()] = str(BUFFER_ENTRIES)
    return not _switched_off(env)


def buffer_size(env: Any = None) -> int:
    """Entries torch's ring keeps per recorder here: the variable's value, else the default that
    :func:`enable` sets (torch 2.13's own default is the same)."""
    env = os.environ if env is None else env
    for name in BUFFER_ENVS:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                return BUFFER_ENTRIES
    return BUFFER_ENTRIES


def _switched_off(env: Any = None) -> bool:
    """Whether the buffer size was set to 0 (unset means torch's default, on in recent torch)."""
    env = os.environ if env is None else env
    for name in BUFFER_ENVS:
        if name in env:
            return env[name].strip() in ("", "0")
    return False


def _buffer_env() -> str:
    """The variable this torch reads (the old one warns as deprecated where the new one exists);
    looked up without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return BUFFER_ENVS[0]
    return BUFFER_ENVS[0] if (major, minor) >= (2, 7) else BUFFER_ENVS[1]


#: torch's JSON dumps, one per recorder: the generic one (gloo and other CPU backends) and NCCL's
#: own (``FlightRecorder<CUDAEvent>``). They are two buffers, not two names for one: on a CUDA build
#: NCCL's collectives are only in the second, while the first exists and is empty. Both are read
#: and merged, since one process may run groups of both backends.
DUMPERS = (("fr", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json"))


def read(collectives: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """This process's flight-recorder dumps as plain JSON data, or ``(None, why not)``.

    The result holds ``entries`` (one dict per collective, each tagged with the ``recorder`` it
    came from) and ``pg_status`` (per recorder and process group id, ``"nccl/0"``: the last
    enqueued, started and completed collective sequence numbers; the recorders number their
    groups independently, so the ids alone would collide).

    ``collectives=False``: ``pg_status`` only (torch's ``includeCollectives``), no entries. A
    full buffer (2,000 entries, each with its Python stack: about 0.9 MB of JSON) costs a rank
    20-30 ms of CPU with its GIL held to dump and parse, over 100 ms when that sets off a full
    garbage collection; the status alone 0.05 ms. The notebook's periodic hang check asks for
    the status first (:func:`clorch_repl.diagnosis.entries.progress`).
    """
    if imported("torch") is None:  # not imported, or its import still running (common.imported)
        return None, "torch is not imported (or its import has not finished)"
    if _switched_off():
        return None, "the flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None, "this torch build has no distributed support"
    merged: dict[str, Any] | None = None
    for recorder, name in DUMPERS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            try:
                text = dump() if collectives else dump(False)
            except TypeError:  # a torch whose dump takes no includeCollectives: everything
                text = dump()
            data = json.loads(text)
        except (RuntimeError, ValueError) as exc:
            logger.debug("flight recorder dump %s failed: %s", name, exc)
            continue
        part = normalise(data, recorder)
        if collectives:
            # A full ring has dropped its oldest entries (entries.unrecorded_pending needs to know)
            part["full"] = {recorder: len(part["entries"]) >= buffer_size()}
        if merged is None:
            merged = part
        else:
            merged["entries"].extend(part["entries"])
            merged["pg_status"].update(part["pg_status"])
            merged.setdefault("full", {}).update(part.get("full", {}))
    if merged is None:
        return None, ("this torch build has no flight recorder (neither _dump_fr_trace_json nor "
                      "_dump_nccl_trace_json); showing stacks only")
    return merged, None


def retire_current() -> None:
    """Leave the records of every backend that exists now out of later reads: their groups are
    being given new backends (kernel.regroup.reform)."""
    data, _ = read(collectives=False)
    if data is not None:
        _RETIRED.update(data["pg_status"])


def normalise(data: dict[str, Any], recorder: str = "fr") -> dict[str, Any]:
    """One recorder's dump: pg_status numbers as ints (the JSON dump writes them as strings), keyed
    ``recorder/pg_id``, and every entry tagged with ``recorder``; retired backends' left out."""
    status = {}
    for pg_id, values in (data.get("pg_status") or {}).items():
        if f"{recorder}/{pg_id}" not in _RETIRED:
            status[f"{recorder}/{pg_id}"] = {k: _int(v) for k, v in values.items()}
    entries = [dict(e, recorder=recorder) for e in (data.get("entries") or [])
               if f"{recorder}/{e.get('pg_id')}" not in _RETIRED]
    return {"entries": entries, "pg_status": status, "version": data.get("version"), "capacity": buffer_size()}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def group_members() -> dict[str, dict[str, Any]]:
    """Every process group this rank knows: flight-recorder name -> description and global ranks.

    Read from torch's group registry (plain dicts), without calling into any backend.
    """
    if imported("torch") is None or imported("torch.distributed") is None:
        return {}
    try:
        from torch.distributed import distributed_c10d as c10d

        world = c10d._world
        groups = {}
        for pg, name in list(world.pg_names.items()):
            ranks = world.pg_group_ranks.get(pg, {})
            groups[str(name)] = {"ranks": sorted(int(g) for g in ranks),
                                 "default": pg is world.default_pg}
        return groups
    except (AttributeError, RuntimeError) as exc:  # private API: absent in some torch versions
        logger.debug("could not read the process groups: %s", exc)
        return {}
