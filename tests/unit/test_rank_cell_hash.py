"""A rank names each cell's code (ipykernel's murmur2 file name, in tracebacks and for the debugger)
as ipykernel does, remembering the hash of a text seen before (clorch_repl.kernel.rank_kernel)."""

from __future__ import annotations

import pytest

pytest.importorskip("ipykernel")
from ipykernel import compiler  # noqa: E402

from clorch_repl.kernel import rank_kernel  # noqa: E402  (installs the memo in ipykernel.compiler)

#: ipykernel's own hash (a second copy of its module: the loaded one's name now holds the memo)
ORIGINAL = None


def setup_module() -> None:
    global ORIGINAL
    import importlib.util

    spec = importlib.util.find_spec("ipykernel.compiler")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # a second copy of the module: its murmur2_x86 is ipykernel's own
    ORIGINAL = fresh.murmur2_x86


TEXTS = ["pass", "", "x", "ab", "abc", "print('héllo ✓')\n", "for i in range(3):\n    print(i)\n" * 40]


def test_the_memo_is_installed_and_names_every_cell_as_ipykernel_does() -> None:
    assert getattr(compiler.murmur2_x86, "_clorch_memo", False)
    seed = compiler.get_tmp_hash_seed()
    for text in TEXTS:
        expected = ORIGINAL(text, seed)
        assert compiler.murmur2_x86(text, seed) == expected
        assert compiler.murmur2_x86(text, seed) == expected  # remembered
        assert compiler.get_file_name(text).endswith(f"{expected}.py")


def test_a_text_seen_before_is_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counting(data: str, seed: int) -> int:
        calls.append(data)
        return ORIGINAL(data, seed)

    monkeypatch.setattr(compiler, "murmur2_x86", counting)
    rank_kernel._memoize_cell_hash(compiler)
    for _ in range(3):
        compiler.get_file_name("x = 1\n")
    assert calls == ["x = 1\n"]
    big = "x" * (rank_kernel.HASHED_CHARS + 1)
    compiler.get_file_name(big)
    compiler.get_file_name(big)
    assert calls == ["x = 1\n", big, big]
