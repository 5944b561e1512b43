"""A rank's answer to "does this cell hold top-level await?" (clorch_repl.kernel.rank_kernel.cheap_async_check)
is IPython's for every cell, without IPython's compile for cells that cannot be coroutines.

A real IPython shell (no kernel needed: the check is the shell's); each cell is asked of the
shell with the check installed and of IPython's own method, and the answers must agree."""

from __future__ import annotations

from typing import Iterator

import pytest
from IPython.core.interactiveshell import InteractiveShell

pytest.importorskip("ipykernel")
from clorch_repl.kernel.rank_kernel import cheap_async_check  # noqa: E402  (imports ipykernel)

#: (cell, whether IPython runs it as a coroutine): both answers, and cells holding the words that are not
CELLS = [
    ("pass", False), ("x = 1\nprint(x)", False), ("await asyncio.sleep(0)", True),
    ("import asyncio\nawait asyncio.sleep(0)", True), ("async with lock:\n    pass", True),
    ("async for x in it():\n    print(x)", True), ("[x async for x in agen()]", True),
    ("async def f():\n    await g()\n", False), ("def f():\n    return 1\nawait f2()", True),
    ("s = 'await is a word here'", False), ("# async in a comment", False), ("x = await", False),
    ("for i in range(3):\n    await step(i)", True), ("print('no coroutine')\n" * 50, False),
    ("%time await x", False),
]


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    """The process's one shell (the tests' shared ``ip`` where it exists: a second shell would
    take over ``__main__`` and ``get_ipython()``), with the rank's check while the test runs."""
    shell = InteractiveShell.instance()
    cheap_async_check(shell)
    yield shell
    vars(shell).pop("should_run_async", None)


def ipythons_answer(shell: InteractiveShell, cell: str, transformed: str) -> bool:
    """IPython's own check (the class's method, under the instance's)."""
    return type(shell).should_run_async(shell, cell, transformed_cell=transformed, preprocessing_exc_tuple=None)


@pytest.mark.parametrize("cell, coroutine", CELLS)
def test_the_answer_is_ipythons(shell: InteractiveShell, cell: str, coroutine: bool) -> None:
    transformed = shell.transform_cell(cell)
    assert ipythons_answer(shell, cell, transformed) is coroutine
    assert shell.should_run_async(cell, transformed_cell=transformed, preprocessing_exc_tuple=None) is coroutine


def test_a_cell_without_the_words_is_not_compiled_and_one_with_them_is(
        shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch) -> None:
    checked = shell
    from IPython.core import interactiveshell

    compiled: list[str] = []
    real = interactiveshell._should_be_async
    monkeypatch.setattr(interactiveshell, "_should_be_async", lambda cell: compiled.append(cell) or real(cell))
    assert checked.should_run_async("x = 1\n", transformed_cell="x = 1\n", preprocessing_exc_tuple=None) is False
    assert compiled == []
    assert checked.should_run_async("await f()\n", transformed_cell="await f()\n", preprocessing_exc_tuple=None)
    assert compiled == ["await f()\n"]
