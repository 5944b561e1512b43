"""The ranks' compact replies to the relay's cells (clorch_repl.wire.framing.compact_reply), end to end.

A rank answers each of the relay's cells with one small signed frame (issue 39: less for the rank
to build and for the notebook to read, every cell, on every rank). What a user would notice if
it went wrong: a cell that never ends (a reply lost or its count wrong), an outcome given to the
wrong rank, output cut short, or a widget's message overtaken by the next cell. Real rank kernels
of a LocalLauncher, a real gloo group, and two relays (two notebook kernels, one after the other,
as when a detached session is connected again) on the same ranks."""

from __future__ import annotations

from clorch_repl.launchers.local import LocalLauncher
from clorch_repl.session.protocol import CellRequest, Status
from clorch_repl.session.relay import Relay
from clorch_repl.session.sink import PlainSink
from clorch_repl.common.topology import resolve_topology
from clorch_repl.wire import PROTOCOL_VERSION
from clorch_repl.wire.framing import MessageDecoder
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


def test_each_rank_gets_its_own_outcome_and_all_its_output_from_compact_replies(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    compact: list[str] = []  # the requests answered in the compact form, as the relay read them
    read = MessageDecoder._compact

    def counted(self, frame):  # type: ignore[no-untyped-def]
        msg = read(self, frame)
        compact.append(msg["parent_header"]["msg_id"])
        return msg

    monkeypatch.setattr(MessageDecoder, "_compact", counted)
    launcher = LocalLauncher(resolve_topology(len(RANKS), backend="gloo"))
    first = second = None
    try:
        launcher.launch(lambda _: None)
        first = Relay(launcher)
        first.connect(lambda k, n: None)
        join = request_code("join", protocol=PROTOCOL_VERSION)
        assert first.execute(CellRequest(join, RANKS, timeout_s=120), silent=True).ok

        # each rank's own outcome, and all its output: the reply's count says how much to wait for
        lines = Lines()
        outcome = cell(first, "import torch.distributed as dist\n"
                              "r = dist.get_rank()\n"
                              "for i in range(40): print(f'{r}:{i}')\n"
                              "if r == 1: raise ValueError(f'only rank {r}')", lines)
        assert outcome.ranks[1].status is Status.ERROR and outcome.ranks[1].error.evalue == "only rank 1"
        assert outcome.ranks[0].status is Status.OK and outcome.ranks[2].status is Status.OK
        for rank in RANKS:
            assert lines.text[rank].split() == [f"{rank}:{i}" for i in range(40)], rank
        assert all(cell(first, "pass").ok for _ in range(20))
        assert len(compact) == len(set(compact)) == len(RANKS) * 22, "not every rank answered every cell compactly"
        # the lean reply's Jupyter form, where asked for (CLORCH_COMPACT_REPLIES=0), reads the same
        monkeypatch.setenv("CLORCH_COMPACT_REPLIES", "0")
        lines = Lines()
        outcome = cell(first, "print(r)\nif r == 2: raise KeyError(r)", lines)
        assert [o.status for o in outcome.ranks.values()] == [Status.OK, Status.OK, Status.ERROR]
        assert {r: t.strip() for r, t in lines.text.items()} == {r: str(r) for r in RANKS}
        assert len(compact) == len(RANKS) * 22, "a rank answered compactly where the request did not ask"
        monkeypatch.delenv("CLORCH_COMPACT_REPLIES")

        # what the notebook sends a rank on its shell between cells (a widget's message) reaches
        # the rank before the next cell: also when both wait in the rank's sockets, behind something
        # it is still busy with (a cell sent any other way than on the same shell socket, such as
        # published on one socket for all ranks, would overtake it: branch publish-only)
        for i in range(15):
            for rank in RANKS:
                client = first.client(rank)
                assert client is not None
                client.execute("import time; time.sleep(0.05)", silent=True, store_history=False)
                client.execute(f"y = {i}", silent=True, store_history=False)
                first.channels.touched(rank)
            assert cell(first, f"assert y == {i}, y").ok, f"a cell overtook what was sent before it ({i})"

        # another notebook kernel takes the ranks over (a detached session connected again)
        first.close()
        first = None
        second = Relay(launcher)
        second.connect(lambda k, n: None)
        assert cell(second, "x = dist.get_rank() * 10").ok
        lines = Lines()
        assert cell(second, "print(x)", lines).ok
        assert {r: t.strip() for r, t in lines.text.items()} == {r: str(r * 10) for r in RANKS}
    finally:
        for relay in (first, second):
            if relay is not None:
                relay.close()
        launcher.stop(5.0)
        launcher.close()
