"""Reading rank-labelled output back, the way a user reads it: ``[rank 1] x`` (``[rank 1 hostB] x``
in a session across hosts) is rank 1's line and ``[ranks 0-1] x`` is a line both ranks printed. Whether identical lines were merged depends on how
close together the ranks printed them, so tests that do not test merging itself read output
through :func:`lines_of` rather than matching one label."""

from __future__ import annotations

import re

_LABELLED = re.compile(r"^\[ranks? ([0-9,\-]+)(?: [^\]]+)?\] ?(.*)$", re.M)  # "[rank 1 hostB] x" too


def ranks_of(label: str) -> set[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5}."""
    ranks: set[int] = set()
    for part in label.split(","):
        lo, _, hi = part.partition("-")
        ranks.update(range(int(lo), int(hi or lo) + 1))
    return ranks


def lines_of(text: str, rank: int) -> list[str]:
    """The lines ``rank`` printed: labelled with it alone, or merged with others."""
    return [m.group(2) for m in _LABELLED.finditer(text) if rank in ranks_of(m.group(1))]


def said(text: str, prefix: str) -> list[str]:
    """clorch's messages that start with ``prefix`` (the prefix left out), each as one line: clorch
    wraps its messages at a notebook cell's width (clorch_repl.common.human.wrap), continuing a message on
    lines indented by two spaces."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(prefix):
            continue
        parts = [line[len(prefix):]]
        for more in lines[i + 1:]:
            if not more.startswith("  ") or more.startswith("   ") or more.strip().endswith(":"):
                break  # not a continuation: a stack's frame, an evidence heading
            parts.append(more.strip())
        found.append(" ".join(parts))
    return found


def outputs_shown(outputs: list) -> list:
    """A captured cell's displays (IPython's RichOutput), less the empty one the display reserves
    at the top of a cell's output for the held-back line (clorch_repl.notebook.held_notice), which
    a front end shows as nothing until something is held back."""
    return [o for o in outputs
            if not str((getattr(o, "transient", None) or {}).get("display_id", "")).startswith("clorch-held-")]
