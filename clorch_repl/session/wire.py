"""Reading the ranks' iopub messages on the notebook's side: verified, decoded, and nothing more.

jupyter_client's ``Session.deserialize`` (through a channel's ``get_msg``) does the same checks,
but also parses every header date with dateutil, polls the socket again for each message, and
reaches every setting through traitlets: together most of the notebook kernel's CPU per relayed
cell. The relay reads raw frames instead and hands them here. What is kept is what makes a
message trustworthy: its HMAC signature is verified with the rank's own key, and a signature
seen before is refused (replay), as jupyter_client does.
"""

from __future__ import annotations

import json
from collections import deque
from hmac import compare_digest
from typing import Any

from jupyter_client.session import DELIM, Session

from ..errors import SignatureError


class MessageDecoder:
    """Verifies and decodes the multipart messages of one rank, with that rank's session key."""

    def __init__(self, session: Session) -> None:
        self._auth = session.auth  # an HMAC object keyed with the rank's key (None: signing off)
        self._seen: set[bytes] = set()
        self._order: deque[bytes] = deque()
        self._limit = int(session.digest_history_size)

    def decode(self, frames: list[bytes]) -> dict[str, Any]:
        """``[topic..., DELIM, signature, header, parent, metadata, content, buffers...]`` to a message."""
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
            mac = self._auth.copy()
            for part in (header, parent, metadata, content):
                mac.update(part)
            if not compare_digest(signature, mac.hexdigest().encode()):
                raise SignatureError("invalid signature")
            self._remember(signature)
        head = json.loads(header)
        return {"header": head, "msg_type": head["msg_type"], "parent_header": json.loads(parent),
                "metadata": json.loads(metadata), "content": json.loads(content), "buffers": parts[5:]}

    def _remember(self, signature: bytes) -> None:
        self._seen.add(signature)
        self._order.append(signature)
        if len(self._order) > self._limit:
            self._seen.discard(self._order.popleft())
