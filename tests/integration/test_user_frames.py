"""Errors of the package's public functions end at the user's call (issue 35): ``launch()`` and
the checkpoint functions refuse bad input with one of clorch's errors raised several calls deep,
and IPython (the notebook kernel, a rank) used to show 3-4 of clorch_repl's frames before the
message; ``%debug`` opened in the innermost of them. Driven through IPython's shell as a
notebook drives it (each call is refused before a process would start); and ``%clorch debug`` on
a rank whose last error clorch raised on the user's behalf, in a real notebook kernel."""

from __future__ import annotations

import re
import sys
from typing import Any

from IPython.utils.capture import capture_output

from notebook_kernel import clorch_session

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shown(ip: Any, code: str) -> str:
    with capture_output() as cap:
        result = ip.run_cell(code)
    assert not result.success
    return ANSI.sub("", cap.stdout + cap.stderr)


def innermost_file() -> str:
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


def test_launch_and_checkpoint_errors_show_only_the_users_frames(ip: Any) -> None:
    text = shown(ip, "import clorch_repl.distributed as dist\n"
                     "job = dist.launch(nproc_per_node=2, main='os:getcwd', timeout_ms=-1)")
    assert "ConfigError: timeout_ms must be a positive number of milliseconds; got -1" in text, text
    assert "clorch_repl" not in text.replace("import clorch_repl.distributed", ""), text
    assert "----> 2 job = dist.launch(" in text, text
    assert "clorch_repl" not in innermost_file()  # %debug opens at the user's line

    text = shown(ip, "import torch\nfrom clorch_repl.distributed import load_checkpoint\n"
                     "def restore():\n    return load_checkpoint('/nonexistent/x.pt', model=torch.nn.Linear(2, 2))\n"
                     "restore()")
    assert "CheckpointError: no checkpoint at /nonexistent/x.pt" in text, text
    assert "single_file.py" not in text and "ranks.py" not in text and "checkpoint/__init__" not in text, text
    assert "----> 4     return load_checkpoint(" in text, text  # the user's own frames are all kept
    assert "clorch_repl" not in innermost_file()

    # a refusal raised after the ranks agree on it (a sharded folder from another model): the
    # agreement re-raises it while the first is handled, whose chain showed clorch's frames
    text = shown(ip, "import tempfile\nfrom tests import sharded_helpers as sh\n"
                     "from clorch_repl.distributed import load_checkpoint, save_checkpoint\n"
                     "folder = tempfile.mkdtemp() + '/ck'\n"
                     "save_checkpoint(folder, model=sh.build('plain', 1), sharded=True)\n"
                     "load_checkpoint(folder, model=sh.Transformer(dim=sh.DIM * 2))")
    assert "CheckpointError: the checkpoint" in text and "is from another model: different shapes" in text, text
    assert "During handling" not in text and "ranks.py" not in text and "sharded.py" not in text, text
    assert "clorch_repl" not in text.replace("from clorch_repl.distributed import", ""), text


def test_clorch_debug_opens_at_the_users_line_when_clorch_raised_the_error() -> None:
    """init_process_group() refused on the user's behalf (raised in clorch_repl/kernel/torchrun.py):
    the post-mortem's stack ends in the user's function, not in clorch's code."""
    with clorch_session() as nb:
        failed = nb.run("%%distributed\nimport torch.distributed as dist\n"
                        "def setup():\n    dist.init_process_group('gloo', world_size=4)\nsetup()")
        assert failed.status == "error" and "GroupConflict" in failed.text, failed.text
        reply = nb.run("%clorch debug 0", answers=["where", "q"])
        text = ANSI.sub("", reply.text)
        assert "torchrun.py" not in text and "clorch_repl" not in text, text
        assert "dist.init_process_group('gloo', world_size=4)" in text, text  # the user's line, current
