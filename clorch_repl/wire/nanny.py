"""What a rank's nanny (:mod:`clorch_repl.host.nanny`) and the notebook's callback endpoint
(:mod:`clorch_repl.launchers.callback`) say to each other: one JSON object per ZeroMQ frame, over CurveZMQ.

Every message has ``op`` (below); the nanny's also carry ``token`` (the session's, from the
connect file) and ``rank``. Requests that expect an answer carry ``id``, and the answer is a
``reply`` with the same ``id`` (and ``error`` when the request failed on the nanny).

The protocol has a version, :data:`PROTOCOL` (the wire contract's, :mod:`clorch_repl.wire`),
written into every connect file and sent with every registration. A nanny refuses a connect file of another version, and the notebook refuses a nanny
of another version, each naming both versions: a node with another clorch_repl installed would
otherwise fail later, and obscurely. Raise it whenever a message changes meaning, and whenever
what the notebook asks of the kernel a nanny starts changes (the kernel's module, the requests it
answers: :mod:`clorch_repl.kernel.requests`): the version is the one check a node meets before
its rank runs anything.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from . import PROTOCOL_VERSION, mismatch

__all__ = ["PROTOCOL", "FromNanny", "ToNanny", "decode", "encode", "mismatch"]

logger = logging.getLogger(__name__)

#: The version of this protocol: the contract's one version (:data:`clorch_repl.wire.PROTOCOL_VERSION`,
#: whose comment keeps the history), which a rank's join checks too.
PROTOCOL = PROTOCOL_VERSION


class ToNanny:
    """What the notebook sends a nanny."""

    #: the group's place (master address and port, backend, timeout, GPU, env, cwd): start the kernel
    CONFIG = "config"
    INTERRUPT = "interrupt"
    #: ``id``: the kernel's main-thread stack (``text``)
    STACK = "stack"
    #: ``id``: the kernel's resident bytes and GPU memory (``rss``, ``gpu``)
    USAGE = "usage"
    #: ``id``, ``lines``: the tail of the rank's log (``text``)
    LOG = "log"
    #: ``id``, ``grace_s``: end the kernel and all it started (``how`` it ended)
    STOP_KERNEL = "stop_kernel"
    START_KERNEL = "start_kernel"
    START_SPARE = "start_spare"
    #: ``id``, ``action`` (suspend or resume): the CUDA driver's checkpoint of the kernel's process on
    #: the nanny's host (clorch_repl.host.cuda_checkpoint); the reply's ``outcome`` is the helper's report
    CHECKPOINT = "checkpoint"
    #: ``code`` (and ``why`` when the rank was declared lost): end the nanny
    EXIT = "exit"
    #: ``why``: the registration was refused; the nanny ends
    REFUSED = "refused"
    HEARTBEAT = "hb"


class FromNanny:
    """What a nanny sends the notebook."""

    #: ``protocol``, ``world_size``, ``local_rank``, ``host``, ``address``, ``gpus``, ...
    REGISTER = "register"
    #: ``info`` (the kernel's connection info), ``pid``: the kernel listens
    KERNEL = "kernel"
    #: ``how``, ``report``: the kernel has ended
    EXITED = "exited"
    REPLY = "reply"
    HEARTBEAT = "hb"


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict[str, Any] | None:
    """The message in ``frame``, or None for anything that is not a JSON object (dropped)."""
    try:
        message = json.loads(frame)
    except (ValueError, UnicodeDecodeError):
        logger.debug("dropped a frame that is not JSON")
        return None
    return message if isinstance(message, dict) else None
