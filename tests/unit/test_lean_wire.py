"""The relay's execute requests as a rank reads them on its lean path (clorch_repl.session.wire).

The relay builds and signs them itself and the rank reads them without jupyter_client's
``Session.deserialize``: what must hold is what that gave, a request only a holder of the rank's
key can make, each accepted once, and nothing else taken for one. Real sessions, real HMAC keys;
no process (the path itself runs in every session test: every cell takes it).
"""

from __future__ import annotations

from jupyter_client.session import Session

from clorch_repl.session.wire import LEAN_KEY, LEAN_MAGIC, SEPARATOR, MessageEncoder, read_lean_execute

KEY = b"0123456789abcdef0123456789abcdef"
CONTENT = {"code": "print('é')", "silent": False, "store_history": True, "user_expressions": {},
           "allow_stdin": False, "stop_on_error": False}


def request(key: bytes = KEY, metadata: dict | None = None) -> tuple[str, list[bytes]]:
    return MessageEncoder(Session(key=key)).request("execute_request", CONTENT,
                                                    {LEAN_KEY: True} if metadata is None else metadata)


def test_a_request_reads_back_as_jupyter_client_would_have_read_it() -> None:
    msg_id, frames = request()
    rank = Session(key=KEY)
    idents, msg = read_lean_execute(rank, [b"router-id", *frames])
    assert idents == [b"router-id"]
    assert msg["msg_id"] == msg_id and msg["msg_type"] == "execute_request"
    assert msg["content"] == CONTENT and msg["metadata"] == {LEAN_KEY: True}
    # one frame holding the Jupyter message's parts: jupyter_client takes those parts as a message
    # it signed itself (signature, header, parent, metadata, content), dates aside
    assert len(frames) == 1 and frames[0].startswith(LEAN_MAGIC)
    theirs = Session(key=KEY).deserialize(frames[0][len(LEAN_MAGIC):].split(SEPARATOR))
    assert theirs["content"] == msg["content"] and theirs["header"]["msg_id"] == msg_id
    assert theirs["header"]["session"] == msg["header"]["session"]


def test_forged_replayed_and_foreign_requests_are_not_taken() -> None:
    rank = Session(key=KEY)
    _, forged = request(key=b"not the rank's key")
    assert read_lean_execute(rank, forged) is None  # ipykernel's own path refuses and logs it
    _, frames = request()
    tampered = list(frames)
    tampered[-1] = tampered[-1].replace(b"print", b"input")
    assert read_lean_execute(rank, tampered) is None
    assert read_lean_execute(rank, frames) is not None
    assert read_lean_execute(rank, frames) is None, "a replayed request was accepted"
    # another client's request (no LEAN_KEY) and other message types take ipykernel's path
    _, plain = request(metadata={})
    assert read_lean_execute(rank, plain) is None
    assert read_lean_execute(rank, [b"stop aborting"]) is None
    # a Jupyter message, even one whose metadata asks for the lean path, is ipykernel's to read
    jupyter = Session(key=KEY)
    msg = jupyter.msg("execute_request", CONTENT, metadata={LEAN_KEY: True})
    assert read_lean_execute(rank, [b"router-id", *jupyter.serialize(msg)]) is None
    assert read_lean_execute(rank, [LEAN_MAGIC + b"only\x00three\x00parts"]) is None
