"""Who runs where: validating rank counts, device lists and backends once, for every entry point.

``%clorch start`` and the Python API (``local_session``, ``launch``) accept the same words
(``nproc``, ``devices``, ``backend``, ``timeout``) and must refuse the same mistakes with the same
one-line message, before any process starts. Both call :func:`resolve_topology`; its refusals
(:class:`~clorch_repl.errors.TopologyError`) name the options as the Python API does, and the
magics say them as their user typed them (``--nproc``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from .. import cuda
from . import env_vars
from ..errors import ConfigError, TopologyError

if TYPE_CHECKING:
    from ..launchers.base import LaunchOptions

BACKENDS = ("nccl", "gloo")
CPU_DEFAULT_NPROC = 2
#: The environment variable that gives ``%clorch start`` its default ``--nproc`` (clorch-notebook
#: sets it for a whole run: ``--nproc``); read by clorch_repl.magics.core.
NPROC_ENV = env_vars.NPROC.name


@dataclass(frozen=True)
class Topology:
    """The validated layout of one group of ranks on this host.

    ``devices[r]`` is the physical GPU index of rank ``r`` (the host's number for it), or None for
    a CPU rank. ``timeout_s`` is the process-group timeout (collectives, rendezvous).
    """

    nproc: int
    devices: tuple[int | None, ...]
    backend: str
    timeout_s: float
    #: ``numa``: each GPU rank binds itself to its GPU's NUMA node (clorch_repl.kernel.numa); ``none``
    cpu_bind: str = "none"
    #: rank ``r``'s GPU as its own process names it (``cuda:N``: N is its position in its
    #: CUDA_VISIBLE_DEVICES, LOCAL_RANK under torchrun's convention); empty: ranks of one host,
    #: where it is the rank (:meth:`host_gpus`)
    in_process: tuple[int | None, ...] = ()

    @property
    def uses_gpu(self) -> bool:
        return self.devices[0] is not None

    def device_label(self, rank: int) -> str:
        """The rank's device as its code names it (``cuda:{LOCAL_RANK}``), and the host's GPU
        number where that differs (``cuda:0 (GPU 2)`` with ``--devices 2,3``)."""
        dev = self.devices[rank]
        if dev is None:
            return "cpu"
        own = self.in_process[rank] if self.in_process else rank
        return f"cuda:{dev}" if own in (None, dev) else f"cuda:{own} (GPU {dev})"

    def host_gpus(self) -> tuple[str, ...]:
        """Every rank's GPU, by rank, for ranks that share this host (local rank = rank): what
        each rank's CUDA_VISIBLE_DEVICES lists (:func:`clorch_repl.wire.rank_env.visible_devices`)."""
        if not self.uses_gpu:
            return ()
        return tuple(self.visible_devices(r) for r in range(self.nproc))

    def visible_devices(self, rank: int) -> str:
        """CUDA_VISIBLE_DEVICES for one rank: its device, translated through the caller's own
        CUDA_VISIBLE_DEVICES (device 0 of a notebook that sees "2,3" is physical GPU 2); "" for
        a CPU rank, so that it never touches a GPU."""
        index = self.devices[rank]
        if index is None:
            return ""
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        return visible[index] if index < len(visible) else str(index)


#: ``2-5`` in a list of integers (no signs: a negative number is a single item)
_RANGE = re.compile(r"(\d+)\s*-\s*(\d+)")


def parse_int_list(value: str | Iterable[int] | None, what: str) -> list[int] | None:
    """``"0,1"`` or ``[0, 1]`` to ``[0, 1]``; None stays None. Refuses junk with one line. A
    string in one pair of quotes is read without them, as a shell would take them off (the magics
    take them off before, :func:`clorch_repl.magics.arguments.split_line`; IPython's own reading
    kept them: ``'"0,2"'``).
    A range ``0-3`` stands for 0,1,2,3: every message names rank sets that way
    (:func:`clorch_repl.common.rank_sets.ranks_text`), so what a message says can be typed back."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1].strip()
        if not text:
            raise ConfigError(f"{what} is empty: give comma-separated integers, e.g. 0,1 or 0-3")
        items: list[int] = []
        for part in text.split(","):
            part = part.strip()
            span = _RANGE.fullmatch(part)
            if span:
                first, last = int(span.group(1)), int(span.group(2))
                if first > last:
                    raise ConfigError(f"{what}: the range {part} runs backwards; write it {last}-{first}")
                items.extend(range(first, last + 1))
                continue
            try:
                items.append(int(part))
            except ValueError:
                raise ConfigError(f"{what} must be comma-separated integers or ranges, e.g. 0,1 or 0-3; "
                                  f"got {value!r}") from None
        return items
    try:
        items = [int(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a list of integers; got {value!r}") from None
    if any(isinstance(v, bool) for v in value):
        raise ConfigError(f"{what} must be a list of integers; got {value!r}")
    return items


def check_unique_in_range(items: Sequence[int], upper: int, what: str, unit: str) -> None:
    """Refuse repeated or out-of-range entries in a rank or device list."""
    seen: set[int] = set()
    for item in items:
        if item in seen:
            raise ConfigError(f"{what} repeats {item}: each {unit} may appear once")
        seen.add(item)
        if item < 0:
            raise ConfigError(f"{what} names {unit} {item}: {unit} numbers start at 0")
        if item >= upper:
            hint = (f"0-{upper - 1}" if upper > 1 else "only 0") if upper > 0 else "none exist"  # (as ranks are spelled)
            raise ConfigError(f"{what} names {unit} {item}, which does not exist ({hint})")


def parse_number(value: float | str | None, what: str, unit: str, *, zero: str | None = None) -> float | None:
    """``value`` as a finite number of ``unit`` above 0, or None when not given. With ``zero``
    (what 0 means, e.g. "off"), 0 is accepted too. Every number option of the package is read
    here, so that all of them refuse the same things (text, inf, nan, negatives) in the same words."""
    if value is None:
        return None
    if isinstance(value, bool):  # float(True) is 1.0: never a number the user meant
        raise ConfigError(f"{what} must be a number of {unit}; got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        means = f" (0 turns it {zero})" if zero else ""
        raise ConfigError(f"{what} must be a number of {unit}{means}; got {value!r}") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and zero is None):
        floor = f"0 ({zero}) or a positive number" if zero else "a positive number"
        raise ConfigError(f"{what} must be {floor} of {unit}; got {value!r}")
    return number


#: The shortest process-group timeout accepted: below it the first collective (gloo's pairs
#: connecting, NCCL's communicator) times out by itself. A user who typed the session's
#: ``--timeout`` meaning a cell's time limit (``%%distributed --timeout``) is told the difference.
MIN_GROUP_TIMEOUT_S = 1.0


def parse_timeout(value: float | str | None, what: str = "timeout") -> float | None:
    """Seconds as a positive finite float, or None for no limit."""
    return parse_number(value, what, "seconds")


def resolve_topology(nproc: int | str | None = None, devices: str | Iterable[int] | None = None,
                     backend: str | None = None, timeout_s: float | str | None = None,
                     gpu_count: int | None = None) -> Topology:
    """Turn what the user typed into a :class:`Topology`, or raise :class:`TopologyError`
    (a ConfigError whose message names the options as the Python API does, ``nproc``; a magic says
    them as its user typed them, ``--nproc``: :meth:`TopologyError.spelled`).

    Defaults: every visible GPU with nccl; with no GPU, 2 CPU ranks with gloo. ``gpu_count`` is
    looked up with :func:`clorch_repl.cuda.device_count` (which never initialises CUDA here)
    unless given.
    """
    if nproc is not None:
        try:
            nproc = int(nproc)
        except (TypeError, ValueError):
            raise TopologyError("{nproc} must be a whole number of ranks; got {got}", got=repr(nproc)) from None
        if nproc < 1:
            raise TopologyError("{nproc} must be at least 1; got {got}", got=nproc)
    backend = _backend(backend)
    with _option("timeout"):
        timeout = parse_timeout(timeout_s, "timeout")
    if timeout is not None and timeout < MIN_GROUP_TIMEOUT_S:
        raise TopologyError("{timeout} {got:g} s is the process group's: every collective that waits longer for "
                            "another rank fails, and a first collective alone takes longer; give {least:g} s or "
                            "more ({limit})",
                            got=timeout, least=MIN_GROUP_TIMEOUT_S)
    with _option("devices"):
        device_list = parse_int_list(devices, "devices")
    if gpu_count is None:
        gpu_count = cuda.device_count() if (device_list is not None or backend != "gloo") else 0

    if device_list is not None:
        if not device_list:
            raise TopologyError("{devices} is empty: name at least one GPU")
        listed = ",".join(map(str, device_list))
        # What can be judged from the input alone first, then what depends on the machine.
        with _option("devices"):
            check_unique_in_range(device_list, max(device_list) + 1, "devices", "GPU")
        if nproc is not None and nproc != len(device_list):
            raise TopologyError("{nproc} {n} and {devices} {listed} disagree: give one device per rank, or leave "
                                "one of them out", n=nproc, listed=listed)
        if gpu_count == 0:
            raise TopologyError("{devices} {listed} were given, but this machine has no usable GPU; leave out "
                                "{devices} to run CPU ranks with gloo", listed=listed)
        with _option("devices"):
            check_unique_in_range(device_list, gpu_count, "devices", "GPU")
        nproc = len(device_list)
        backend = backend or "nccl"
        placed: tuple[int | None, ...] = tuple(device_list)
    elif backend == "gloo" or gpu_count == 0:
        if backend == "nccl":
            raise TopologyError("{backend} nccl needs GPUs and this machine has none; use {backend} gloo")
        backend = "gloo"
        nproc = nproc or CPU_DEFAULT_NPROC
        placed = (None,) * nproc
    else:
        backend = backend or "nccl"
        nproc = nproc or gpu_count
        if nproc > gpu_count:
            raise TopologyError("{nproc} {n} needs {n} GPUs but {count} are visible: one NCCL rank per GPU (two "
                                "ranks cannot share one GPU)", n=nproc, count=gpu_count)
        placed = tuple(range(nproc))
    return Topology(nproc=nproc, devices=placed, backend=backend,
                    timeout_s=timeout if timeout is not None else 600.0)


def host_topology(nproc: str | None, devices: str | None, backend: str | None, timeout: str | None) -> Topology:
    """``%clorch start``'s ranks on this host: :func:`resolve_topology`, with ``--nproc``'s default
    ``$CLORCH_NPROC`` when set (``clorch-notebook run --nproc N`` sets it without editing the
    notebook). A refusal about a number that came from there names the variable, not ``--nproc``,
    which the user did not type."""
    from_env = nproc is None and devices is None and bool(os.environ.get(NPROC_ENV, "").strip())
    if from_env:
        nproc = os.environ[NPROC_ENV].strip()
        if not nproc.isdigit() or int(nproc) < 1:
            raise ConfigError(f"{NPROC_ENV}={nproc!r} in the environment must be a whole number of ranks "
                              ">= 1 (it is %clorch start's default --nproc); fix or unset it")
    try:
        return resolve_topology(nproc, devices, backend, timeout)
    except TopologyError as exc:
        raise (exc.naming(nproc=f"${NPROC_ENV}") if from_env else exc) from None


def _backend(backend: str | None) -> str | None:
    """The backend asked for, lower case, or None; one of :data:`BACKENDS`."""
    if backend is None:
        return None
    backend = str(backend).lower()
    if backend not in BACKENDS:
        raise TopologyError("{backend} must be one of {known}; got {got}", known=", ".join(BACKENDS),
                            got=repr(backend))
    return backend


@contextlib.contextmanager
def _option(name: str) -> Iterator[None]:
    """A shared check's refusal (:func:`parse_int_list`, :func:`parse_number`, whose message
    begins with the ``name`` it was given) as a :class:`TopologyError`: the option then is named
    as the caller's user typed it, like every other refusal of the topology."""
    try:
        yield
    except TopologyError:
        raise
    except ConfigError as exc:
        text = str(exc)
        if not text.startswith(name):
            raise
        raise TopologyError("{%s}{rest}" % name, rest=text[len(name):]) from None


def remote_topology(options: "LaunchOptions", backend: str | None, timeout_s: float | str | None, *,
                    given_nproc: str | None = None, given_devices: str | None = None,
                    launcher: str = "slurm") -> Topology:
    """The topology of ranks on other hosts, before they call back: ``nodes x nproc_per_node``
    ranks; their devices and (unless given) the backend are filled in by the launcher from what
    the ranks report (backend "" until then)."""
    if given_nproc is not None or given_devices is not None:
        raise ConfigError(f"--nproc and --devices are for --launcher local; with --launcher {launcher} give "
                          "--nodes and --nproc-per-node (each rank uses its node's GPU number LOCAL_RANK)")
    if options.nproc_per_node is None:
        raise ConfigError(f"--launcher {launcher} needs --nproc-per-node: how many ranks to start on each node "
                          "(one per GPU on GPU nodes)")
    return nodes_topology(options.nodes, options.nproc_per_node, backend, timeout_s)


def nodes_topology(nodes: int, nproc_per_node: int, backend: str | None, timeout_s: float | str | None, *,
                   timeout_name: str = "timeout", default_backend: str = "") -> Topology:
    """``nodes x nproc_per_node`` ranks placed on nodes by a launcher of the cluster (a session's
    srun or attach ranks, a batch job's srun step), the one reading of such a request: no device
    is known here (each rank uses its node's GPU ``LOCAL_RANK``; a session fills them in when the
    ranks call back), the backend is checked, ``default_backend`` where none is given ("": decided
    once the ranks report their GPUs), and the timeout read as ``timeout_name``."""
    backend = _backend(backend)
    with _option(timeout_name):
        timeout = parse_timeout(timeout_s, timeout_name)
    nproc = nodes * nproc_per_node
    return Topology(nproc=nproc, devices=(None,) * nproc, backend=backend or default_backend,
                    timeout_s=timeout if timeout is not None else 600.0)
