"""The control-channel question "where are you" (and "abort your groups"): its message types and
what a request may ask, read by both sides.

The notebook sends :data:`PROBE_REQUEST` over a rank's control channel
(:class:`clorch_repl.diagnosis.probe.Prober`); the rank's control thread answers with
:data:`PROBE_REPLY` (:mod:`clorch_repl.kernel.probes`, the answer built by
:func:`clorch_repl.diagnosis.probe.answer`), so the answer comes while the rank's main thread is
blocked in a collective. What the request asks is :class:`ProbeRequest`, written and read here
alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

__all__ = ["PROBE_REPLY", "PROBE_REQUEST", "ProbeRequest"]

PROBE_REQUEST = "clorch_probe_request"
PROBE_REPLY = "clorch_probe_reply"


@dataclass(frozen=True)
class ProbeRequest:
    """What one probe asks of a rank."""

    #: every thread's stack, not only the main thread's (``%clorch why --all-threads``)
    all_threads: bool = False
    #: the flight recorder's group status without its entries (the periodic hang check, the panel)
    light: bool = False
    #: the rank's CPU, memory and GPU figures too (``%clorch top``)
    usage: bool = False
    #: no question but an order: abort the rank's process groups (hang recovery), and report
    abort: bool = False

    def content(self) -> dict[str, Any]:
        """The request message's content."""
        return asdict(self)

    @classmethod
    def read(cls, content: Mapping[str, Any] | None) -> ProbeRequest:
        """The request in a message's ``content``; what it lacks is not asked (an older notebook's)."""
        content = content or {}
        return cls(**{name: bool(content.get(name)) for name in ("all_threads", "light", "usage", "abort")})
