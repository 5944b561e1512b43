"""``main`` for a launch: a "module:function" string or an importable callable, checked in the
parent so a typo fails at once instead of in every rank."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

from ..errors import ConfigError


def _walk(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def target_spec(main: Any) -> str:
    """Validate ``main`` and return it as "module:qualname", the form ranks import."""
    if isinstance(main, str):
        module, sep, qualname = main.partition(":")
        if not sep or not module or not qualname:
            raise ConfigError(f"main must be 'module:function' (e.g. 'my.training:train_worker'); got {main!r}")
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"main {main!r}: module {module!r} cannot be imported ({exc})") from None
        if found is None:
            raise ConfigError(f"main {main!r}: no module named {module!r} on sys.path; check the spelling or "
                              "add its folder to sys.path")
        fn = load_target(main, what="main")
        if not callable(fn):
            raise ConfigError(f"main {main!r} is not callable")
        return main
    if not callable(main):
        raise ConfigError(f"main must be 'module:function' or a function; got {type(main).__name__}")
    module = getattr(main, "__module__", None)
    qualname = getattr(main, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ConfigError(f"main {main!r} cannot be imported by the ranks (a lambda or nested function); "
                          "define it at the top level of a module and pass 'module:function'")
    if module == "__main__":
        raise ConfigError(f"main {qualname!r} is defined in __main__ (a notebook cell or the script itself), "
                          "which the ranks cannot import; move it into a .py module and pass 'module:function'")
    spec = f"{module}:{qualname}"
    if load_target(spec, what="main") is not main:
        raise ConfigError(f"main {spec!r} does not resolve to the function given; pass 'module:function'")
    return spec


def load_target(spec: str, what: str = "main") -> Callable[..., Any]:
    module, _, qualname = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything; reported
        raise ConfigError(f"{what} {spec!r}: importing {module!r} failed: {type(exc).__name__}: {exc}") from None
    try:
        return _walk(mod, qualname)
    except AttributeError:
        raise ConfigError(f"{what} {spec!r}: module {module!r} has no attribute {qualname!r}") from None
