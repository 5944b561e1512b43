"""The relay's execute requests as a rank reads them on its lean path (clorch_repl.wire.framing).

The relay builds and signs them itself and the rank reads them without jupyter_client's
``Session.deserialize``: what must hold is what that gave, a request only a holder of the rank's
key can make, each accepted once, and nothing else taken for one. Real sessions, real HMAC keys;
no process (the path itself runs in every session test: every cell takes it).
"""

from __future__ import annotations

import json

import pytest
from jupyter_client.session import Session

from clorch_repl.errors import SignatureError
from clorch_repl.wire.framing import (LEAN_KEY, LEAN_MAGIC, REPLY_MAGIC, SEPARATOR, MessageDecoder, MessageEncoder,
                                      compact_reply, lean_reply, peek_execute, read_lean_execute)

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
    # nothing of an unsigned or forged frame is parsed: its signature is checked first
    not_json = LEAN_MAGIC + SEPARATOR.join([b"deadbeef", b"{not json", b"{}", b"{}", b"{}"])
    assert read_lean_execute(rank, [not_json]) is None
    # a validly signed request that is not lean is not recorded: ipykernel's path still reads it once
    _, plain = request(metadata={})
    assert read_lean_execute(rank, plain) is None
    assert plain[0].split(SEPARATOR, 1)[0][len(LEAN_MAGIC):] not in rank.digest_history


def test_a_ranks_lean_reply_reads_back_at_the_relay_and_only_with_the_ranks_key() -> None:
    """A rank answers the relay's request with one lean frame (wire.lean_reply); the relay's
    decoder reads it as the Jupyter reply jupyter_client's Session.send would have made, and
    refuses it forged, tampered or replayed."""
    rank_session = Session(key=KEY)
    _, frames = request()
    _, parent = read_lean_execute(rank_session, [b"router-id", *frames])
    content = {"status": "ok", "execution_count": 3, "user_expressions": {}, "payload": []}
    frame = lean_reply(MessageEncoder(rank_session), rank_session, "execute_reply", content, parent,
                       {"clorch_iopub": 2})
    decoder = MessageDecoder(Session(key=KEY))
    msg = decoder.decode([frame])
    assert msg["msg_type"] == "execute_reply" and msg["content"] == content
    assert msg["parent_header"]["msg_id"] == parent["msg_id"] and msg["metadata"] == {"clorch_iopub": 2}
    assert msg["header"]["session"] == rank_session.session
    with pytest.raises(SignatureError, match="replayed"):
        decoder.decode([frame])
    forged = lean_reply(MessageEncoder(Session(key=b"x" * 32)), rank_session, "execute_reply", content, parent, {})
    with pytest.raises(SignatureError, match="invalid signature"):
        MessageDecoder(Session(key=KEY)).decode([forged])
    with pytest.raises(SignatureError, match="invalid signature"):
        MessageDecoder(Session(key=KEY)).decode([frame.replace(b'"ok"', b'"error"')])
    with pytest.raises(SignatureError, match="malformed lean"):
        MessageDecoder(Session(key=KEY)).decode([LEAN_MAGIC + b"only\x00three\x00parts"])


def test_a_compact_reply_reads_back_as_the_execute_reply_it_stands_for_and_only_with_the_ranks_key() -> None:
    """The compact form (wire.REPLY_MAGIC) carries what the relay reads of a reply: the request it
    answers, the iopub count, the content. Forged, tampered, replayed or passed off from a signed
    Jupyter-form reply, it is refused."""
    rank_session = Session(key=KEY)
    request_id, frames = request()
    _, parent = read_lean_execute(rank_session, [b"router-id", *frames])
    content = {"status": "error", "ename": "ValueError", "evalue": "é", "traceback": ["line"],
               "execution_count": 4}
    frame = compact_reply(MessageEncoder(rank_session), rank_session, parent["msg_id"], 3, content)
    assert frame.startswith(REPLY_MAGIC) and len(frame) < 300
    decoder = MessageDecoder(Session(key=KEY))
    msg = decoder.decode([frame])
    assert msg["msg_type"] == "execute_reply" and msg["content"] == content
    assert msg["parent_header"] == {"msg_id": request_id} and msg["metadata"] == {"clorch_iopub": 3}
    assert msg["header"]["msg_id"] != request_id
    with pytest.raises(SignatureError, match="replayed"):
        decoder.decode([frame])
    forged = compact_reply(MessageEncoder(Session(key=b"x" * 32)), rank_session, parent["msg_id"], 3, content)
    with pytest.raises(SignatureError, match="invalid signature"):
        MessageDecoder(Session(key=KEY)).decode([forged])
    for tampered in (frame.replace(b"ValueError", b"ValueErrox"), frame.replace(b", 3, ", b", 0, ")):
        assert tampered != frame
        with pytest.raises(SignatureError, match="invalid signature"):
            MessageDecoder(Session(key=KEY)).decode([tampered])
    # a signed Jupyter-form reply's parts joined into the compact form do not verify: the magic is signed
    lean = lean_reply(MessageEncoder(rank_session), rank_session, "execute_reply", content, parent, {})
    signature, *rest = lean[len(LEAN_MAGIC):].split(SEPARATOR)
    with pytest.raises(SignatureError, match="invalid signature"):
        MessageDecoder(Session(key=KEY)).decode([REPLY_MAGIC + signature + SEPARATOR + b"".join(rest)])
    # unsigned, where the session has a key
    with pytest.raises(SignatureError, match="unsigned"):
        MessageDecoder(Session(key=KEY)).decode([REPLY_MAGIC + SEPARATOR + frame.split(SEPARATOR, 1)[1]])
    # signed, yet not what a rank writes: refused, not raised later in the relay's loop
    for body in (b'["id", "req", 0, ["not", "an", "object"]]', b'["too", "short"]', b"{not json",
                 b'["id", ["req"], 0, {}]', b'["id", "req", -1, {}]', b'["id", "req", true, {}]',
                 b'[1, "req", 0, {}]'):
        with pytest.raises(SignatureError, match="malformed compact reply"):
            MessageDecoder(Session(key=KEY)).decode([MessageEncoder(rank_session).compact(body)])
    with pytest.raises(SignatureError, match="malformed compact reply"):
        MessageDecoder(Session(key=KEY)).decode([REPLY_MAGIC + b"no separator"])


def test_message_ids_of_the_encoder_never_collide_with_the_sessions_own() -> None:
    session = Session(key=KEY)
    encoder = MessageEncoder(session)
    ours = {encoder.request("execute_request", CONTENT, {LEAN_KEY: True})[0] for _ in range(50)}
    theirs = {session.msg_id for _ in range(50)}
    assert len(ours) == 50 and not ours & theirs


def test_the_head_start_reads_only_signed_fresh_execute_requests_and_records_nothing() -> None:
    """wire.peek_execute: the notebook kernel's look at a front end's message before ipykernel
    reads it; what ipykernel would refuse it refuses too, and ipykernel's own reading (replay
    check included) is left as it was."""
    front = Session(key=KEY)
    kernel = Session(key=KEY)
    msg = front.msg("execute_request", {"code": "%%distributed\npass", "silent": False})
    frames = [b"client-id", *front.serialize(msg)]
    peeked = peek_execute(kernel, frames, b"%%distributed")
    assert peeked is not None and peeked["content"]["code"] == "%%distributed\npass"
    assert peeked["header"]["msg_id"] == msg["header"]["msg_id"]
    assert peek_execute(kernel, frames, b"%%distributed") is not None  # nothing recorded by peeking
    idents, rest = kernel.feed_identities(frames)
    kernel.deserialize(rest)  # ipykernel's reading still accepts it, and records it
    assert peek_execute(kernel, frames, b"%%distributed") is None, "a replayed request was read"
    forged = Session(key=b"y" * 32)
    assert peek_execute(kernel, [b"id", *forged.serialize(forged.msg("execute_request", msg["content"]))],
                        b"%%distributed") is None
    tampered = [b"id", *front.serialize(front.msg("execute_request", msg["content"]))]
    tampered[-1] = tampered[-1].replace(b"pass", b"boom")
    assert peek_execute(kernel, tampered, b"%%distributed") is None
    other = front.msg("comm_msg", {"data": {"code": "%%distributed"}, "comm_id": "c"})
    assert peek_execute(kernel, [b"id", *front.serialize(other)], b"%%distributed") is None
    plain = front.msg("execute_request", {"code": "print(1)"})
    assert peek_execute(kernel, [b"id", *front.serialize(plain)], b"%%distributed") is None
    assert peek_execute(kernel, [b"no delimiter"], b"%%distributed") is None


def test_a_header_with_awkward_names_reads_back_whole() -> None:
    """The encoder writes the header's JSON from a template: a user name with quotes, a percent
    sign or non-ASCII letters must come back as it was, through jupyter_client too."""
    session = Session(key=KEY, username='ü "x" %s %d \\')
    msg_id, frames = MessageEncoder(session).request("execute_request", CONTENT, {LEAN_KEY: True})
    _, msg = read_lean_execute(Session(key=KEY), [b"id", *frames])
    assert msg["header"]["username"] == 'ü "x" %s %d \\' and msg["header"]["msg_id"] == msg_id
    theirs = Session(key=KEY).deserialize(frames[0][len(LEAN_MAGIC):].split(SEPARATOR))
    assert theirs["header"]["username"] == 'ü "x" %s %d \\'


@pytest.mark.parametrize("part", [b'{"a": 1}', b'  {"a": 1}', b'{"a": 1}  ', b'[1, 2]', b'"x"', b'{"a": "\xff"}',
                                  b'{"a": 1} {"b": 2}', b'', b'{"a": '])
def test_a_part_is_read_exactly_as_json_loads_reads_it(part: bytes) -> None:
    """The scanner's shortcut (framing._unpack) neither accepts nor reads anything json.loads would not."""
    from clorch_repl.wire.framing import _unpack

    try:
        expected: object = json.loads(part.decode("utf8", "replace"))
    except ValueError as exc:
        with pytest.raises(type(exc)):
            _unpack(part)
        return
    assert _unpack(part) == expected


def test_the_relay_asks_for_compact_replies_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request says which form the rank answers in (wire.COMPACT_REPLY_KEY): compact by default,
    the Jupyter form with CLORCH_COMPACT_REPLIES=0 (read per cell: relay_cost.py --ab-compact)."""
    from clorch_repl.session.cell_request import packed_request
    from clorch_repl.session.protocol import CellRequest
    from clorch_repl.wire.framing import COMPACT_REPLY_KEY

    cell = CellRequest("pass", (0, 1), cell_number=3)
    monkeypatch.delenv("CLORCH_COMPACT_REPLIES", raising=False)
    metadata = json.loads(packed_request(cell, False, True, True, "")[0])
    assert metadata[COMPACT_REPLY_KEY] is True and metadata[LEAN_KEY] is True
    monkeypatch.setenv("CLORCH_COMPACT_REPLIES", "0")
    metadata = json.loads(packed_request(cell, False, True, True, "")[0])
    assert COMPACT_REPLY_KEY not in metadata and metadata[LEAN_KEY] is True and metadata["clorch_cell"] == 3
