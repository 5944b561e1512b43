"""The relay's message decoder accepts what a rank's session signs and nothing else."""

from __future__ import annotations

import pytest
from jupyter_client.session import Session

from clorch_repl.errors import SignatureError
from clorch_repl.wire.framing import MessageDecoder


def frames(session: Session, msg_type: str = "stream", content: dict | None = None) -> list[bytes]:
    msg = session.msg(msg_type, content or {"name": "stdout", "text": "hi\n"})
    return [b"stream.stdout", *session.serialize(msg)]


def test_signed_messages_decode_and_forgeries_are_refused() -> None:
    rank = Session(key=b"rank-key-" + b"x" * 32)
    decoder = MessageDecoder(Session(key=rank.key))
    good = frames(rank)
    msg = decoder.decode(good)
    assert msg["msg_type"] == "stream" and msg["content"] == {"name": "stdout", "text": "hi\n"}

    with pytest.raises(SignatureError, match="replayed"):
        decoder.decode(good)  # the same signature again

    tampered = frames(rank)
    tampered[-1] = tampered[-1].replace(b"hi", b"rm -rf")
    with pytest.raises(SignatureError, match="invalid signature"):
        decoder.decode(tampered)

    other = frames(Session(key=b"another-key"))
    with pytest.raises(SignatureError, match="invalid signature"):
        decoder.decode(other)

    unsigned = frames(rank)
    unsigned[unsigned.index(b"<IDS|MSG>") + 1] = b""
    with pytest.raises(SignatureError, match="unsigned"):
        decoder.decode(unsigned)

    with pytest.raises(SignatureError, match="malformed"):
        decoder.decode([b"no delimiter here"])
