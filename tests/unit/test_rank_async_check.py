"""A rank's answer to "does this cell hold top-level await?" (clorch_repl.kernel.rank_kernel.cheap_async_check)
is IPython's for every cell, without IPython's compile for cells that cannot be coroutines.

A real IPython shell (no kernel needed: the check is the shell's); each cell is asked of a shell
with the check installed and of one without, and the answers must agree."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

pytest.importorskip("ipykernel")
from clorch_repl.kernel.rank_kernel import cheap_async_check  # noqa: E402  (imports ipykernel)

CELLS = [
    "pass", "x = 1\nprint(x)", "await asyncio.sleep(0)", "import asyncio\nawait asyncio.sleep(0)",
    "async with lock:\n    pass", "async for x in it():\n    print(x)", "[x async for x in agen()]",
    "async def f():\n    await g()\n", "def f():\n    return 1\nawait f2()", "s = 'await is a word here'",
    "# async in a comment", "x = await", "for i in range(3):\n    await step(i)",
    "print('no coroutine')\n" * 50, "%time await x",
]


@pytest.fixture(scope="module")
def shells() -> tuple[InteractiveShell, InteractiveShell]:
    plain = InteractiveShell.instance()
    checked = InteractiveShell()  # a second shell of the same kind, with the rank's check
    cheap_async_check(checked)
    yield plain, checked
    InteractiveShell.clear_instance()


@pytest.mark.parametrize("cell", CELLS)
def test_the_answer_is_ipythons(shells: tuple[InteractiveShell, InteractiveShell], cell: str) -> None:
    plain, checked = shells
    transformed = plain.transform_cell(cell)
    expected = plain.should_run_async(cell, transformed_cell=transformed, preprocessing_exc_tuple=None)
    assert checked.should_run_async(cell, transformed_cell=transformed, preprocessing_exc_tuple=None) is expected


def test_a_cell_without_the_words_is_not_compiled_and_one_with_them_is(
        shells: tuple[InteractiveShell, InteractiveShell], monkeypatch: pytest.MonkeyPatch) -> None:
    _, checked = shells
    from IPython.core import interactiveshell

    compiled: list[str] = []
    real = interactiveshell._should_be_async
    monkeypatch.setattr(interactiveshell, "_should_be_async", lambda cell: compiled.append(cell) or real(cell))
    assert checked.should_run_async("x = 1\n", transformed_cell="x = 1\n", preprocessing_exc_tuple=None) is False
    assert compiled == []
    assert checked.should_run_async("await f()\n", transformed_cell="await f()\n", preprocessing_exc_tuple=None)
    assert compiled == ["await f()\n"]
