"""A forked kernel keeps its inherited memory in huge pages (clorch_repl.host.zygote._own_huge_pages).

Where the zygote's memory is in transparent huge pages, a child's writes split each one it writes
into 4 KiB pages for good; after ``_own_huge_pages`` the child's copy is in huge pages of its own
and stays so through the writes. Skipped where this kernel gives the test's memory no huge pages.
"""

from __future__ import annotations

import mmap
import os

import pytest

from clorch_repl.host.zygote import _own_huge_pages

SIZE = 16 << 20


def _huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping holding ``addr``."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head[0] == "AnonHugePages:":
                return int(head[1])
    return 0


def _child_huge_kb(region: mmap.mmap, addr: int, own: bool) -> int:
    """Fork; the child (optionally) takes its own huge pages, writes a byte into every page of the
    region, as CPython writes reference counts, and reports the region's AnonHugePages."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            if own:
                _own_huge_pages()
            for offset in range(0, SIZE, mmap.PAGESIZE):
                region[offset] = 7
            os.write(w, str(_huge_kb(addr)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as fh:
        got = fh.read()
    os.waitpid(pid, 0)
    return int(got)


def test_a_forked_child_keeps_huge_pages_through_its_writes() -> None:
    region = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pytest.skip("no MADV_HUGEPAGE here")
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for offset in range(0, SIZE, mmap.PAGESIZE):
        region[offset] = 1
    before = _huge_kb(addr)
    if before < 4096:
        pytest.skip(f"the region got {before} kB of huge pages (THP off here?)")
    split = _child_huge_kb(region, addr, own=False)
    kept = _child_huge_kb(region, addr, own=True)
    assert split < before, "a child's writes no longer split the inherited huge pages: the test shows nothing"
    assert kept >= before, f"the child kept {kept} kB of {before} kB in huge pages (without: {split} kB)"
