"""The nanny protocol's version is checked both ways (clorch_repl.wire.nanny): a
connect file of another version is refused by the nanny, a nanny of another version by the
notebook's endpoint, each naming both versions and what to do. Real sockets (CurveZMQ on
loopback), no process."""

from __future__ import annotations

import json
import pathlib

import pytest
import zmq

from clorch_repl.errors import ClorchError
from clorch_repl.launchers.callback import CallbackServer
from clorch_repl.wire.connect import ConnectInfo
from clorch_repl.wire.nanny import PROTOCOL, FromNanny, ToNanny, decode, encode, mismatch


def test_a_connect_file_of_another_version_is_refused_by_the_nanny() -> None:
    info = ConnectInfo("10.0.0.1", 5555, "k" * 40, "token", "abc123")
    assert ConnectInfo.loads(info.dumps(), "connect.json") == info
    old = dict(json.loads(info.dumps()), protocol=1)
    with pytest.raises(ClorchError, match=r"the connect info in /shared/c\.json speaks protocol 1, this "
                                          rf"clorch_repl speaks protocol {PROTOCOL}: install the same clorch_repl"):
        ConnectInfo.loads(json.dumps(old), "/shared/c.json")
    del old["protocol"]
    with pytest.raises(ClorchError, match="no protocol version"):
        ConnectInfo.loads(json.dumps(old), "/shared/c.json")


def test_a_nanny_of_another_version_is_refused_by_the_notebook(tmp_path: pathlib.Path) -> None:
    server = CallbackServer("127.0.0.1", 0, str(tmp_path / "connect.json"), world_size=1)
    nanny = zmq.Context.instance().socket(zmq.DEALER)
    try:
        nanny.curve_publickey, nanny.curve_secretkey = zmq.curve_keypair()
        nanny.curve_serverkey = server.info.server_key.encode()
        nanny.connect(f"tcp://127.0.0.1:{server.info.port}")
        nanny.send(encode({"op": FromNanny.REGISTER, "protocol": PROTOCOL + 1, "token": server.info.token,
                           "rank": 0, "world_size": 1, "host": "hostB"}))
        assert nanny.poll(20_000), "the endpoint never answered"
        answer = decode(nanny.recv())
        assert answer is not None and answer["op"] == ToNanny.REFUSED
        assert answer["why"] == (f"rank 0 on hostB speaks protocol {PROTOCOL + 1}, this clorch_repl "
                                 f"speaks protocol {PROTOCOL}: install the same clorch_repl version on every host")
        assert server.peers == {} and server.refused == [answer["why"]]
    finally:
        nanny.close(linger=0)
        server.close()


def test_only_the_same_version_passes() -> None:
    assert mismatch(PROTOCOL, "x") is None
    assert mismatch(str(PROTOCOL), "x") is not None  # a string is not the version
    assert decode(b"not json") is None and decode(b"[1]") is None


def test_clorch_rank_help_describes_the_orphan_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    """``clorch-rank --help`` printed a traceback (argparse read "%clorch" as a format)."""
    from clorch_repl.host.nanny import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "%clorch start --orphan-timeout" in " ".join(capsys.readouterr().out.split())
