"""What a rank's log gets of the cell's displayed results (``%clorch logs RANK``): their text, as
the README promises everything the rank wrote. Fast: the pure rule; tests/integration/test_session.py reads
a real rank's log."""

from __future__ import annotations

from clorch_repl.kernel.display_log import display_log_text


def test_displays_and_results_reach_the_log_as_text() -> None:
    assert display_log_text("execute_result", {"data": {"text/plain": "42"}}) == "42\n"
    assert display_log_text("display_data", {"data": {"text/plain": "   a  b\n0  1  2\n",
                                                      "text/html": "<table/>"}}) == "   a  b\n0  1  2\n"
    assert display_log_text("display_data", {"data": {"image/png": "iVBOR"}}) == "<image/png output>\n"


def test_other_messages_are_not_logged_here() -> None:
    """Streams are echoed where they are written (once); updates and widget traffic are no output."""
    for kind in ("stream", "update_display_data", "comm_msg", "clear_output", "status"):
        assert display_log_text(kind, {"data": {"text/plain": "x"}}) is None
    assert display_log_text("display_data", None) is None


def test_clorch_repl_s_own_announcements_stay_out_of_the_log() -> None:
    """A pulled value or a profile summary travels as a display of a private type: no output."""
    assert display_log_text("display_data", {"data": {"application/x-clorch-value+json": "{}"}}) is None
    assert display_log_text("display_data", {"data": {"application/x-clorch-profile+json": "{}"}}) is None
    assert display_log_text("display_data", {"data": {}}) == "<empty output>\n"
