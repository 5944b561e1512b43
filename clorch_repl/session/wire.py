"""The Jupyter message session used on the notebook's side of each rank's channels.

Identical to jupyter_client's :class:`~jupyter_client.session.Session` (same HMAC signing and
verification with a fresh random key per rank, same replay protection) except that received
messages skip the conversion of ISO date strings into ``datetime`` objects. The relay never looks
at dates, and that conversion (dateutil's parser, on every header) was the largest cost of
relaying a cell after the ranks' own work.
"""

from __future__ import annotations

from hmac import compare_digest
from typing import Any

from jupyter_client.session import Session


class RankSession(Session):
    """A signing session whose ``deserialize`` leaves header dates as strings."""

    def deserialize(self, msg_list: list[Any], content: bool = True, copy: bool = True) -> dict[str, Any]:
        if not copy:
            msg_list = [bytes(m.bytes) for m in msg_list[:5]] + list(msg_list[5:])
        if len(msg_list) < 5:
            raise TypeError("malformed message, must have at least 5 elements")
        if self.auth is not None:
            signature = msg_list[0]
            if not signature:
                raise ValueError("Unsigned Message")
            if signature in self.digest_history:
                raise ValueError(f"Duplicate Signature: {signature!r}")
            if content:
                self._add_digest(signature)
            if not compare_digest(signature, self.sign(msg_list[1:5])):
                raise ValueError(f"Invalid Signature: {signature!r}")
        header = self.unpack(msg_list[1])
        return {
            "header": header,
            "msg_id": header["msg_id"],
            "msg_type": header["msg_type"],
            "parent_header": self.unpack(msg_list[2]),
            "metadata": self.unpack(msg_list[3]),
            "content": self.unpack(msg_list[4]) if content else msg_list[4],
            "buffers": [memoryview(b) for b in msg_list[5:]],
        }
