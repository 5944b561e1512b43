"""A rank's cell transforms remembered per text (clorch_repl.kernel.transform_memo) give IPython's
result for every cell, and stop remembering once someone registers a transform of their own.

A real IPython shell (the process's one, as tests/unit/test_rank_async_check.py uses it); each
cell is transformed through the memo, twice, and by IPython's own method."""

from __future__ import annotations

from typing import Iterator

import pytest
from IPython.core.interactiveshell import InteractiveShell

from clorch_repl.kernel import transform_memo

CELLS = [
    "pass", "x = 1\nprint(x)", "\n\n  x = 1\n  y = 2\n", ">>> a = 1\n... b = 2\n", "In [1]: a = 1\n   ...: b = 2\n",
    "%%time\nx = 1\n", "%time x = 1", "!ls", "files = !ls", "t = %time 1", "x?", "len??", "%%writefile f\nx\n",
    "def f():\n    return 1\n", "print('no newline at the end')", "", "\n", "# just a comment",
    "for i in range(3):\n    print(i)\n" * 20, "s = '''\n%not a magic\n'''\n",
]


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    """The process's one shell, with the memo while the test runs."""
    shell = InteractiveShell.instance()
    memo = transform_memo.install(shell)
    assert memo is not None
    yield shell
    vars(shell.input_transformer_manager).pop("transform_cell", None)


def ipythons(shell: InteractiveShell, cell: str) -> str:
    manager = shell.input_transformer_manager
    return type(manager).transform_cell(manager, cell)


@pytest.mark.parametrize("cell", CELLS)
def test_every_cell_is_transformed_as_ipython_does_seen_or_not(shell: InteractiveShell, cell: str) -> None:
    manager = shell.input_transformer_manager
    assert manager.transform_cell(cell) == ipythons(shell, cell)
    assert manager.transform_cell(cell) == ipythons(shell, cell)  # the second time, from the memo
    with_memo = shell.transform_cell(cell)  # the shell's whole transform (the prefilter too)
    memo = vars(manager).pop("transform_cell")
    try:
        assert with_memo == shell.transform_cell(cell)  # the same shell without the memo
    finally:
        manager.transform_cell = memo


def test_a_cell_seen_before_is_not_transformed_again(shell: InteractiveShell,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    manager = shell.input_transformer_manager
    memo = vars(manager)["transform_cell"]
    calls: list[str] = []
    real = memo.transform
    monkeypatch.setattr(memo, "transform", lambda cell: calls.append(cell) or real(cell))
    for _ in range(3):
        manager.transform_cell("x = 1\n")
    assert calls == ["x = 1\n"]


def test_a_transform_registered_later_applies_to_a_cell_seen_before(shell: InteractiveShell) -> None:
    manager = shell.input_transformer_manager
    assert manager.transform_cell("x = 1\n") == "x = 1\n"

    def shout(lines: list[str]) -> list[str]:
        return [line.replace("x", "X") for line in lines]

    manager.cleanup_transforms.append(shout)
    try:
        assert manager.transform_cell("x = 1\n") == "X = 1\n"
        assert shell.transform_cell("x = 1\n") == "X = 1\n"
    finally:
        manager.cleanup_transforms.remove(shout)
    assert manager.transform_cell("x = 1\n") == "x = 1\n"


def test_the_memo_keeps_the_most_recent_cells_only(shell: InteractiveShell,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    memo = vars(shell.input_transformer_manager)["transform_cell"]
    calls: list[str] = []
    real = memo.transform
    monkeypatch.setattr(memo, "transform", lambda cell: calls.append(cell) or real(cell))
    for i in range(transform_memo.ENTRIES + 10):
        memo(f"x = {i}\n")
    assert memo.remembered.cache_info().currsize == transform_memo.ENTRIES
    calls.clear()
    memo("x = 10\n")  # among the most recent: remembered
    memo("x = 0\n")  # pushed out by the later ones: transformed again
    assert calls == ["x = 0\n"]
    monkeypatch.setattr(transform_memo, "MAX_CHARS", 60)  # a longer cell is transformed every time
    big = "x = 1\n" * 11
    assert memo(big) == ipythons(shell, big) and memo(big) == ipythons(shell, big)
    assert calls == ["x = 0\n", big, big]


def test_a_manager_with_a_transform_cell_of_its_own_is_left_alone(shell: InteractiveShell) -> None:
    assert transform_memo.install(shell) is None  # the fixture's memo is there already
