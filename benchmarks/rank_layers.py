"""Where a rank's CPU goes in an empty cell, layer by layer, without a profiler's overhead (issue 39).

    python benchmarks/rank_layers.py [--nprocs 64,16] [--cells 300]

Why: at 64 gloo ranks on a 16-core host an empty cell is bounded by the ranks' CPU (64 of them,
about 0.6 ms each on the H200 box, over 16 cores: 2.4 ms of a 3.5 ms relay), so what is left to
win is in the rank. cProfile's overhead doubles a rank's time and distorts the shares; here each
layer of rank 0's path is wrapped once with a ``thread_time`` clock (a few microseconds added in
all) and its CPU summed over ``--cells`` empty cells run on every rank through the engine
(``relay_cost.py``'s session), under the same contention as the real cell.

Printed per rank count, microseconds a cell, each layer with the part of it that is its own (the
layer less the one inside it):

* ``main thread``: rank 0's main thread, all of it (the event loop included);
* ``dispatch_shell``: the kernel's handling of the request (the rest of the main thread is the
  event loop: waking, reading the socket, the task);
* ``_lean_execute``: clorch_repl's lean path (the rest of dispatch_shell is reading and checking
  the request, :func:`clorch_repl.wire.framing.read_lean_execute`);
* ``do_execute``: ipykernel's execute (the rest of the lean path is the parent, SIGINT's handler,
  the reply's packing, signing and sending);
* ``run_cell``: IPython's run of the cell (the rest of do_execute is ipykernel's: the first
  ``transform_cell``, shown apart, the input hooks, the reply's content).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())  # the tree being measured (see relay_cost.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from relay_cost import Quiet, block  # noqa: E402

from clorch_repl.session.engine import RankOutput, local_session  # noqa: E402

#: (layer, object in the rank's namespace, attribute, is a coroutine function), outermost first
LAYERS = (("dispatch_shell", "_k", "dispatch_shell", True), ("_lean_execute", "_k", "_lean_execute", True),
          ("do_execute", "_k", "do_execute", True), ("run_cell", "_sh", "run_cell", False),
          ("transform_cell", "_sh", "transform_cell", False))

SETUP = """
import time as _clk
_sh = get_ipython()
_k = _sh.kernel
_layer_cpu = {{}}
def _layer(obj, name, key, is_async):
    orig = getattr(obj, name)
    if is_async:
        async def timed(*a, **k):
            t0 = _clk.thread_time()
            try:
                return await orig(*a, **k)
            finally:
                _layer_cpu[key] = _layer_cpu.get(key, 0.0) + _clk.thread_time() - t0
    else:
        def timed(*a, **k):
            t0 = _clk.thread_time()
            try:
                return orig(*a, **k)
            finally:
                _layer_cpu[key] = _layer_cpu.get(key, 0.0) + _clk.thread_time() - t0
    setattr(obj, name, timed)
for _key, _obj, _name, _async in {layers!r}:
    _layer(globals()[_obj], _name, _key, _async)
_layer_cpu0 = _clk.thread_time()
"""
REPORT = """
_layer_cpu["main thread"] = _clk.thread_time() - _layer_cpu0
print(repr({{k: v / {cells} * 1e6 for k, v in _layer_cpu.items()}}))
for _key, _obj, _name, _async in {layers!r}:
    delattr(globals()[_obj], _name)  # the instance's wrapper goes: the class's method is back
"""


class Keep(Quiet):
    """Keeps rank 0's printed text (the report)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def output(self, item: RankOutput) -> None:
        if item.rank == 0 and item.kind == "stream":
            self.text += str(item.content.get("text", ""))


def measure(n: int, cells: int) -> None:
    session = local_session(n, "gloo")
    session.start()
    try:
        block(session, max(20, cells // 5))  # warm-up
        assert session.run(SETUP.format(layers=LAYERS), [0], None, Quiet()).ok
        block(session, cells)
        keep = Keep()
        assert session.run(REPORT.format(cells=cells, layers=LAYERS), [0], None, keep).ok
    finally:
        session.stop()
    us = eval(keep.text.strip().splitlines()[-1])  # noqa: S307 - a dict of floats printed by this script
    rows = [("main thread", "dispatch_shell", "the event loop"), ("dispatch_shell", "_lean_execute", "reading the request"),
            ("_lean_execute", "do_execute", "parent, SIGINT, the reply"), ("do_execute", "run_cell", "ipykernel's own"),
            ("run_cell", None, "IPython's run")]
    print(f"n={n}: rank 0's CPU a cell, {cells} empty cells on every rank (us; own = less the layer inside):")
    for layer, inner, own in rows:
        mine = us[layer] - (us[inner] if inner else 0.0)
        print(f"  {layer:>15} {us[layer]:7.1f}   own {mine:6.1f}  {own}")
    print(f"  {'transform_cell':>15} {us['transform_cell']:7.1f}   (within do_execute and run_cell: IPython's, "
          "once a cell)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="64,16")
    parser.add_argument("--cells", type=int, default=300)
    args = parser.parse_args()
    for n in (int(x) for x in args.nprocs.split(",")):
        measure(n, args.cells)


if __name__ == "__main__":
    main()
