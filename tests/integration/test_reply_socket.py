"""The ranks' replies to the relay's cells, on one socket for all of them (clorch_repl.session.channels).

Every rank of a local session sends its compact reply to one ``ipc://`` socket of the notebook's
relay instead of its own shell socket (issue 39: fewer sockets for the notebook to look at a cell).
What a user would notice if this went wrong: a cell that never ends (a reply lost), an outcome
given to the wrong rank, a reply socket another local user could reach, or a detached session
whose ranks keep answering a notebook that is gone. Real rank kernels of a LocalLauncher, a real
gloo group, two relays (two notebook kernels, one after the other) on the same ranks."""

from __future__ import annotations

import os
import stat

from clorch_repl.launchers.local import LocalLauncher
from clorch_repl.session.protocol import CellRequest, Status
from clorch_repl.session.relay import Relay
from clorch_repl.session.sink import PlainSink
from clorch_repl.common.topology import resolve_topology
from clorch_repl.wire import PROTOCOL_VERSION
from clorch_repl.wire.requests import request_code

RANKS = (0, 1, 2)


class Lines(PlainSink):
    """Keeps each rank's printed text."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[int, str] = {}

    def output(self, item) -> None:  # type: ignore[no-untyped-def]
        self.text[item.rank] = self.text.get(item.rank, "") + str(item.content.get("text", ""))


def cell(relay: Relay, code: str, sink: PlainSink | None = None):  # type: ignore[no-untyped-def]
    return relay.execute(CellRequest(code, RANKS, timeout_s=60), sink)


def test_every_ranks_reply_reaches_one_private_socket_and_follows_the_notebook_that_asks() -> None:
    launcher = LocalLauncher(resolve_topology(len(RANKS), backend="gloo"))
    first = second = None
    try:
        launcher.launch(lambda _: None)
        first = Relay(launcher)
        first.connect(lambda k, n: None)
        join = request_code("join", protocol=PROTOCOL_VERSION)
        assert first.execute(CellRequest(join, RANKS, timeout_s=120), silent=True).ok

        address = first.channels.reply_to
        assert address is not None and address.startswith("ipc://")
        folder = os.path.dirname(address[len("ipc://"):])
        mode = os.stat(folder)
        assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid(), "another user could reach it"

        # each rank's own outcome and all its output, though every reply came on one socket
        lines = Lines()
        outcome = cell(first, "import os, torch.distributed as dist\n"
                              "r = dist.get_rank()\n"
                              "for i in range(40): print(f'{r}:{i}')\n"
                              "if r == 1: raise ValueError(f'only rank {r}')", lines)
        assert outcome.ranks[1].status is Status.ERROR and outcome.ranks[1].error.evalue == "only rank 1"
        assert outcome.ranks[0].status is Status.OK and outcome.ranks[2].status is Status.OK
        for rank in RANKS:
            assert lines.text[rank].split() == [f"{rank}:{i}" for i in range(40)], rank
        assert all(cell(first, "pass").ok for _ in range(20))

        # another notebook kernel takes the ranks over (a detached session connected again): the ranks
        # answer its socket from its first cell on; the first one's socket is gone with it
        first.close()
        first = None
        assert not os.path.exists(folder)
        second = Relay(launcher)
        second.connect(lambda k, n: None)
        assert second.channels.reply_to not in (None, address)
        outcome = cell(second, "x = dist.get_rank() * 10")
        assert outcome.ok, outcome
        lines = Lines()
        assert cell(second, "print(x)", lines).ok
        assert {r: t.strip() for r, t in lines.text.items()} == {r: str(r * 10) for r in RANKS}
        assert all(cell(second, "pass").ok for _ in range(20))
    finally:
        for relay in (first, second):
            if relay is not None:
                relay.close()
        launcher.stop(5.0)
        launcher.close()
