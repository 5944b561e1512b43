"""Issue 24: the notebook kernel's memory stays flat over many ``%%distributed`` cells, through a
real notebook kernel. What grew (tracemalloc in the notebook kernel over 300 cells, then the
record itself): IPython's record of each cell's output (``history_manager.outputs``), which the
bound never reached (it was keyed by ``execution_count``, already the next cell's number while a
cell runs), kept whole as tens of thousands of small strings. flood.bound_history now keeps at
most 64 KiB of a cell, joined into one string per record, for the last 200 such cells. Over many
cells of thousands of lines each, after the first ones, the kernel's RSS grows by at most
GROWTH_MIB (it grew 61 MiB over these 60 cells before)."""

from __future__ import annotations

import re

import psutil

from notebook_kernel import clorch_session

CELLS = 80
WARM = 20
#: what those CELLS - WARM cells may add: 60 x 64 KiB of record (4 MB) and the allocator's slack
GROWTH_MIB = 12
RECORD = ("_h = get_ipython().history_manager\n_c = [c for c, outs in _h.outputs.items() "
          "if any('flood' in x for o in outs for x in o.bundle.get('stream', ()))]\n"
          "print('RECORD', len(_c), max(sum(len(x) for o in _h.outputs[c] for x in o.bundle.get('stream', ())) for c in _c), "
          "max(len(o.bundle.get('stream', ())) for c in _c for o in _h.outputs[c]))")


def test_many_cells_of_output_leave_the_notebook_kernels_memory_flat() -> None:
    with clorch_session() as nb:
        # the output must reach the notebook: issue 24's per-rank limits, for both ranks together
        assert nb.run("%env CLORCH_OUTPUT_LINES=20000\n%env CLORCH_OUTPUT_LIMIT=2M\n"
                      "%env CLORCH_OUTPUT_RATE=400k").status == "ok"
        rss = []
        for cell in range(CELLS):
            reply = nb.run(f"%%distributed\nfor k in range(3000):\n    print('flood', rank, k, 'x' * (k % 50))")
            assert reply.status == "ok" and f"flood 1 2999" in reply.text, reply.text[-2000:]
            if cell + 1 in (WARM, CELLS):
                rss.append(psutil.Process(nb.pid).memory_info().rss / 2 ** 20)
        assert rss[1] - rss[0] <= GROWTH_MIB, rss
        found = re.search(r"RECORD (\d+) (\d+) (\d+)", nb.run(RECORD).text)
        cells, chars, pieces = (int(g) for g in found.groups())
        assert cells == CELLS and chars <= 64 * 1024 and pieces == 1, (cells, chars, pieces)
