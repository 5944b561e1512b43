"""A rank's kernel answers another client's request that came while a relay's (lean) cell ran.

The lean path replies on the shell socket past ipykernel's ZMQStream (clorch_repl.kernel.lean_execute);
the socket's descriptor is edge-triggered, and the send cleared the signal of a request queued
meanwhile, which was then never read, nor anything its client sent after it (seen as a kernel that
connects to a detached session never hearing the ranks once they finished the last kernel's cell).
Real rank kernels of a LocalLauncher, a real gloo group, a second jupyter_client client per rank."""

from __future__ import annotations

import time
from queue import Empty

from jupyter_client import BlockingKernelClient

from clorch_repl.launchers.local import LocalLauncher
from clorch_repl.session.protocol import CellRequest
from clorch_repl.session.relay import Relay
from clorch_repl.common.topology import resolve_topology
from clorch_repl.wire import PROTOCOL_VERSION
from clorch_repl.wire.requests import request_code

CELL_S = 4.0


def test_a_request_sent_during_a_lean_cell_is_answered_when_it_ends() -> None:
    launcher = LocalLauncher(resolve_topology(2, backend="gloo"))
    relay = None
    others: list[BlockingKernelClient] = []
    try:
        launcher.launch(lambda _: None)
        relay = Relay(launcher)
        relay.connect(lambda k, n: None)
        join = request_code("join", protocol=PROTOCOL_VERSION)  # the group, as a session forms it
        assert relay.execute(CellRequest(join, (0, 1), timeout_s=120), silent=True).ok
        started = relay.begin(CellRequest(f"import time\ntime.sleep({CELL_S})", (0, 1)))
        sent_at = time.monotonic()
        for proc in launcher.ranks:  # another client of each rank, asking while the cell runs
            client = BlockingKernelClient()
            client.load_connection_info(proc.connection_info())
            client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
            client.kernel_info()
            others.append(client)
        assert relay.finish(started, None).ok
        for rank, client in enumerate(others):
            try:
                reply = client.get_shell_msg(timeout=30)
            except Empty:
                raise AssertionError(f"rank {rank} never answered a kernel_info sent while its cell ran") from None
            assert reply["msg_type"] == "kernel_info_reply"
            client.kernel_info()  # and what the same client sends next
            assert client.get_shell_msg(timeout=10)["msg_type"] == "kernel_info_reply"
        assert time.monotonic() - sent_at < CELL_S + 20
    finally:
        for client in others:
            client.stop_channels()
        if relay is not None:
            relay.close()
        launcher.stop(5.0)
        launcher.close()
