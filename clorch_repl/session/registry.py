"""Session files: how a kernel finds a detached session of this user and what it needs to connect.

``%clorch detach`` writes one JSON file per session, ``NAME.json``, in the user's private runtime
directory (:func:`runtime_dir`: Jupyter's runtime directory, where the connection files of the
user's own kernels live, plus ``clorch/``; 0700, refused when another user could read it). The
file (0600, written atomically so that a reader never sees half of it) holds what connecting takes:
the session's private directory, each rank's connection-file path (those files hold the HMAC
keys, 0600 in that 0700 directory; no key is ever put on a command line or in this file), the
pids of the kernels and supervisors, the topology, the generation of the group (the count of its
in-place re-forms, under which the next re-form meets: a connecting kernel must go on counting
from it), ``keep_for_s``, the session's own settings that every kernel driving it must use (its
``--hang-notice``, and its ``--suspend-after``: settings of the session, not of the kernel that
happened to start it), and
the kernel that drove it when written. Who drives the session *now*
is the hold file's business (:mod:`clorch_repl.host.hold`), which the supervisors read.

Everything read back is validated (:func:`parse_record`) and any mistake named with its file, since
a file can be stale (the session ended while the machine was down) or edited by hand.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..common.atomic import remove_quietly, write_json_atomic
from ..diagnosis import DEFAULT_HANG_NOTICE_S
from ..errors import ConfigError
from ..common.topology import Topology

logger = logging.getLogger(__name__)

VERSION = 1
#: ``%clorch detach``'s default ``--keep-for``: an hour without any kernel connected.
DEFAULT_KEEP_FOR_S = 3600.0
#: The longest ``--keep-for``, in days. Why a limit: ranks kept with no kernel driving them hold
#: their GPUs and memory with nobody watching, and a session nobody connected to for a month is a
#: forgotten one; without a limit a slip of the keyboard (``99999d``, 270 years) kept them for
#: good, the supervisors ending them only at a reboot. A session in use is never ended by it:
#: every ``%clorch connect`` starts the count again, and it counts only while no kernel drives it.
MAX_KEEP_FOR_DAYS = 30
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


@dataclass(frozen=True)
class RankEntry:
    """One rank of a detached session."""

    rank: int
    connection_file: str
    pid: int
    supervisor_pid: int
    started_at: float


@dataclass(frozen=True)
class SessionRecord:
    """The content of a session file (see the module docstring)."""

    name: str
    launcher: str
    dir: str
    topology: Topology
    ranks: tuple[RankEntry, ...]
    generation: int
    keep_for_s: float
    owner_pid: int
    written_at: float = field(default_factory=time.time)
    uid: int = field(default_factory=os.getuid)
    #: the host the ranks run on (a detached session's ranks are local to the kernel that detached
    #: it; its file may be seen from other hosts too, where the runtime directory is in a shared home)
    host: str = field(default_factory=socket.gethostname)
    #: the session's ``--hang-notice`` (seconds; 0: off), for cells that give none: ``%clorch start
    #: --hang-notice`` set it for the session, so the kernel that detaches it and every kernel that
    #: connects keep it (a file written before it was recorded: the default)
    hang_notice_s: float = DEFAULT_HANG_NOTICE_S
    #: the session's idle suspend (``%clorch start --suspend-after``, ``%clorch suspend --after``;
    #: seconds, 0: off), kept as its ``hang_notice_s`` is: every kernel that connects arms it
    #: again (a file written before it was recorded: off)
    suspend_after_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["version"] = VERSION
        data["topology"]["devices"] = list(self.topology.devices)
        data["ranks"] = [asdict(r) for r in self.ranks]
        return data


def check_name(name: str) -> str:
    """A session name: letters, digits, ``_ . -``, at most 64, starting with a letter or digit
    (it becomes a file name, so nothing else is accepted)."""
    if not _NAME.match(name or ""):
        raise ConfigError(f"session name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting "
                          "with a letter or digit (e.g. --name alice-train)")
    return name


def parse_duration(value: str, what: str = "--keep-for") -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``2h`` or ``1d``; more than zero and at most
    :data:`MAX_KEEP_FOR_DAYS` days."""
    match = _DURATION.match(value or "")
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{what} must be a duration above zero such as 90s, 30m, 2h or 1d; got {value!r}")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_KEEP_FOR_DAYS * _UNITS["d"]:
        raise ConfigError(f"{what} must be at most {MAX_KEEP_FOR_DAYS}d ({MAX_KEEP_FOR_DAYS} days): ranks that no "
                          f"kernel drives hold their GPUs with nobody watching; got {value!r}. Give "
                          f"{MAX_KEEP_FOR_DAYS}d or less: each %clorch connect starts the count again")
    return seconds


def runtime_dir(create: bool = True) -> str:
    """This user's private directory of session files (created 0700); ConfigError when it is not
    this user's alone (another user could then read the connection details)."""
    from jupyter_core.paths import jupyter_runtime_dir

    path = os.path.join(jupyter_runtime_dir(), "clorch")
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path} must be a directory of this user's with mode 0700 (it holds what connects to "
                          f"your sessions); it is {oct(st.st_mode & 0o777)} owned by uid {st.st_uid}: fix it with "
                          f"chmod 700 {path}, or remove it")
    return path


def path_of(name: str) -> str:
    return os.path.join(runtime_dir(), f"{check_name(name)}.json")


def default_name() -> str:
    """``<user>-<n>``, the smallest n with no session file yet."""
    import getpass

    user = re.sub(r"[^A-Za-z0-9_.-]", "", getpass.getuser()) or "session"
    n = 1
    while os.path.exists(path_of(f"{user}-{n}")):
        n += 1
    return f"{user}-{n}"


def write(record: SessionRecord) -> str:
    """Write ``record`` as its session file (0600, atomically); its path."""
    path = path_of(record.name)
    write_json_atomic(path, record.to_json())
    return path


def _need(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}: {key!r} is missing or not a {getattr(kind, '__name__', kind)}; the file is "
                          "damaged: remove it (the session's ranks end by themselves once nobody is connected)")
    return value


def _seconds(data: dict[str, Any], key: str, default: float, where: str) -> float:
    """A setting of the session in seconds (0 or more), ``default`` where the file has none."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"{where}: {key!r} {value!r} is not a number of seconds (0 or more); the file is damaged: "
                          "remove it (the session's ranks end by themselves once nobody is connected)")
    return float(value)


def parse_record(data: Any, where: str) -> SessionRecord:
    """A :class:`SessionRecord` from a session file's JSON, every field checked; ``where`` names the file."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a clorch session file (no JSON object): remove it")
    if data.get("version") != VERSION:
        raise ConfigError(f"{where} was written by another clorch_repl version (version {data.get('version')!r}, "
                          f"this one reads {VERSION}): connect from a kernel with that version, or remove it")
    topo = _need(data, "topology", dict, where)
    devices = _need(topo, "devices", list, where)
    try:
        topology = Topology(nproc=int(_need(topo, "nproc", int, where)),
                            devices=tuple(None if d is None else int(d) for d in devices),
                            backend=str(_need(topo, "backend", str, where)),
                            timeout_s=float(_need(topo, "timeout_s", (int, float), where)),
                            cpu_bind=str(topo.get("cpu_bind", "none")))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: its topology is damaged ({exc}): remove the file") from None
    ranks = []
    for i, entry in enumerate(_need(data, "ranks", list, where)):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: rank entry {i} is not an object: remove the file")
        ranks.append(RankEntry(rank=_need(entry, "rank", int, where),
                               connection_file=_need(entry, "connection_file", str, where),
                               pid=_need(entry, "pid", int, where),
                               supervisor_pid=_need(entry, "supervisor_pid", int, where),
                               started_at=float(_need(entry, "started_at", (int, float), where))))
    if [r.rank for r in ranks] != list(range(topology.nproc)):
        raise ConfigError(f"{where}: it lists ranks {[r.rank for r in ranks]} for {topology.nproc} rank(s): remove it")
    hang_notice = _seconds(data, "hang_notice_s", DEFAULT_HANG_NOTICE_S, where)  # absent: a file from before it was kept
    suspend_after = _seconds(data, "suspend_after_s", 0.0, where)
    record = SessionRecord(
        name=check_name(_need(data, "name", str, where)), launcher=_need(data, "launcher", str, where),
        dir=_need(data, "dir", str, where), topology=topology, ranks=tuple(ranks),
        generation=_need(data, "generation", int, where),
        keep_for_s=float(_need(data, "keep_for_s", (int, float), where)),
        owner_pid=_need(data, "owner_pid", int, where),
        written_at=float(_need(data, "written_at", (int, float), where)), uid=_need(data, "uid", int, where),
        host=str(data.get("host") or "?"), hang_notice_s=hang_notice, suspend_after_s=suspend_after)
    if record.uid != os.getuid():
        raise ConfigError(f"{where} belongs to uid {record.uid}, not to you: it is not yours to connect to")
    if record.generation < 0 or record.keep_for_s <= 0:
        raise ConfigError(f"{where}: generation {record.generation} / keep_for_s {record.keep_for_s} out of range: "
                          "remove it")
    return record


def read(name: str) -> SessionRecord:
    """The session called ``name``; ConfigError naming what to do when there is none or it is bad."""
    path = path_of(name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"{path} must be a regular file of yours with mode 0600; remove it")
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        known = names()
        raise ConfigError(f"no detached session called {name!r}"
                          + (f"; there are: {', '.join(known)}" if known else "; %clorch sessions lists them")) from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}): remove it") from None
    return parse_record(data, path)


def names() -> list[str]:
    """The names of this user's session files, sorted."""
    folder = runtime_dir()
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json") and _NAME.match(f[:-5]))


def elsewhere(record: SessionRecord) -> str | None:
    """The other host a session's ranks run on, or None when they run here (or the file, from
    before the host was recorded, does not say). Seen from another host, a session can be
    neither judged ended nor connected to: its pids and folder are that host's."""
    return None if record.host in ("?", socket.gethostname()) else record.host


def live(record: SessionRecord) -> bool:
    """Whether any of the session's ranks still runs (a file of a session that ended while the
    machine was down, or whose supervisors were killed, is stale)."""
    from ..common.procs import pid_running

    return os.path.isdir(record.dir) and any(pid_running(r.pid) for r in record.ranks)


def remove(name: str, session_dir: str | None = None) -> None:
    """Remove the session file ``name`` (only if it still names ``session_dir``, when given)."""
    path = path_of(name)
    if session_dir is not None:
        try:
            with open(path) as fh:
                if json.load(fh).get("dir") != session_dir:
                    return
        except (OSError, ValueError, AttributeError):
            return
    remove_quietly(path)
