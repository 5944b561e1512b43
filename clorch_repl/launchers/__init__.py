"""Where ranks run: the launchers behind ``%clorch start --launcher NAME``.

:mod:`.base` holds the contract (:class:`Launcher`, :class:`RankHandle`); ``local`` (children of
this kernel), ``slurm`` (``srun``) and ``attach`` (any launcher the user runs: torchrun, srun,
mpirun...) implement it. They are found by name in the entry-point group ``clorch_repl.launchers``
(declared in pyproject.toml), so another package can add one with::

    [project.entry-points."clorch_repl.launchers"]
    mine = "my_package.launcher:MyLauncher"

A launcher class is constructed with ``(topology, options)`` where ``options`` is the
:class:`~.base.LaunchOptions` of the start command; ``local`` ignores what it does not use.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from ..errors import ConfigError
from .base import Launcher, LaunchOptions, Progress, RankHandle
from .local import LocalLauncher

logger = logging.getLogger(__name__)

GROUP = "clorch_repl.launchers"
#: The launchers of this package, also when it runs from a source tree that was never installed
#: (its entry points are then unknown to importlib.metadata).
_BUILTIN = {
    "local": "clorch_repl.launchers.local:LocalLauncher",
    "slurm": "clorch_repl.launchers.slurm:SlurmLauncher",
    "attach": "clorch_repl.launchers.attach:AttachLauncher",
}


def names() -> list[str]:
    """Every launcher name that can be asked for."""
    return sorted(set(_BUILTIN) | {ep.name for ep in entry_points(group=GROUP)})


def launcher_class(name: str) -> type[Launcher]:
    """The launcher registered as ``name``; a ConfigError listing the names there are otherwise."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if found:
        cls = found[0].load()
    elif name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        import importlib

        cls = getattr(importlib.import_module(module), attr)
    else:
        raise ConfigError(f"--launcher {name!r} is not known; the launchers are: {', '.join(names())}")
    if not (isinstance(cls, type) and issubclass(cls, Launcher)):
        raise ConfigError(f"the launcher {name!r} ({cls!r}) is not a clorch_repl.launchers.Launcher")
    return cls


__all__ = ["GROUP", "Launcher", "LaunchOptions", "LocalLauncher", "Progress", "RankHandle", "launcher_class",
           "names"]
