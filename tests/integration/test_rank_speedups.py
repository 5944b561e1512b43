"""A live rank runs with the cell path's shortcuts in place (issue 39): each shell request as one
asyncio task (clorch_repl.kernel.shell_recv) and IPython's static transforms remembered per text
(clorch_repl.kernel.transform_memo). Each one steps aside quietly where ipykernel or IPython is
not what it expects, so an upgrade within the pins could turn them off without any test failing
but this one. Real rank kernels through the engine, as the notebook's magic drives them."""

from __future__ import annotations

import json

from clorch_repl.session.engine import CellHooks, local_session

PROBE = """
import json
from clorch_repl.kernel import shell_recv, transform_memo
_ip = get_ipython()
_callback = _ip.kernel.shell_stream._recv_callback
_memo = _ip.input_transformer_manager.transform_cell
print(json.dumps({"one_task": getattr(_callback, "__module__", None) == shell_recv.__name__,
                  "memo": isinstance(_memo, transform_memo.StaticTransformMemo),
                  "remembered": _memo.remembered.cache_info().currsize if hasattr(_memo, "remembered") else 0}))
"""


class Collect(CellHooks):
    def __init__(self) -> None:
        self.text = ""

    def output(self, item) -> None:  # type: ignore[no-untyped-def]
        self.text += str(item.content.get("text", ""))


def test_a_rank_takes_each_request_as_one_task_and_remembers_the_static_transforms() -> None:
    session = local_session(1, "gloo")
    session.start()
    try:
        for _ in range(3):  # the same text again: remembered
            assert session.run("x = 1", None, None, CellHooks()).ok
        hooks = Collect()
        assert session.run(PROBE, None, None, hooks).ok, hooks.text
        seen = json.loads(hooks.text.strip().splitlines()[-1])
        assert seen["one_task"], "the rank's shell requests take ipykernel's two tasks (shell_recv stepped aside)"
        assert seen["memo"], "IPython's static transforms are not remembered on the rank (transform_memo stepped aside)"
        assert seen["remembered"] >= 2  # "x = 1" and the probe itself at least
    finally:
        session.stop()
