"""How a remote rank's nanny finds the notebook: the connect info, where it is read from, the heartbeat.

Both ends read this: the notebook's callback endpoint (:mod:`clorch_repl.launchers.callback`)
writes the connect info and hands it to the launcher, and a rank's nanny
(:mod:`clorch_repl.host.nanny`, on the rank's host) reads it from ``CLORCH_CONNECT`` or the file
named by ``CLORCH_CONNECT_FILE`` and calls back. It lived in the callback module, which made the
nanny (the rank's side) import the notebook's endpoint; here it is the contract both import.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Mapping

from ..common import env_vars
from ..errors import ClorchError
from .nanny import PROTOCOL, mismatch

logger = logging.getLogger(__name__)

#: How long a remote rank's nanny keeps its kernel after the notebook stopped answering.
ORPHAN_TIMEOUT_S = 60.0
#: The environment variable that names the connect file, on every node.
CONNECT_FILE_ENV = env_vars.CONNECT_FILE.name
#: The connect file's content itself, where the launcher can hand the ranks an environment (srun
#: passes the notebook's environment to every task): no shared filesystem is needed then.
CONNECT_ENV = env_vars.CONNECT.name
#: How often both ends send a heartbeat.
HEARTBEAT_S = 1.0


def route_address(peer: str) -> str:
    """The address of this host's interface that routes to ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


@dataclass(frozen=True)
class ConnectInfo:
    """What the connect file holds."""

    address: str
    port: int
    server_key: str  # the endpoint's Curve public key (Z85)
    token: str
    session: str
    #: how long a nanny keeps its kernel without a word from the notebook
    orphan_timeout_s: float = ORPHAN_TIMEOUT_S

    def dumps(self) -> str:
        return json.dumps({"protocol": PROTOCOL, "address": self.address, "port": self.port,
                           "server_key": self.server_key, "token": self.token, "session": self.session,
                           "orphan_timeout_s": self.orphan_timeout_s})

    def write(self, path: str) -> None:
        """Write the file readable by this user only (0600), atomically."""
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.dumps())
        os.replace(tmp, path)

    @classmethod
    def loads(cls, text: str, where: str) -> "ConnectInfo":
        try:
            data = json.loads(text)
            why = mismatch(data.get("protocol") if isinstance(data, dict) else None, f"the connect info in {where}")
            if why:
                raise ClorchError(why)
            return cls(str(data["address"]), int(data["port"]), str(data["server_key"]), str(data["token"]),
                       str(data["session"]), float(data.get("orphan_timeout_s", ORPHAN_TIMEOUT_S)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ClorchError(f"cannot read the clorch connect info in {where} ({exc}); it is written by the "
                              "notebook's %clorch start") from None

    @classmethod
    def read(cls, path: str) -> "ConnectInfo":
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError as exc:
            raise ClorchError(f"cannot read the clorch connect file {path} ({exc}); it is written by the "
                              f"notebook's %clorch start and must be readable on this node (a shared home "
                              f"directory, or copy it keeping its 0600 mode)") from None
        return cls.loads(text, path)

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> "ConnectInfo":
        """From ``CLORCH_CONNECT`` (the content) or else ``CLORCH_CONNECT_FILE`` (a path)."""
        if env.get(CONNECT_ENV):
            return cls.loads(env[CONNECT_ENV], CONNECT_ENV)
        path = env.get(CONNECT_FILE_ENV)
        if not path:
            raise ClorchError(f"{CONNECT_FILE_ENV} is not set: it names the connect file that %clorch start "
                              "wrote (0600); set it in the environment, never on the command line")
        return cls.read(path)
