"""clorch_repl.common.procs.tail_bytes (what ``%clorch logs --tail`` and a dead rank's report show)
against a plain reference on random logs: lines, ``\\r`` progress rewrites, ``\\r\\n``, blocks
smaller than a line, and a read limit smaller than the lines asked for."""

from __future__ import annotations

import io
import random

import pytest

from clorch_repl.common.procs import collapse_carriage_returns, tail_bytes


def ref_collapse(data: bytes) -> bytes:
    """Each line shows its last non-empty ``\\r``-separated piece (a trailing ``\\r`` of ``\\r\\n``
    rewrites nothing)."""
    out = []
    for line in data.split(b"\n"):
        pieces = [p for p in line.split(b"\r") if p]
        out.append(pieces[-1] if pieces else b"")
    return b"\n".join(out)


def ref_tail(data: bytes, n: int) -> bytes:
    """The last ``n`` lines of ``data`` as written (the final newline, if any, kept)."""
    ends = data.endswith(b"\n")
    lines = (data[:-1] if ends else data).split(b"\n")
    return b"\n".join(lines[-n:]) + (b"\n" if ends else b"")


def random_log(rng: random.Random) -> bytes:
    size = rng.choice([0, 1, 5, 40, 300])
    alphabet = rng.choice([b"ab\n", b"ab\n\r", b"abcdef\r", b"a\r\n\n"])
    return bytes(rng.choice(alphabet) for _ in range(size))


@pytest.mark.parametrize("seed", range(20))
def test_tail_matches_the_reference_on_random_logs(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        data = random_log(rng)
        n = rng.randint(1, 8)
        block = rng.randint(1, 20)
        max_bytes = rng.choice([len(data) + 1, rng.randint(1, 60), 1 << 20])
        got = tail_bytes(io.BytesIO(data), n, block=block, max_bytes=max_bytes)
        tail = ref_tail(data, n)
        if len(data) <= max_bytes or len(tail) < max_bytes:  # the lines asked for fit: all of them
            assert got == ref_collapse(tail), (data, n, block, max_bytes, got)
        else:  # they do not: what the limit allows, after a line saying so
            note, _, rest = got.partition(b"\n")
            assert note.startswith(b"[clorch_repl: only the last ") and note.endswith(b"its start is in the file itself]"), got
            assert rest == ref_collapse(ref_tail(data[-max_bytes:], n)), (data, n, block, max_bytes, got)


def test_whole_log_and_no_lines() -> None:
    rng = random.Random(7)
    for _ in range(200):
        data = random_log(rng)
        assert tail_bytes(io.BytesIO(data), None) == ref_collapse(data) == collapse_carriage_returns(data)
        assert tail_bytes(io.BytesIO(data), 0) == b""


@pytest.mark.parametrize(("max_bytes", "says"), [(1 << 20, b"1 MiB"), (3 << 20, b"3 MiB"), (65536, b"64 KiB"),
                                                 (1536, b"1.5 KiB"), (100, b"100 bytes")])
def test_the_truncation_note_names_the_limit_read(max_bytes: int, says: bytes) -> None:
    data = b"x" * (2 * max_bytes) + b"\n"  # one line longer than the limit
    got = tail_bytes(io.BytesIO(data), 1, max_bytes=max_bytes)
    assert got.startswith(b"[clorch_repl: only the last " + says + b" of this log were read;"), got[:120]
    assert got.endswith(b"\n" + b"x" * (max_bytes - 1) + b"\n")


def test_a_chosen_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    """MASTER_PORT is bound seconds after it is chosen, by another process: a port from the
    ephemeral range can be taken meanwhile as the source port of any outgoing connection."""
    import socket

    from clorch_repl.common.procs import LOWEST_CHOSEN_PORT, ephemeral_range, free_port

    span = ephemeral_range()
    assert span is not None and span[0] > LOWEST_CHOSEN_PORT + 1000, span  # Linux's default: 32768-60999
    for _ in range(20):
        port = free_port()
        assert LOWEST_CHOSEN_PORT <= port < span[0], (port, span)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: what rank 0's store does with it


def test_a_port_is_still_chosen_when_no_room_is_left_below_the_range(tmp_path) -> None:
    """A range that starts low (or one that cannot be read) leaves port 0's choice."""
    from clorch_repl.common.procs import ephemeral_range, free_port

    assert 1024 <= free_port(ephemeral=(1024, 65535)) <= 65535
    assert free_port(ephemeral=None) > 0
    assert ephemeral_range(str(tmp_path / "missing")) is None
    (tmp_path / "range").write_text("20000\t30000\n")
    assert ephemeral_range(str(tmp_path / "range")) == (20000, 30000)


def test_every_candidate_taken_falls_back_to_port_zero() -> None:
    """When the room below the range is all in use, the choice still succeeds."""
    import socket

    from clorch_repl.common.procs import LOWEST_CHOSEN_PORT, PORT_TRIES, free_port

    held = []
    try:
        port = LOWEST_CHOSEN_PORT
        while len(held) < PORT_TRIES:  # exactly the room there is: every candidate is taken
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
            else:
                held.append(sock)
            port += 1
        top = port
        chosen = free_port(ephemeral=(top, 65535))
        assert chosen >= top, (chosen, top)  # none of the held ones: port 0's
    finally:
        for sock in held:
            sock.close()
