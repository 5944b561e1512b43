"""The Jupyter wire format between the relay and the ranks, without jupyter_client's overhead.

jupyter_client's ``Session`` (through a channel's ``send`` and ``get_msg``) does the same work,
but also parses and formats every header date (dateutil), polls the socket again for each
message, and reaches every setting through traitlets: together most of the notebook kernel's CPU
per relayed cell, and a good part of a rank's. Here:

* :class:`MessageDecoder`: the relay reads the ranks' raw frames and hands them here;
* :class:`MessageEncoder`: the relay's execute requests, built and signed directly;
* :func:`read_lean_execute`: a rank's kernel reads those requests (see ``clorch_repl.kernel.lean_execute``).

What is kept is what makes a message trustworthy: every message is signed with the rank's own
key (HMAC), every signature is verified, and a signature seen before is refused (replay), as
jupyter_client does. The relay's execute requests travel as one frame (:data:`LEAN_MAGIC`)
holding the Jupyter message's parts; a rank's reply to one is one compact frame
(:func:`compact_reply`, :data:`REPLY_MAGIC`) where the request asks for it, else one lean frame
(:func:`lean_reply`); everything else on the wire is the Jupyter protocol's; dates stay ISO
strings.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import deque
from datetime import datetime, timezone
from hmac import compare_digest
from json.scanner import make_scanner
from typing import Any, Iterable

from jupyter_client.session import DELIM, Session, protocol_version

from ..errors import SignatureError

#: Set in the metadata of the relay's execute requests: the rank's kernel may run them on its lean
#: path (``clorch_repl.kernel.lean_execute``), which sends no ``execute_input`` (nothing reads a rank's copy of
#: the code it was sent) and reads the request without jupyter_client's date parsing. A request
#: must be in the lean frame (:data:`LEAN_MAGIC`) and say this too; any other (another client's,
#: a Jupyter message that only claims it) takes ipykernel's own path.
LEAN_KEY = "clorch_lean"
#: In the metadata of a relay's execute request: the number the notebook shows for the cell, which
#: the rank gives its run of it (``Cell In[12]`` in its traceback, ``In[12]`` in its history).
#: Carried by the request itself: a separate request to renumber the ranks cost a whole round trip
#: before every ``%%distributed`` cell that followed a notebook-only cell.
CELL_NUMBER_KEY = "clorch_cell"
#: In the metadata of a relay's execute request: the rank's output budget for the cell
#: (``flood.Limits.to_wire``), read by the rank's stream; what exceeds it goes to the log only.
OUTPUT_LIMITS_KEY = "clorch_output_limits"
#: In the metadata of a relay's execute request: why the rank may not read stdin in this cell
#: (not in ``--stdin-ranks``, or a front end without input); the rank's ``input()`` raises with
#: that text (clorch_repl.kernel.stdin_policy).
NO_STDIN_KEY = "clorch_no_stdin"
#: Where the rank's own number goes in that text: one request's metadata serves every rank
#: (packed once a cell), and each rank's kernel puts its number in.
NO_STDIN_RANK = "{rank}"
#: How a lean request's single frame starts (see :meth:`MessageEncoder.request`). One frame, not
#: the Jupyter protocol's six: in the notebook kernel each frame sent at the start of a cell cost
#: about 40 us (cProfile of 600 empty cells: 7,200 sends, 0.29 s), about 0.5 ms of every 2-rank
#: cell, while its other threads (IOPub, publishing the cell's busy status and input at that very
#: moment) were busy. Not the GIL, as first thought: a send through libzmq with the GIL held costs
#: as much then (docs/PERFORMANCE.md, issue 27); fewer sends is what helps. Only the rank's kernel reads these (:func:`read_lean_execute`);
#: what it replies and publishes stays Jupyter's.
LEAN_MAGIC = b"clorch-lean/1\x00"
#: Between the parts of a lean frame: JSON never holds a raw NUL (it escapes control characters),
#: and a signature is hex.
SEPARATOR = b"\x00"
#: In the metadata of a rank's reply to such a request: how many iopub messages the request sent
#: (streams, displays, errors, comms) before the reply. The relay ends the rank's part of the cell
#: once it has read the reply and that many, instead of waiting for an idle status, which the
#: lean path no longer sends (see ``clorch_repl.kernel.lean_execute``).
IOPUB_COUNT_KEY = "clorch_iopub"
#: In the metadata of each iopub message a rank counted for that number: the relay counts only
#: these, so a message the rank did not count (a forked child's output, forwarded through
#: ipykernel's pipe) cannot end the rank's part before the counted ones arrived.
COUNTED_KEY = "clorch_counted"
#: In the metadata of a relay's execute request: the rank replies in the compact form
#: (:func:`compact_reply`). Asked for by the request, so that a rank and a notebook of different
#: versions (a detached session reconnected after an upgrade) still understand each other.
COMPACT_REPLY_KEY = "clorch_compact"
#: How a compact reply starts: then its signature and one JSON array, ``[reply's msg_id, request's
#: msg_id, iopub count, content]``, joined by :data:`SEPARATOR`. The signature covers this magic
#: and the array, so that no signed Jupyter message can be passed off as one. A lean reply's five
#: JSON parts (its parent the whole request header, its metadata ipykernel's) cost the notebook
#: 5.2 us to check and read and a rank 9.4 us to build (2-core box); this 2.1 and 2.8.
REPLY_MAGIC = b"clorch-reply/1\x00"


_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def pack(obj: Any) -> bytes:
    """JSON as jupyter_client's default packer writes it (without its fallbacks, which only
    plain dicts of str, bool and numbers never need)."""
    return _JSON.encode(obj).encode("utf8", errors="surrogateescape")



#: the json module's C scanner: one call per part, without ``json.loads``'s checks of its type
#: and the two whitespace matches around it (about 0.7 us a part, four parts a message)
_SCAN = make_scanner(json.JSONDecoder())


def _unpack(part: bytes) -> Any:
    """A part as ``json.loads`` reads it; the scanner's path for a part that is one JSON value
    exactly (all that Jupyter's packers write), ``json.loads`` itself for anything else."""
    text = part.decode("utf8", "replace")
    try:
        value, end = _SCAN(text, 0)
    except StopIteration:  # not a value where it starts (leading whitespace, or no JSON at all)
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def _keyed(auth: Any) -> Any:
    """The OpenSSL HMAC object inside ``auth`` (an ``hmac.HMAC``), whose ``copy`` and ``update``
    skip the Python wrapper's (about a third of a signature's cost); ``auth`` itself otherwise."""
    inner = getattr(auth, "_hmac", None)
    return inner if inner is not None and hasattr(inner, "copy") else auth


def _sign(auth: Any, parts: Iterable[bytes]) -> bytes:
    """The hex HMAC of a message's header, parent, metadata and content with the key ``auth``
    holds (a keyed ``hmac`` object, copied), as jupyter_client's ``Session.sign`` computes it."""
    mac = auth.copy()
    for part in parts:
        mac.update(part)
    return mac.hexdigest().encode()


def utc_date() -> str:
    """Now, as a header's date (ISO 8601, UTC, ``Z``): one a cell serves every rank's request."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class MessageEncoder:
    """Builds signed requests for one rank, with that rank's session (key, id, message counter)."""

    def __init__(self, session: Session) -> None:
        self._auth = None if session.auth is None else _keyed(session.auth)
        self._id = session.session
        self._username = session.username
        #: ids "<session>_<pid>_c<n>": jupyter_client's own for the session are "<session>_<pid>_<n>",
        #: so the two never collide, and no traitlet is read or set per message
        self._id_prefix = f"{session.session}_{os.getpid()}_c"
        self._count = itertools.count()
        #: the header's JSON around its msg_id, msg_type and date, escaped once (a dict packed per
        #: message cost a rank's request a few microseconds of the cell's path)
        fixed = [json.dumps(v, ensure_ascii=False).replace("%", "%%") for v in (self._username, self._id,
                                                                               protocol_version)]
        # the msg_id's JSON is its prefix's, escaped once, and the counter's digits: only the
        # digits change, and digits need no escaping
        prefix = json.dumps(self._id_prefix, ensure_ascii=False)[:-1].replace("%", "%%")
        self._header = ('{"msg_id": ' + prefix + '%d", "msg_type": %s, "username": ' + fixed[0] + ', "session": '
                        + fixed[1] + ', "date": "%s", "version": ' + fixed[2] + '}')
        #: each msg_type's JSON, escaped once
        self._types: dict[str, str] = {}

    def request(self, msg_type: str, content: dict[str, Any],
                metadata: dict[str, Any]) -> tuple[str, list[bytes]]:
        """The msg_id and the frames of a request (for a DEALER socket: no identities): one
        frame, :data:`LEAN_MAGIC` then the Jupyter message's signature, header, parent, metadata
        and content, each as jupyter_client would write it, joined by :data:`SEPARATOR`."""
        return self.request_packed(msg_type, pack(metadata), pack(content))

    def request_packed(self, msg_type: str, metadata: bytes, content: bytes,
                       date: str | None = None) -> tuple[str, list[bytes]]:
        """:meth:`request` of a metadata and content already packed (:func:`pack`): a cell's,
        packed once for all its ranks (``date``: its :func:`utc_date`, taken once for all)."""
        msg_id, frame = self.frame(msg_type, b"{}", metadata, content, date)
        return msg_id, [frame]

    def frame(self, msg_type: str, parent: bytes, metadata: bytes, content: bytes,
              date: str | None = None) -> tuple[str, bytes]:
        """The msg_id and the one lean frame of a message whose parts are already packed: a
        request (``parent`` ``b"{}"``), or a rank's reply to a lean request (:func:`lean_reply`).
        ``date``: the header's (:func:`utc_date`; now when None)."""
        count = next(self._count)
        type_json = self._types.get(msg_type)
        if type_json is None:
            type_json = self._types[msg_type] = json.dumps(msg_type)
        header = (self._header % (count, type_json, date or utc_date())).encode("utf8", errors="surrogateescape")
        signature = b""
        if self._auth is not None:
            mac = self._auth.copy()
            mac.update(header)
            mac.update(parent)
            mac.update(metadata)
            mac.update(content)
            signature = mac.hexdigest().encode()
        return f"{self._id_prefix}{count}", LEAN_MAGIC + SEPARATOR.join((signature, header, parent, metadata, content))

    def next_id(self) -> str:
        """A fresh msg_id of this encoder's (a compact reply's own)."""
        return f"{self._id_prefix}{next(self._count)}"

    def compact(self, body: bytes) -> bytes:
        """The signed frame of a compact reply (:data:`REPLY_MAGIC`) whose array is ``body``."""
        signature = b""
        if self._auth is not None:
            mac = self._auth.copy()
            mac.update(REPLY_MAGIC)
            mac.update(body)
            signature = mac.hexdigest().encode()
        return REPLY_MAGIC + signature + SEPARATOR + body


def lean_reply(encoder: MessageEncoder, session: Session, msg_type: str, content: dict[str, Any],
               parent: dict[str, Any], metadata: dict[str, Any]) -> bytes:
    """In a rank's kernel: the one frame of its reply to a lean request, signed with its
    session's key, for the relay's :meth:`MessageDecoder.decode` (after the identities).
    Jupyter's seven frames cost the rank a GIL release and a send each (about 0.1 ms of
    every cell, docs/PERFORMANCE.md); only the relay, which sent the request, reads the
    reply. The parts are packed by the session's own packer, as ``Session.send`` packs them."""
    parent_header = parent.get("header") if isinstance(parent.get("header"), dict) else {}
    pack = session.pack
    return encoder.frame(msg_type, pack(parent_header), pack(metadata), pack(content))[1]


def compact_reply(encoder: MessageEncoder, session: Session, parent_id: str, count: int,
                  content: dict[str, Any]) -> bytes:
    """In a rank's kernel: the one frame of its compact reply (:data:`REPLY_MAGIC`) to the lean
    request ``parent_id``, which sent ``count`` iopub messages; packed by the session's own packer
    (its fallbacks for what plain JSON cannot hold) and signed with its key."""
    return encoder.compact(session.pack([encoder.next_id(), parent_id, count, content]))


def read_lean_execute(session: Session, frames: list[Any]) -> tuple[list[bytes], dict[str, Any]] | None:
    """In a rank's kernel: the identities and message of an execute request that asks for the lean
    path (:data:`LEAN_KEY`), verified like jupyter_client's ``Session.deserialize`` does (signature,
    replay) and recorded in the session's digest history; None for any other message, and for one
    that fails the checks, which ipykernel's own path then reads, refuses and logs as it always has.
    """
    if not frames:
        return None
    last = frames[-1].bytes if hasattr(frames[-1], "bytes") else bytes(frames[-1])
    if not last.startswith(LEAN_MAGIC):
        return None  # a Jupyter message: ipykernel's own path
    idents = [f.bytes if hasattr(f, "bytes") else bytes(f) for f in frames[:-1]]
    parts = last[len(LEAN_MAGIC):].split(SEPARATOR, 4)  # a stray NUL in the content cannot cut it
    if len(parts) != 5:
        return None
    signature, header_b, parent_b, metadata_b, content_b = parts
    add_digest = getattr(session, "_add_digest", None)
    if session.auth is not None:  # verified before anything in it is parsed, as jupyter_client does
        if add_digest is None or not signature or signature in session.digest_history:
            return None
        if not compare_digest(signature, _sign(session.auth, (header_b, parent_b, metadata_b, content_b))):
            return None
    header = _unpack(header_b)
    if not isinstance(header, dict) or header.get("msg_type") != "execute_request" or header.get("subshell_id"):
        return None
    metadata = _unpack(metadata_b)
    if not isinstance(metadata, dict) or not metadata.get(LEAN_KEY):
        return None
    if session.auth is not None:
        add_digest(signature)  # type: ignore[misc]  # recorded only for a request taken here
    content = _unpack(content_b)
    if not isinstance(content, dict):
        return None
    return idents, {"header": header, "msg_id": header["msg_id"], "msg_type": "execute_request",
                    "parent_header": _unpack(parent_b), "metadata": metadata, "content": content,
                    "buffers": []}


def peek_execute(session: Session, frames: list[Any], marker: bytes) -> dict[str, Any] | None:
    """In the notebook kernel: the header and content of an execute_request from its front end
    whose content holds ``marker``, before ipykernel reads it (clorch_repl.magics.head_start);
    None for any other message, and for one that is unsigned, forged or replayed (ipykernel then
    refuses it as it always does). Nothing is recorded: ipykernel's own reading still checks the
    signature and adds it to the session's replay history. Dates are left as strings (no
    dateutil). Other messages cost only the search for ``marker`` in their content frame."""
    try:  # ipykernel's dispatch passes zmq frames (copy=False); bytes are read as bytes
        _, parts = session.feed_identities(frames, copy=bool(frames) and isinstance(frames[0], bytes))
    except ValueError:
        return None
    if len(parts) < 5:
        return None
    content_b = parts[4].bytes if hasattr(parts[4], "bytes") else bytes(parts[4])
    if marker not in content_b:
        return None  # the other frames are not even copied
    header_b, parent_b, metadata_b = (p.bytes if hasattr(p, "bytes") else bytes(p) for p in parts[1:4])
    raw = [header_b, parent_b, metadata_b, content_b]
    if session.auth is not None:
        signature = parts[0].bytes if hasattr(parts[0], "bytes") else bytes(parts[0])
        if not signature or signature in session.digest_history:
            return None
        if not compare_digest(signature, _sign(session.auth, raw)):
            return None
    header = _unpack(header_b)
    if not isinstance(header, dict) or header.get("msg_type") != "execute_request" or header.get("subshell_id"):
        return None
    content = _unpack(content_b)
    return {"header": header, "content": content} if isinstance(content, dict) else None


class MessageDecoder:
    """Verifies and decodes the multipart messages of one rank, with that rank's session key."""

    def __init__(self, session: Session) -> None:
        # an HMAC object keyed with the rank's key (None: signing off)
        self._auth = None if session.auth is None else _keyed(session.auth)
        self._seen: set[bytes] = set()
        self._order: deque[bytes] = deque()
        self._limit = int(session.digest_history_size)

    def decode(self, frames: list[bytes]) -> dict[str, Any]:
        """``[topic..., DELIM, signature, header, parent, metadata, content, buffers...]`` to a
        message; or one lean frame (:data:`LEAN_MAGIC`, a rank's reply to a lean request); or a
        compact reply (:data:`REPLY_MAGIC`), read as the execute_reply it stands for."""
        if len(frames) == 1 and frames[0].startswith(REPLY_MAGIC):
            return self._compact(frames[0])
        if len(frames) == 1 and frames[0].startswith(LEAN_MAGIC):
            parts = frames[0][len(LEAN_MAGIC):].split(SEPARATOR, 4)
            if len(parts) != 5:
                raise SignatureError("malformed lean message: not 5 parts")
        else:
            try:
                start = frames.index(DELIM) + 1
            except ValueError:
                raise SignatureError("malformed message: no delimiter") from None
            parts = frames[start:]
            if len(parts) < 5:
                raise SignatureError("malformed message: fewer than 5 parts")
        signature, header, parent, metadata, content = parts[:5]
        if self._auth is not None:
            if not signature:
                raise SignatureError("unsigned message")
            if signature in self._seen:
                raise SignatureError("replayed message")
            if not compare_digest(signature, _sign(self._auth, (header, parent, metadata, content))):
                raise SignatureError("invalid signature")
            self._remember(signature)
        head = _unpack(header)  # decoded as jupyter_client's unpacker does (json.loads of bytes guesses the encoding)
        return {"header": head, "msg_type": head["msg_type"], "parent_header": _unpack(parent),
                "metadata": _unpack(metadata), "content": _unpack(content), "buffers": parts[5:]}

    def _compact(self, frame: bytes) -> dict[str, Any]:
        """A compact reply (:data:`REPLY_MAGIC`) read as the execute_reply it stands for, once its
        signature is checked."""
        signature, sep, body = frame[len(REPLY_MAGIC):].partition(SEPARATOR)
        if not sep:
            raise SignatureError("malformed compact reply: no signature")
        if self._auth is not None:
            if not signature:
                raise SignatureError("unsigned message")
            if signature in self._seen:
                raise SignatureError("replayed message")
            mac = self._auth.copy()
            mac.update(REPLY_MAGIC)
            mac.update(body)
            if not compare_digest(signature, mac.hexdigest().encode()):
                raise SignatureError("invalid signature")
            self._remember(signature)
        try:
            own, parent, count, content = _unpack(body)
        except (ValueError, TypeError) as exc:  # signed, yet not the array a rank writes
            raise SignatureError(f"malformed compact reply: {exc}") from None
        # (signed, yet not what a rank writes: refused here rather than raised later, in the relay's loop)
        if not (isinstance(own, str) and isinstance(parent, str) and isinstance(content, dict)
                and isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise SignatureError("malformed compact reply: not [str, str, count, object]")
        return {"header": {"msg_id": own, "msg_type": "execute_reply"}, "msg_type": "execute_reply",
                "parent_header": {"msg_id": parent}, "metadata": {IOPUB_COUNT_KEY: count}, "content": content,
                "buffers": []}

    def _remember(self, signature: bytes) -> None:
        self._seen.add(signature)
        self._order.append(signature)
        if len(self._order) > self._limit:
            self._seen.discard(self._order.popleft())
