"""Launchers by name: the entry-point group ``clorch_repl.launchers`` (see the package docstring)."""


from __future__ import annotations

import logging
from importlib.metadata import entry_points

from ..errors import ConfigError
from .base import Launcher

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


